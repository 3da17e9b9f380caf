"""The peak/overhead cost model of NOTE [peak cost model] (remat.profile.model), and its exact solvers.

Pure: numpy for the row arithmetic, scipy's HiGHS MILP for the exact searches; no torch.

``predict_peak`` / ``predict_overhead_ms`` / ``peak_floor`` are the public one-shot forms.
``CostModel`` is the same model compiled once for planners that evaluate many choices.

NOTE [valid choice]
A choice maps candidate names to modes (a missing name means KEEP). It is valid when no
candidate and one of its ancestors (the transitive closure of ``CandidateCost.parent``) are
both checkpointed: nested checkpoints replay the inner region twice and the cost model,
which adds the two candidates' savings independently, would double count. The chain
"candidate + its ancestors" is a clique of pairwise-exclusive candidates, which is how the
MILP states it (one ``<= 1`` row per candidate, tighter than one row per pair).

NOTE [exact integer check]
All byte figures are integers; HiGHS works in floating point with tolerances around 1e-7
of its scaled rows. So every row is stated with ``+ 0.5`` bytes of slack (for integer
data ``expr <= rhs + 0.5`` is the same set as ``expr <= rhs``), every solution is rounded
to 0/1 and re-checked here in exact int64 arithmetic, and if that check fails the row
bound is tightened by the overshoot and the MILP solved again (a few tries at most).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Union

import numpy as np

from ..errors import CandidateError, PlanError
from ..profile.model import CandidateCost, ProfileReport
from ..types import CheckpointMode

MIB = 2 ** 20

# What may be checkpointed: None (every candidate, every measured mode), candidate names
# (every measured mode of each), or name -> modes.
Allowed = Union[None, Iterable[str], Mapping[str, Iterable[CheckpointMode]]]

_SOLVER_TIME_LIMIT_S = 30.0   # a planning MILP normally takes milliseconds
_EXACT_TRIES = 4              # NOTE [exact integer check]
_COST_TIE_RTOL = 1e-7         # overheads this close (relative, ms) count as equally cheap


def checkpoint_modes(candidate: CandidateCost) -> list[CheckpointMode]:
    """The non-KEEP modes a candidate was measured in (saved bytes and replay time both known)."""
    return [m for m in candidate.modes if m is not CheckpointMode.KEEP and m in candidate.replay_ms]


def ancestor_chains(candidates: Iterable[CandidateCost]) -> dict[str, tuple[str, ...]]:
    """name -> its enclosing candidates, innermost first. A parent that is not a candidate ends the chain."""
    by_name = {c.name: c for c in candidates}
    chains: dict[str, tuple[str, ...]] = {}
    for c in by_name.values():
        chain: list[str] = []
        p = c.parent
        while p is not None and p in by_name:
            if p == c.name or p in chain:
                raise CandidateError(f"candidate parent links form a cycle through {c.name!r}: "
                                     f"{' -> '.join([c.name, *chain, p])}")
            chain.append(p)
            p = by_name[p].parent
        chains[c.name] = tuple(chain)
    return chains


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """One (candidate, non-KEEP mode) pair a plan may pick: one binary MILP variable."""

    candidate: str
    index: int                # position of the candidate in CostModel.candidates
    mode: CheckpointMode
    saved_bytes: int          # freed from fwd end of the candidate to its backward (bytes)
    extra_bytes: int          # extra live while it replays (bytes)
    replay_ms: float          # added backward time (ms)


class CostModel:
    """A ProfileReport compiled for evaluation: peak(x) = max(base + delta @ x) over deduplicated rows.

    ``x`` is a 0/1 vector over ``options``. Rows with the same signature restricted to the
    plannable candidates are merged (largest base wins): that is exact, since two rows that
    react identically to every choice only ever matter through the larger one.
    A report without rows predicts its baseline peak for every choice.
    """

    def __init__(self, report: ProfileReport, allowed: Allowed = None) -> None:
        cands = sorted(report.candidates, key=lambda c: (c.order, c.name))
        names = [c.name for c in cands]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CandidateError(f"candidate names must be unique; repeated: {dup}")
        self.candidates = cands
        self.index = {c.name: i for i, c in enumerate(cands)}
        chains = ancestor_chains(cands)
        self.ancestors: list[tuple[int, ...]] = [tuple(self.index[a] for a in chains[c.name]) for c in cands]
        self.related: list[set[int]] = [set(a) for a in self.ancestors]   # ancestors and descendants
        for j, anc in enumerate(self.ancestors):
            for a in anc:
                self.related[a].add(j)

        modes_of = self._allowed_modes(allowed)
        self.options: list[Option] = []
        self.options_of: list[list[int]] = [[] for _ in cands]
        for j, c in enumerate(cands):
            for m in modes_of.get(c.name, ()):
                self.options_of[j].append(len(self.options))
                self.options.append(Option(candidate=c.name, index=j, mode=m, saved_bytes=int(c.saved_bytes[m]),
                                           extra_bytes=int(c.replay_extra_bytes.get(m, 0)),
                                           replay_ms=float(c.replay_ms[m])))
        self.option_index = {(o.candidate, o.mode): k for k, o in enumerate(self.options)}
        self.replay_ms = np.array([o.replay_ms for o in self.options], dtype=np.float64)   # (O,) ms
        self.saved = np.array([o.saved_bytes for o in self.options], dtype=np.int64)      # (O,) bytes
        self._build_rows(report)

    # -- construction -------------------------------------------------------------------

    def _allowed_modes(self, allowed: Allowed) -> dict[str, list[CheckpointMode]]:
        by_name = {c.name: c for c in self.candidates}
        if allowed is None:
            return {c.name: checkpoint_modes(c) for c in self.candidates}
        if isinstance(allowed, Mapping):
            pairs = {name: list(modes) for name, modes in allowed.items()}
        else:
            pairs = {name: None for name in allowed}
        unknown = sorted(n for n in pairs if n not in by_name)
        if unknown:
            raise CandidateError(f"unknown candidate(s) {unknown}; known: {sorted(by_name)[:20]}")
        out: dict[str, list[CheckpointMode]] = {}
        for name, modes in pairs.items():
            measured = checkpoint_modes(by_name[name])
            if modes is None:
                out[name] = measured
                continue
            modes = [CheckpointMode(m) for m in modes if CheckpointMode(m) is not CheckpointMode.KEEP]
            missing = [m.value for m in modes if m not in measured]
            if missing:
                raise CandidateError(f"candidate {name!r} has no measured mode(s) {missing}; "
                                     f"measured: {[m.value for m in measured]}")
            out[name] = [m for m in measured if m in modes]   # canonical enum order
        return out

    def _build_rows(self, report: ProfileReport) -> None:
        plannable = {self.candidates[j].name for j in range(len(self.candidates)) if self.options_of[j]}
        merged: dict[tuple[frozenset[str], frozenset[str]], int] = {}
        for r in report.rows:
            sig = (frozenset(n for n in r.live if n in plannable), frozenset(n for n in r.replaying if n in plannable))
            merged[sig] = max(merged.get(sig, r.base_bytes), r.base_bytes)
        if not merged:
            merged[(frozenset(), frozenset())] = int(report.baseline_peak_bytes)
        sigs = list(merged)
        self.base = np.array([merged[s] for s in sigs], dtype=np.int64)                 # (R,) bytes
        self.delta = np.zeros((len(sigs), len(self.options)), dtype=np.int64)           # (R, O) bytes
        for r, (live, replaying) in enumerate(sigs):
            for name in live:
                for k in self.options_of[self.index[name]]:
                    self.delta[r, k] -= self.options[k].saved_bytes
            for name in replaying:
                for k in self.options_of[self.index[name]]:
                    self.delta[r, k] += self.options[k].extra_bytes
        # Cliques of pairwise-exclusive options (NOTE [valid choice]); only chains with >= 2 options matter.
        cliques = []
        for j in range(len(self.candidates)):
            opts = [k for i in (j, *self.ancestors[j]) for k in self.options_of[i]]
            if len(opts) >= 2:
                cliques.append(opts)
        self.cliques: list[list[int]] = cliques

    # -- evaluation ----------------------------------------------------------------------

    def vector(self, choice: Mapping[str, CheckpointMode]) -> np.ndarray:
        """0/1 option vector of a choice; unknown/unmeasured -> CandidateError, invalid nesting -> PlanError."""
        x = np.zeros(len(self.options), dtype=np.int64)
        unknown = sorted(n for n in choice if n not in self.index)
        if unknown:
            raise CandidateError(f"unknown candidate(s) {unknown}; known: {[c.name for c in self.candidates][:20]}")
        for name, mode in choice.items():
            mode = CheckpointMode(mode)
            if mode is CheckpointMode.KEEP:
                continue
            k = self.option_index.get((name, mode))
            if k is None:
                raise CandidateError(f"candidate {name!r} cannot be planned in mode {mode.value!r} "
                                     f"(measured or allowed modes: {[self.options[i].mode.value for i in self.options_of[self.index[name]]]})")
            x[k] = 1
        self.check_valid(x)
        return x

    def check_valid(self, x: np.ndarray) -> None:
        on = {self.options[k].index for k in np.flatnonzero(x)}
        for j in on:
            clash = [self.candidates[a].name for a in self.ancestors[j] if a in on]
            if clash:
                raise PlanError(f"candidate {self.candidates[j].name!r} and its enclosing candidate(s) {clash} "
                                "are both checkpointed; nested checkpoints are not planned (NOTE [valid choice])")
        if any(len(self.options_of[j]) and int(x[self.options_of[j]].sum()) > 1 for j in on):
            raise PlanError("a candidate was given more than one mode")

    def is_valid(self, x: np.ndarray) -> bool:
        try:
            self.check_valid(x)
        except PlanError:
            return False
        return True

    def rows_of(self, x: np.ndarray) -> np.ndarray:
        """(R,) predicted live bytes per row."""
        return self.base + self.delta @ np.asarray(x, dtype=np.int64)

    def peak(self, x: np.ndarray) -> int:
        """Predicted whole-step peak (bytes)."""
        return int(self.rows_of(x).max())

    def overhead_ms(self, x: np.ndarray) -> float:
        """Predicted added step time (ms)."""
        return math.fsum(self.options[k].replay_ms for k in np.flatnonzero(x))

    def choice(self, x: np.ndarray) -> dict[str, CheckpointMode]:
        return {self.options[k].candidate: self.options[k].mode for k in np.flatnonzero(x)}

    # -- exact searches (HiGHS MILP) -----------------------------------------------------

    def cheapest_within(self, budget_bytes: int) -> np.ndarray | None:
        """The least-overhead valid x with peak(x) <= budget_bytes, exact under the model; None if none exists.

        Among equally cheap choices (overheads within 1e-7 relative) the lowest peak wins:
        a second MILP minimises the peak with the overhead capped at the optimum found by
        the first, so the tie-break can never make the plan more expensive.
        """
        n_opt = len(self.options)
        if n_opt == 0:
            x0 = np.zeros(0, dtype=np.int64)
            return x0 if self.peak(x0) <= budget_bytes else None
        # Rows that stay under the budget whatever is chosen cannot bind: drop them (exact).
        upper = self.base + np.clip(self.delta, 0, None).sum(axis=1)
        binding = np.flatnonzero(upper > budget_bytes)
        x1 = self._solve_exact(objective=self.replay_ms, rows=binding, budget_bytes=budget_bytes)
        if x1 is None:
            return None
        cost1 = self.overhead_ms(x1)
        x2 = self.lowest_peak_x(budget_bytes=budget_bytes,
                                max_overhead_ms=cost1 + _COST_TIE_RTOL * max(1.0, abs(cost1)))
        if x2 is not None and self.peak(x2) < self.peak(x1) and self.peak(x2) <= budget_bytes:
            return x2
        return x1

    def lowest_peak_x(self, *, budget_bytes: int | None = None, max_overhead_ms: float | None = None) -> np.ndarray | None:
        """A valid x of least predicted peak (optionally with peak <= budget, overhead <= cap); None if none."""
        n_opt = len(self.options)
        if n_opt == 0:
            x0 = np.zeros(0, dtype=np.int64)
            return x0 if budget_bytes is None or self.peak(x0) <= budget_bytes else None
        return self._solve_exact(objective=None, rows=np.arange(len(self.base)), budget_bytes=budget_bytes,
                                 max_overhead_ms=max_overhead_ms)

    def _solve_exact(self, *, objective: np.ndarray | None, rows: np.ndarray, budget_bytes: int | None,
                     max_overhead_ms: float | None = None) -> np.ndarray | None:
        """Solve, round, re-check exactly; retighten on a tolerance overshoot (NOTE [exact integer check])."""
        slack = 0.0
        for _ in range(_EXACT_TRIES):
            x = self._milp(objective, rows, budget_bytes, slack, max_overhead_ms)
            if x is None:
                return None
            over = 0 if budget_bytes is None else self.peak(x) - budget_bytes
            if self.is_valid(x) and over <= 0:
                return x
            slack += max(over, 1)
        raise PlanError("the MILP solver's answers kept missing the exact budget check "
                        f"after {_EXACT_TRIES} tries (budget {budget_bytes} bytes)",
                        tip="this points at extreme byte figures in the profile; try --planner greedy")

    def _milp(self, objective: np.ndarray | None, rows: np.ndarray, budget_bytes: int | None, slack: float,
              max_overhead_ms: float | None) -> np.ndarray | None:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array, hstack, vstack

        n_opt = len(self.options)
        minimise_peak = objective is None
        n_var = n_opt + (1 if minimise_peak else 0)          # [x (binary) ..., t (peak, bytes)]
        constraints = []
        delta = csr_array(self.delta[rows].astype(np.float64))
        base = self.base[rows].astype(np.float64)
        if minimise_peak:
            # base_r + delta_r x <= t  <=>  delta_r x - t <= -base_r
            a = hstack([delta, csr_array(-np.ones((len(rows), 1)))], format="csr")
            constraints.append(LinearConstraint(a, -np.inf, -base))
        elif len(rows):
            constraints.append(LinearConstraint(delta, -np.inf, budget_bytes - base + 0.5 - slack))
        if self.cliques:
            data, ri, ci = [], [], []
            for r, opts in enumerate(self.cliques):
                data += [1.0] * len(opts)
                ri += [r] * len(opts)
                ci += opts
            clique = csr_array((data, (ri, ci)), shape=(len(self.cliques), n_var))
            constraints.append(LinearConstraint(clique, -np.inf, 1.0))
        if max_overhead_ms is not None:
            row = np.concatenate([self.replay_ms, np.zeros(n_var - n_opt)])[None, :]
            constraints.append(LinearConstraint(csr_array(row), -np.inf, max_overhead_ms))
        lb = np.zeros(n_var)
        ub = np.ones(n_var)
        integrality = np.ones(n_var)
        if minimise_peak:
            lb[-1] = -np.inf
            ub[-1] = np.inf if budget_bytes is None else budget_bytes + 0.5 - slack
            integrality[-1] = 0
            c = np.zeros(n_var)
            c[-1] = 1.0
        else:
            c = objective.astype(np.float64)
        res = milp(c, integrality=integrality, bounds=Bounds(lb, ub), constraints=constraints or None,
                   options={"mip_rel_gap": 0.0, "time_limit": _SOLVER_TIME_LIMIT_S, "presolve": True})
        if res.status == 2:   # infeasible
            return None
        if res.status != 0 or res.x is None:
            raise PlanError(f"the MILP solver did not finish: {res.message}",
                            tip="try --planner greedy, or fewer candidates")
        return np.rint(res.x[:n_opt]).astype(np.int64)


def predict_peak(report: ProfileReport, choice: Mapping[str, CheckpointMode]) -> int:
    """Predicted whole-step peak (bytes) of a choice (missing names: KEEP). NOTE [peak cost model]."""
    model = CostModel(report)
    return model.peak(model.vector(choice))


def predict_overhead_ms(report: ProfileReport, choice: Mapping[str, CheckpointMode]) -> float:
    """Predicted added step time (ms): the sum of the chosen modes' replay times."""
    model = CostModel(report)
    return model.overhead_ms(model.vector(choice))


def peak_floor(report: ProfileReport, allowed: Allowed = None) -> int:
    """Lowest predicted peak (bytes) any valid choice over ``allowed`` reaches (exact under the model)."""
    model = CostModel(report, allowed)
    x = model.lowest_peak_x()
    assert x is not None   # unconstrained: the all-KEEP choice is always valid
    return model.peak(x)
