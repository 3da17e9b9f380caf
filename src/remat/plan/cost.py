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

Segments (NOTE [segments] in profile/segments.py) do not nest, they *overlap*: ``h[0:4]`` and
``h[2:6]`` share ``h.2``, and ``h[0:4]`` contains ``h.1`` and ``h.1.attn``. Any two candidates
whose covered module paths are equal or nested are exclusive; ``_segment_cliques`` states that
as cliques over shared paths, added to the chain cliques.

NOTE [exact integer check]
All byte figures are integers; HiGHS works in floating point with tolerances around 1e-7.
Bytes are scaled by a power of two (exact in floating point) so that HiGHS sees figures
below 2**20; every budget row carries ``+ 0.5`` bytes of slack (for integer data
``expr <= rhs + 0.5`` is the same set as ``expr <= rhs``); every solution is rounded to 0/1
and re-checked here in exact int64 arithmetic, and if that check fails the bound is
tightened by the overshoot, at least one scale unit (a budget one byte under the floor, with figures
scaled by 512, was tightened a byte a try, which HiGHS cannot see, until the tries ran out), and the
MILP solved again (a few tries at most).

NOTE [MILP reductions]
Before each MILP, exact reductions (none can remove an optimal plan or change its cost):
- row bounds: per row, ``upper`` (every candidate at its worst option) and ``lower`` (at
  its best). Minimising cost under a budget B, a row with upper <= B can never bind. For
  the peak, t >= max(lower) is a valid bound on t, and a row with upper <= that bound is
  implied by it.
- dominance: row r is dropped when a kept row s has row_r(x) <= row_s(x) for every x
  (checked with the same per-candidate bound on row_r - row_s). Chains of forward rows
  are mostly dominated by the backward rows that follow them.
- options that lower no remaining row (and cost >= 0) are fixed to KEEP.
Then two MILPs for ``optimal``: least overhead, then least peak with the overhead capped
at that optimum (the tie-break), each exact up to HiGHS's 1e-6 absolute objective gap.
Minimising the peak uses an *integer* t counted in units of the byte scale (1 byte while
figures stay below 2**20, else 2**(bits - 20) bytes: about 1 ppm of the largest figure):
with a continuous t HiGHS shaves its 1e-6 tolerance off the optimum and then rejects its
own answer ("Solve error"). So ``peak_floor`` is exact for figures below 1 MiB and
otherwise at most one scale unit above the true floor (never below it); budgets are
always checked exactly in bytes.

NOTE [overhead gap]
Proving the least overhead exactly can take HiGHS far longer than finding it: on the built-in
gpt at n_layer 32 (151 candidates, 55 of them segments, 774 rows) one least-overhead MILP took
15.5 s at 45% of the peak, and in a `remat plan --budget 60%` one passed the 30 s limit, so the
plan failed with "the MILP solver did not finish". So the least-overhead MILP is solved exactly
for at most ``_EXACT_TIME_LIMIT_S``; past that, an incumbent HiGHS has proven within
``_OVERHEAD_REL_GAP`` of the optimum is taken, else it is solved again to that gap (up to the
30 s limit; past it the PlanError stands). 1% of the predicted overhead is far inside the
replay costs' own measured spread (NOTE [measured replay costs]), so no measurement could tell
the two plans apart; on that gpt profile a 1% gap solved every budget tried (45%, 62%, 70%) in
0.1-0.3 s, at most 0.35% above the proven optimum. The least-peak MILPs (``peak_floor``, the
floor an infeasible budget reports) stay exact: a looser floor could refuse a budget that fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Union

from .._io import native_output_filtered
from .._lazy import LazyModule
from ..errors import CandidateError, PlanError, spell
from ..errors import Option as Flag   # ``Option`` below is a (candidate, mode) column of the MILP
from ..profile.model import CandidateCost, ProfileReport
from ..types import CheckpointMode
from .offload import host_bytes as host_bytes_of

np = LazyModule("numpy")   # imported at first use: remat.plan imports without numpy (NOTE [import cost] in remat._lazy)

# What may be checkpointed: None (every candidate, every measured mode), candidate names
# (every measured mode of each), or name -> modes.
Allowed = Union[None, Iterable[str], Mapping[str, Iterable[CheckpointMode]]]

_SOLVER_TIME_LIMIT_S = 30.0   # a planning MILP normally takes milliseconds
_EXACT_TIME_LIMIT_S = 2.0     # NOTE [overhead gap]: the least overhead proven exactly for this long
_OVERHEAD_REL_GAP = 0.01      # NOTE [overhead gap]: then within 1% of it
_TIE_BREAK_TIME_LIMIT_S = 0.25   # the lower-peak tie-break among equally cheap plans is best effort
_EXACT_TRIES = 4              # NOTE [exact integer check]
_COST_UNITS = 2 ** 30         # NOTE [scale-free costs]: the dearest option's replay, in integer units
_SCALE_BITS = 20              # NOTE [exact integer check]
_DOMINANCE_MAX_ROWS = 400     # O(R^2 C) dominance pruning above this would cost more than it saves


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


def _segment_cliques(cands: list[CandidateCost]) -> list[list[int]]:
    """Cliques of candidates that overlap a segment (NOTE [valid choice]), as candidate indices.

    A candidate *covers* module paths (itself; a segment its members). Two candidates
    conflict when a path one covers is equal to, or inside, a path the other covers. For
    every covered path q, the candidates covering q or an ancestor of q all contain q, so
    they pairwise conflict: a clique; and every conflicting pair shares one such q (the
    inner of the two paths). Only cliques with a segment in them are returned (the parent
    chains already state the rest).
    """
    if not any(c.members for c in cands):
        return []
    covers = [c.covers for c in cands]

    def within(q: str, p: str) -> bool:   # q is p or inside p's subtree
        return q == p or q.startswith(p + ".")

    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for q in sorted({p for cv in covers for p in cv}):
        clique = tuple(j for j, cv in enumerate(covers) if any(within(q, p) for p in cv))
        if len(clique) >= 2 and any(cands[j].members for j in clique) and clique not in seen:
            seen.add(clique)
            out.append(list(clique))
    return out


def _check_unique_names(cands: list[CandidateCost]) -> None:
    names = [c.name for c in cands]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CandidateError(f"candidate names must be unique; repeated: {dup}")


_Signature = tuple[tuple[str, ...], frozenset[str]]   # (live, sorted, a shared one per held call; replaying)


def _merged_rows(report: ProfileReport, plannable: set[str]) -> dict[_Signature, int]:
    """Row signature restricted to ``plannable`` -> its largest base (bytes); the baseline peak without rows."""
    merged: dict[_Signature, int] = {}
    for r in report.rows:
        # a shared module is listed once per call whose activations are held (NOTE [peak cost model])
        sig = (tuple(sorted(n for n in r.live if n in plannable)), frozenset(n for n in r.replaying if n in plannable))
        merged[sig] = max(merged.get(sig, r.base_bytes), r.base_bytes)
    if not merged:
        merged[((), frozenset())] = int(report.baseline_peak_bytes)
    return merged


def _byte_scale(delta: np.ndarray, base: np.ndarray, budget_bytes: int | None) -> int:
    """NOTE [exact integer check]: the power of two that brings every byte figure below 2**20."""
    top = int(max(np.abs(delta).max(initial=0), np.abs(base).max(initial=0), abs(budget_bytes or 0), 1))
    return 2 ** max(0, top.bit_length() - _SCALE_BITS)


def _row_constraints(delta: np.ndarray, base: np.ndarray, scale: int, *, minimise_peak: bool,
                     budget_bytes: int | None, slack: int) -> list:
    """Each row under the peak variable t (``minimise_peak``) or under the budget (+ 0.5 - slack bytes), scaled."""
    from scipy.optimize import LinearConstraint
    from scipy.sparse import csr_array, hstack

    if len(base) == 0:
        return []
    a_rows = csr_array(delta / scale)
    if minimise_peak:
        # base_r + delta_r x <= t  <=>  delta_r x - t <= -base_r
        a = hstack([a_rows, csr_array(-np.ones((len(base), 1)))], format="csr")
        return [LinearConstraint(a, -np.inf, -base / scale)]
    return [LinearConstraint(a_rows, -np.inf, (budget_bytes - base + 0.5 - slack) / scale)]


def _within_gap(res) -> bool:  # noqa: ANN001 - scipy's OptimizeResult
    """A HiGHS incumbent proven within ``_OVERHEAD_REL_GAP`` of the optimum (NOTE [overhead gap])."""
    gap = getattr(res, "mip_gap", None)
    return res.x is not None and gap is not None and math.isfinite(gap) and gap <= _OVERHEAD_REL_GAP


def _cost_units(replay_ms: np.ndarray) -> np.ndarray:
    """Each option's replay in integer units of the dearest one's 1/_COST_UNITS (NOTE [scale-free costs]).

    NOTE [scale-free costs]
    Prices from counts (NOTE [prices from counts] in remat/profile/prices.py) are one factor times a
    work that does not change between profiles, so the cheapest plan does not change either, except
    where plans tie: identical blocks cost exactly the same, and which of two equally cheap plans
    HiGHS returns can follow the factor's last bits (GPT-2 at 70%, three profiles: ``h.1`` selective
    in one plan, ``h.2`` in another, at one cost). So the MILPs do not see milliseconds: each option's
    replay is an integer count of 1/2^30 of the dearest option's, the same integers whatever the
    factor, and the same MILP gives the same plan. Equally cheap means the same count up to one unit
    per option (each was rounded once); 2^30 units keep a price of 1 ns in a 1 s replay apart from 0."""
    top = float(np.abs(replay_ms).max()) if replay_ms.size else 0.0
    return np.rint(replay_ms * (_COST_UNITS / top)) if top > 0.0 else np.zeros_like(replay_ms)


def _overhead_constraint(ms: np.ndarray, n_var: int, max_overhead_ms: float):
    """Total replay cost of the chosen options <= ``max_overhead_ms`` (in the units ``ms`` is in; t, if any, has no
    cost)."""
    from scipy.optimize import LinearConstraint
    from scipy.sparse import csr_array

    row = np.concatenate([ms, np.zeros(n_var - len(ms))])[None, :]
    return LinearConstraint(csr_array(row), -np.inf, max_overhead_ms)


def _host_constraint(host: np.ndarray, n_var: int, host_budget_bytes: int):
    """sum(host bytes of the offloaded options) <= host budget; scaled like the byte rows (NOTE [exact integer check])."""
    from scipy.optimize import LinearConstraint
    scale = _byte_scale(host.reshape(1, -1), np.zeros(1, dtype=np.int64), host_budget_bytes)
    row = np.zeros(n_var)
    row[:len(host)] = host / scale
    return LinearConstraint(row.reshape(1, -1), -np.inf, (host_budget_bytes + 0.5) / scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """One (candidate, non-KEEP mode) pair a plan may pick: one binary MILP variable."""

    candidate: str
    index: int                # position of the candidate in CostModel.candidates
    mode: CheckpointMode
    saved_bytes: int          # freed from fwd end of the candidate to its backward (bytes)
    extra_bytes: int          # extra live while it replays (bytes)
    replay_ms: float          # added backward time (ms)
    host_bytes: int = 0       # held in host memory until its backward (OFFLOAD, FULL_HOST_INPUT; bytes)


class CostModel:
    """A ProfileReport compiled for evaluation: peak(x) = max(base + delta @ x) over deduplicated rows.

    ``x`` is a 0/1 vector over ``options``. Rows with the same signature restricted to the
    plannable candidates are merged (largest base wins): that is exact, since two rows that
    react identically to every choice only ever matter through the larger one.
    A report without rows predicts its baseline peak for every choice.
    """

    def __init__(self, report: ProfileReport, allowed: Allowed = None, *, host_budget_bytes: int | None = None) -> None:
        cands = sorted(report.candidates, key=lambda c: (c.order, c.name))
        _check_unique_names(cands)
        self.candidates = cands
        self.host_budget_bytes = host_budget_bytes   # bound on offloaded bytes (NOTE [offload cost model]), or None
        self.index = {c.name: i for i, c in enumerate(cands)}
        self._build_relations()
        self._build_options(self._allowed_modes(allowed))
        self._build_rows(report)

    # -- construction -------------------------------------------------------------------

    def _build_relations(self) -> None:
        """Ancestors per candidate, and every candidate it may not be checkpointed with (NOTE [valid choice])."""
        chains = ancestor_chains(self.candidates)
        self.ancestors: list[tuple[int, ...]] = [tuple(self.index[a] for a in chains[c.name]) for c in self.candidates]
        self.related: list[set[int]] = [set(a) for a in self.ancestors]   # ancestors and descendants
        for j, anc in enumerate(self.ancestors):
            for a in anc:
                self.related[a].add(j)
        self.segment_cliques = _segment_cliques(self.candidates)   # NOTE [valid choice]: segments overlap, not nest
        for clique in self.segment_cliques:
            for a in clique:
                self.related[a].update(b for b in clique if b != a)

    def _build_options(self, modes_of: dict[str, list[CheckpointMode]]) -> None:
        """One Option per (candidate, allowed mode), candidates' options contiguous, in candidate order."""
        self.options: list[Option] = []
        self.options_of: list[list[int]] = [[] for _ in self.candidates]
        for j, c in enumerate(self.candidates):
            for m in modes_of.get(c.name, ()):
                self.options_of[j].append(len(self.options))
                self.options.append(Option(candidate=c.name, index=j, mode=m, saved_bytes=int(c.saved_bytes[m]),
                                           extra_bytes=int(c.replay_extra_bytes.get(m, 0)),
                                           replay_ms=float(c.replay_ms[m]),
                                           host_bytes=host_bytes_of(c, m)))
        self.option_index = {(o.candidate, o.mode): k for k, o in enumerate(self.options)}
        self.replay_ms = np.array([o.replay_ms for o in self.options], dtype=np.float64)   # (O,) ms
        self.replay_units = _cost_units(self.replay_ms)   # (O,) what the MILPs minimise (NOTE [scale-free costs])
        self.saved = np.array([o.saved_bytes for o in self.options], dtype=np.int64)      # (O,) bytes
        self.host = np.array([o.host_bytes for o in self.options], dtype=np.int64)        # (O,) bytes

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
        """base (R,) and delta (R, O) over the merged rows, and the option cliques."""
        plannable = {self.candidates[j].name for j in range(len(self.candidates)) if self.options_of[j]}
        merged = _merged_rows(report, plannable)
        sigs = list(merged)
        self.base = np.array([merged[s] for s in sigs], dtype=np.int64)                 # (R,) bytes
        self.delta = np.zeros((len(sigs), len(self.options)), dtype=np.int64)           # (R, O) bytes
        for r, (live, replaying) in enumerate(sigs):
            for name, held in Counter(live).items():        # held: calls of it held here (NOTE [peak cost model])
                calls = self.candidates[self.index[name]].calls
                for k in self.options_of[self.index[name]]:
                    self.delta[r, k] -= self.options[k].saved_bytes * min(held, calls) // calls
            for name in replaying:
                for k in self.options_of[self.index[name]]:
                    self.delta[r, k] += self.options[k].extra_bytes
        self.cliques: list[list[int]] = self._option_cliques()

    def _option_cliques(self) -> list[list[int]]:
        """Cliques of pairwise-exclusive options (NOTE [valid choice]); only chains with >= 2 options matter."""
        chains = [(j, *self.ancestors[j]) for j in range(len(self.candidates))]
        cliques = [[k for i in group for k in self.options_of[i]] for group in [*chains, *self.segment_cliques]]
        return [opts for opts in cliques if len(opts) >= 2]

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
                modes = [self.options[i].mode.value for i in self.options_of[self.index[name]]]
                raise CandidateError(f"candidate {name!r} cannot be planned in mode {mode.value!r} "
                                     f"(measured and allowed modes: {modes})")
            x[k] = 1
        self.check_valid(x)
        return x

    def check_valid(self, x: np.ndarray) -> None:
        on = {self.options[k].index for k in np.flatnonzero(x)}
        for j in on:
            clash = [self.candidates[a].name for a in sorted(self.related[j]) if a in on and a != j]
            if clash:
                raise PlanError(f"candidate {self.candidates[j].name!r} and candidate(s) {clash} that enclose it, "
                                "lie inside it or overlap it are both checkpointed; nested or overlapping "
                                "checkpoints are not planned (NOTE [valid choice])")
        if any(len(self.options_of[j]) and int(x[self.options_of[j]].sum()) > 1 for j in on):
            raise PlanError("a candidate was given more than one mode")
        if not self.host_fits(x):
            raise PlanError(f"the offloaded boundaries hold {int(self.host @ x)} bytes in host memory, over the "
                            f"host budget of {self.host_budget_bytes} bytes (NOTE [offload cost model])")

    def host_fits(self, x: np.ndarray) -> bool:
        """The offloaded bytes of ``x`` stay within the host budget (always, without one)."""
        return self.host_budget_bytes is None or int(self.host @ np.asarray(x, dtype=np.int64)) <= self.host_budget_bytes

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

        Among equally cheap choices (the same cost in the MILP's units, NOTE [scale-free costs]) the lowest
        peak wins: a second MILP minimises the peak with the overhead capped at the optimum
        found by the first, so the tie-break can never make the plan more expensive. The
        tie-break is best effort: it gets a short time limit (its best answer so far is
        taken), and if it fails the first answer stands.
        """
        x1 = self._solve_exact(minimise_peak=False, budget_bytes=budget_bytes)
        if x1 is None:
            return None
        # equally cheap: the same integer cost, up to each option's rounding (NOTE [scale-free costs])
        cap_units = float(self.replay_units @ x1) + len(self.options)
        if self.peak(x1) <= int(self._row_bounds()[1].max()):
            return x1      # already at the peak's lower bound: nothing to break
        try:
            x2 = self._solve_exact(minimise_peak=True, budget_bytes=budget_bytes, max_overhead_units=cap_units,
                                   time_limit_s=_TIE_BREAK_TIME_LIMIT_S, best_effort=True)
        except PlanError:
            return x1
        if x2 is not None and self.peak(x2) < self.peak(x1) and float(self.replay_units @ x2) <= cap_units:
            return x2
        return x1

    def lowest_peak_x(self) -> np.ndarray:
        """A valid x of least predicted peak (exact under the model)."""
        x = self._solve_exact(minimise_peak=True, budget_bytes=None)
        assert x is not None   # unconstrained: the all-KEEP choice is always valid
        return x

    def _solve_exact(self, *, minimise_peak: bool, budget_bytes: int | None, max_overhead_units: float | None = None,
                     time_limit_s: float = _SOLVER_TIME_LIMIT_S, best_effort: bool = False) -> np.ndarray | None:
        """Reduce, solve, round, re-check exactly; retighten on a tolerance overshoot (NOTE [exact integer check])."""
        rows, cols, t_lb = self._reduce(minimise_peak=minimise_peak, budget_bytes=budget_bytes)
        if budget_bytes is not None and t_lb > budget_bytes:
            return None   # some row exceeds the budget whatever is chosen
        if len(cols) == 0:
            x = np.zeros(len(self.options), dtype=np.int64)
            return x if budget_bytes is None or self.peak(x) <= budget_bytes else None
        # bytes HiGHS tells apart: tightening by less changes nothing it sees (NOTE [exact integer check])
        scale = _byte_scale(self.delta[np.ix_(rows, cols)], self.base[rows], budget_bytes)
        slack = 0
        for _ in range(_EXACT_TRIES):
            x = self._milp(rows, cols, minimise_peak=minimise_peak, budget_bytes=budget_bytes, slack=slack,
                           max_overhead_units=max_overhead_units, t_lb=t_lb, time_limit_s=time_limit_s,
                           best_effort=best_effort)
            if x is None:
                return None
            over = 0 if budget_bytes is None else self.peak(x) - budget_bytes
            if self.is_valid(x) and over <= 0:
                return x
            slack += max(over, scale)
        raise PlanError("the MILP solver's answers kept missing the exact budget check "
                        f"after {_EXACT_TRIES} tries (budget {budget_bytes} bytes)",
                        tip=f"this points at extreme byte figures in the profile; try {spell(Flag.PLANNER, 'greedy')}")

    def _reduce(self, *, minimise_peak: bool, budget_bytes: int | None) -> tuple[np.ndarray, np.ndarray, int]:
        """Rows and options the MILP needs, and a lower bound on the peak (NOTE [MILP reductions])."""
        groups = self._groups()
        if len(groups) == 0:
            return np.arange(len(self.base)), np.zeros(0, dtype=np.int64), int(self.base.max())
        upper, lower = self._row_bounds()
        t_lb = int(lower.max())
        cut = t_lb if minimise_peak else budget_bytes
        rows = np.flatnonzero(upper > cut) if cut is not None else np.arange(len(self.base))
        if 1 < len(rows) <= _DOMINANCE_MAX_ROWS:
            rows = self._undominated(rows, groups)
        cols = np.flatnonzero((self.delta[rows] < 0).any(axis=0) | (self.replay_ms < 0))
        return rows, cols, t_lb

    def _groups(self) -> np.ndarray:
        """Index of each plannable candidate's first option (options of a candidate are contiguous)."""
        return np.array([opts[0] for opts in self.options_of if opts], dtype=np.int64)

    def _row_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(R,) upper and lower bounds of each row over all choices (bytes), per-candidate worst/best option."""
        groups = self._groups()
        if len(groups) == 0:
            return self.base.copy(), self.base.copy()
        hi = np.maximum.reduceat(self.delta, groups, axis=1)                # (R, C) worst option per candidate
        lo = np.minimum.reduceat(self.delta, groups, axis=1)                # (R, C) best option per candidate
        return self.base + np.clip(hi, 0, None).sum(axis=1), self.base + np.clip(lo, None, 0).sum(axis=1)

    def _undominated(self, rows: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """Drop row r when some kept row s satisfies row_r(x) <= row_s(x) for every x."""
        d, b = self.delta[rows], self.base[rows]
        alive = np.ones(len(rows), dtype=bool)
        for i in range(len(rows)):
            # max over x of row_i(x) - row_s(x), for every s at once: (R,)
            gap = b[i] - b + np.clip(np.maximum.reduceat(d[i] - d, groups, axis=1), 0, None).sum(axis=1)
            gap[i] = 1
            if (alive & (gap <= 0)).any():
                alive[i] = False
        return rows[alive]

    def _milp(self, rows: np.ndarray, cols: np.ndarray, *, minimise_peak: bool, budget_bytes: int | None,
              slack: int, max_overhead_units: float | None, t_lb: int, time_limit_s: float,
              best_effort: bool) -> np.ndarray | None:
        """One HiGHS MILP over options ``cols`` and rows ``rows``: least overhead under the budget, or
        (``minimise_peak``) least peak; returns the full 0/1 option vector, None when infeasible."""
        from scipy.optimize import Bounds, milp

        n_x = len(cols)
        n_var = n_x + (1 if minimise_peak else 0)           # [x (binary) ..., t (peak, scaled bytes)]
        delta = self.delta[np.ix_(rows, cols)]
        base = self.base[rows]
        scale = _byte_scale(delta, base, budget_bytes)
        constraints = [*_row_constraints(delta, base, scale, minimise_peak=minimise_peak, budget_bytes=budget_bytes,
                                         slack=slack),
                       *self._clique_constraints(cols, n_var)]
        ms = self.replay_units[cols]
        if max_overhead_units is not None:
            constraints.append(_overhead_constraint(ms, n_var, max_overhead_units))
        if self.host_budget_bytes is not None and self.host[cols].any():
            constraints.append(_host_constraint(self.host[cols], n_var, self.host_budget_bytes))
        lb, ub, c = np.zeros(n_var), np.ones(n_var), ms.astype(np.float64)
        if minimise_peak:
            # t: an integer count of ``scale`` bytes (NOTE [MILP reductions]); t >= ceil(peak / scale).
            lb[-1] = -((-t_lb) // scale)
            ub[-1] = np.inf if budget_bytes is None else -((slack - budget_bytes) // scale)
            c = np.zeros(n_var)
            c[-1] = 1.0

        def solve(gap: float, limit_s: float):   # noqa: ANN202 - scipy's OptimizeResult
            with native_output_filtered():   # NOTE [native solver output]: HiGHS printf's past its options
                return milp(c, integrality=np.ones(n_var), bounds=Bounds(lb, ub), constraints=constraints,
                            options={"mip_rel_gap": gap, "time_limit": limit_s, "presolve": True})

        if minimise_peak or best_effort:   # floors stay exact; the tie-break is best effort already
            return self._read_solution(solve(0.0, time_limit_s), cols, best_effort=best_effort)
        res = solve(0.0, min(_EXACT_TIME_LIMIT_S, time_limit_s))   # NOTE [overhead gap]
        if res.status == 1 and not _within_gap(res):
            res = solve(_OVERHEAD_REL_GAP, time_limit_s)
        return self._read_solution(res, cols, best_effort=False, accept_gap=True)

    def _clique_constraints(self, cols: np.ndarray, n_var: int) -> list:
        """At most one option per clique (NOTE [valid choice]), over the MILP's columns ``cols``."""
        from scipy.optimize import LinearConstraint
        from scipy.sparse import csr_array

        pos = {int(o): i for i, o in enumerate(cols)}
        cliques = [[pos[o] for o in c if o in pos] for c in self.cliques]
        cliques = [c for c in cliques if len(c) >= 2]
        if not cliques:
            return []
        ri = [r for r, c in enumerate(cliques) for _ in c]
        ci = [i for c in cliques for i in c]
        return [LinearConstraint(csr_array((np.ones(len(ci)), (ri, ci)), shape=(len(cliques), n_var)), -np.inf, 1.0)]

    def _read_solution(self, res, cols: np.ndarray, *, best_effort: bool,
                       accept_gap: bool = False) -> np.ndarray | None:
        """The option vector of a HiGHS result; None when infeasible (or, ``best_effort``, no incumbent in time).
        ``accept_gap``: an incumbent proven within ``_OVERHEAD_REL_GAP`` at the time limit is a solution."""
        if res.status == 2 or (best_effort and res.x is None):   # infeasible, or no incumbent in time
            return None
        in_gap = accept_gap and res.status == 1 and _within_gap(res)
        if (res.status != 0 and not best_effort and not in_gap) or res.x is None:
            raise PlanError(f"the MILP solver did not finish: {res.message}",
                            tip=f"try {spell(Flag.PLANNER, 'greedy')}, or fewer candidates")
        x = np.zeros(len(self.options), dtype=np.int64)
        x[cols] = np.rint(res.x[:len(cols)]).astype(np.int64)
        return x


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
    return model.peak(model.lowest_peak_x())
