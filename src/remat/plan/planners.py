"""Planners: from a ProfileReport (and a budget) to a ``Plan``. Pure: no torch ops.

Every planner is a small class with one override point, ``choose(ctx) -> {name: mode}``;
``make_plan`` does everything around it (hazard policy, budget arithmetic, the Plan's
figures), so the planners differ only in which candidates they pick.

Specs: ``none``, ``all``, ``uniform:K``, ``sqrt``, ``selective`` (baselines: no budget
needed, they never fail on one, they report their predicted peak), ``floor`` (the cheapest
plan of least predicted peak), ``greedy`` and
``optimal`` (need a budget; BudgetError when no plan reaches it). The grammar, with the
frontier's ``planner@X`` and the closed loop's ``origin->own``, is NOTE [planner specs] in spec.py.

NOTE [hazard policy]
Per candidate, from its own hazards and those of every candidate nested in it (a
checkpointed parent replays its children too), except a nested candidate's in-place write
into its own input (an intermediate of the parent, recreated by the parent's replay; the
parent's own inputs are checked in the parent's window). Python attributes (tensor-valued
ones included), buffers, in-place input writes and module globals / closure cells reach the
planner only when a replay confirmed them (NOTE [confirmed hazards] in profile/confirm.py):
a suspicion that a replay did not reproduce is dropped. Device moves and the user's hooks
inside a region (NOTE [replayed hooks] in profile/hazards.py) are kept as found.
- in ``report.excluded``: always excluded, with the profiler's reason;
- RNG (torch's, Python's ``random``, numpy's: NOTE [host RNG]): not a hazard while RNG
  state is preserved (the replay draws the same numbers); with ``preserve_rng_state=False``
  it is a blocking hazard;
- BUFFER_MUTATION with ``guardable=True``: planned normally, ``Boundary.guarded=True``
  (remat.apply restores the buffers around the replay; verify proves they match);
- any other hazard, or a non-guardable buffer mutation: excluded with the reason, unless
  ``allow_hazards=True``, which plans every hazardous candidate *unguarded*
  (``guarded=False``, guardable BatchNorm included) so that verification can be shown
  catching it;
- no measured checkpoint mode: excluded (nothing to plan).
- OFFLOAD (NOTE [activation offload] in remat/wrap/offload.py) replays nothing, so no replay
  hazard applies to it: a candidate excluded for its hazards keeps OFFLOAD as its one mode
  when the plan prices offload, and its exclusion says so. FULL_HOST_INPUT (a segment's input on
  the host, NOTE [segment input on the host] in remat/wrap/offload.py) replays the segment as FULL
  does, so every hazard that blocks FULL blocks it.
Baseline planners obey the same exclusions.

NOTE [top-level blocks]
The baselines pick among *top-level* candidates: those without an enclosing candidate
(``parent is None``, or a parent that is not itself a candidate), in forward order. The
schedule of ``uniform:K`` and ``sqrt`` is laid over *all* top-level blocks, excluded ones
included, and excluded blocks are then dropped: an exclusion never shifts which other
blocks a baseline picks.

NOTE [sqrt for per-module wrappers]
Chen et al. (2016) cut a chain of n layers into sqrt(n) segments and keep only the
segment boundaries, recomputing each segment as one unit: O(sqrt(n)) memory for one
extra forward. That segment form needs the blocks to pass one tensor along; where the
profile shows they do, it is ``checkpoint_sequential:K`` (NOTE [baseline families]).
``sqrt`` is the per-module form, which works on any model: a checkpointed module keeps its
own input, so checkpointing every block already keeps one boundary per block, as Chen does
with segments of length 1 (``all``). The sqrt(n) idea that survives per-module wrapping
is the trade between the two ends: leave k = round(sqrt(n)) blocks un-checkpointed,
evenly spaced, and checkpoint the other n - k. The kept blocks close each of k equal
segments: block ceil((i + 1) n / k) - 1 for i = 0..k-1, so the *last* block is always
kept. That choice is deliberate: the last block's backward runs first, right at the
usual peak (end of forward), so checkpointing it frees nothing there and only re-adds
its replay. n = 9 keeps blocks 2, 5, 8 and checkpoints 0, 1, 3, 4, 6, 7. n = 1 keeps
its one block (no checkpoint).

NOTE [uniform:K]
``uniform:K`` checkpoints top-level blocks 0, K, 2K, ... in forward order (the first
block and every K-th after it). ``uniform:1`` is ``all``.

NOTE [greedy]
Options (candidate, mode) are ranked by saved bytes per replay ms (free replays first,
options that save nothing dropped). Passes run over that ranking, taking an option when
it is valid (no nested candidate already taken; a candidate may be upgraded to a mode
that saves more) and it lowers the total excess of the rows over the budget (the sum of
max(0, row - budget): unlike "lowers the peak", this makes progress when several rows
tie at the peak); passes repeat until the peak fits or a pass takes nothing. A final
pass drops taken options, most expensive first, that are not needed to fit. Greedy can
miss a plan that exists: it then raises BudgetError pointing at ``optimal``.

NOTE [baseline families]
The strong baselines are planners too, so a frontier that measures them ships the best of
them when remat's own plan is not better, and says which family won:
- ``checkpoint_sequential:K``: torch's ``checkpoint_sequential`` over the main chain (the
  top-level candidates that are children of the container holding the most of them, in
  forward order, n blocks): segments of n // K blocks, all but the last checkpointed, each a
  segment candidate (NOTE [segments] in profile/segments.py), or a block when n // K = 1. A
  segment the profile does not offer (no chain shown) is a PlanError naming it.
- ``first-k:K``: the first K top-level blocks, each checkpointed alone.
- ``checkpoint_sequential`` and ``first-k`` without K take a budget: the K of least predicted
  overhead whose predicted peak fits (ties: fewer boundaries).
Each of these plans lies in the search space of ``optimal`` (segments and blocks are its
candidates too), so ``optimal``'s predicted overhead is never above theirs at a budget, unless
theirs holds a candidate ``optimal`` left out as small (NOTE [small boundaries]).

NOTE [small boundaries]
A boundary that saves little (a single RMSNorm, a bare Dropout or DropPath, one ``Linear`` of an
MLP) is cheap to replay, so a least-overhead search happily takes it, often with its siblings (11
of Gemma2's 14 boundaries were RMSNorms saving 0.5 MiB each; Qwen2-MoE at 50% shipped a
``post_attention_layernorm``). Each is a replay to launch, a wrapper in the step and a place to go
wrong, and what it buys is a prediction finer than the model's own error. Two rules, both only for
the searching planners (``optimal``, ``greedy``; the baselines pick blocks by position, ``floor``
is the floor's witness and searches everything):
1. Admission. A candidate is *small* when what it frees in its best plannable mode is under
   ``SMALL_BOUNDARY_PEAK_SHARE`` (1%) of the unplanned step's peak: under the closed loop's own
   error between predicted and measured peaks (a few percent, NOTE [closed loop] in
   remat/closed_loop.py), so a prediction that it is what makes a plan fit is no evidence that
   it does (on tests/test_small_boundaries.py's model each small boundary a corrected plan added was
   predicted 32 KiB lower and measured 5,056 bytes higher). The search runs without the small
   candidates. Only when no plan without them reaches the target does it run again over every
   candidate, and the plan says so
   (``Plan.small_boundaries``: the threshold, the candidates left out, ``admitted``). The closed
   loop gets there in two ways: the model says from the start that nothing without them fits, or a
   plan without them *measured* over the budget and the corrected target (NOTE [closed-loop
   margin]) leaves none; either way the plan holding them ships only measured to fit, like every
   plan. Let back in, they are priced like any candidate: the rule decides whether small
   boundaries may be planned at all, not how few.
   Leaving them out can raise the *predicted* overhead (larger candidates cover what they
   covered); the rule accepts that, because a small region's replay price is the profile's least
   reliable figure (too short to time alone: NOTE [sane replay prices] in profile/prices.py), the
   launches and wrappers it adds are priced nowhere, and the time race then measures the plan
   against the simple plans (NOTE [time race] in remat/closed_loop.py).
2. Blocks over small boundaries. After the search, every chosen boundary that saves less than
   ``SMALL_BOUNDARY_SHARE`` (10%) of what an enclosing candidate saves in FULL mode is tried
   against that candidate, innermost first: the block replaces it and every other chosen boundary
   inside the block, and is kept when the plan still fits the effective budget at no more
   predicted overhead (ms). This one never trades time or the budget for fewer boundaries: under
   the MILP it only breaks ties towards whole blocks; under greedy it can also save time.

NOTE [closed-loop margin]
The closed loop (apply, measure, re-plan) corrects the model with one knob,
``margin_bytes``: the internal target becomes ``int(budget * (1 - reserve)) - margin``.
``replan_with_correction`` sets margin = max(previous margin, measured - predicted) of the
plan that missed and plans again. If that plan was made with margin m and missed the
effective budget E, then measured > E >= predicted + m, so the new margin is strictly
larger than m: the target only tightens, and the loop the caller bounds cannot cycle.
The Plan records ``budget_bytes`` and ``reserve`` as asked; the margin is the caller's to
report (it is not a Plan field).
"""

from __future__ import annotations

import dataclasses
import math

from .._lazy import LazyModule
from ..errors import BudgetError, Option, PlanError, spell
from ..profile.model import CandidateCost, HazardRecord, ProfileReport
from ..types import CheckpointMode, HazardKind
from .budget import InfeasibleBudget, effective_budget, format_bytes
from .cost import CostModel, ancestor_chains, checkpoint_modes
from .model import Boundary, Exclusion, Plan, SmallBoundaries, SmallCandidate
from .offload import OffloadPricing, with_offload
from .spec import PLANNER_SPECS, PlannerKind, PlannerSpec

SMALL_BOUNDARY_SHARE = 0.10        # NOTE [small boundaries]: a boundary saving under 10% of its block's bytes
SMALL_BOUNDARY_PEAK_SHARE = 0.01   # NOTE [small boundaries]: a candidate freeing under 1% of the unplanned peak

np = LazyModule("numpy")   # imported at first use: remat.plan imports without numpy (NOTE [import cost] in remat._lazy)


# -- eligibility (NOTE [hazard policy]) --------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Eligibility:
    """Which candidates a planner may checkpoint, which of them are guarded, and why others are not."""

    allowed: dict[str, list[CheckpointMode]]   # name -> plannable modes (non-KEEP)
    guarded: frozenset[str]                     # planned with buffers restored around the replay
    excluded: list[Exclusion]                   # forward order, then report.excluded names that are no candidate


def _hazard_text(h: HazardRecord, where: str | None) -> str:
    return f"{h.kind.value}: {h.detail}" + ("" if where is None else f" (in nested candidate {where})")


_Found = tuple[HazardRecord, str | None]   # a hazard and the nested candidate it is in (None: the region's own)


def _nested_candidates(cands: list[CandidateCost]) -> dict[str, list[CandidateCost]]:
    """Candidate name -> the candidates nested in it, in ``cands``' order."""
    chains = ancestor_chains(cands)
    nested: dict[str, list[CandidateCost]] = {c.name: [] for c in cands}
    for c in cands:
        for a in chains[c.name]:
            nested[a].append(c)
    return nested


def _region_hazards(c: CandidateCost, nested: list[CandidateCost]) -> list[_Found]:
    """``c``'s own hazards and those of the candidates nested in it.

    A nested candidate's in-place write into *its* input is a write into an intermediate
    of this region, which its replay recreates: only this region's own inputs matter here,
    and the profiler checks those in this region's window (writes by nested code included)."""
    return [(h, None) for h in c.hazards] + [(h, d.name) for d in nested for h in d.hazards
                                             if h.kind is not HazardKind.INPLACE_INPUT]


def _sort_hazards(hazards: list[_Found], *, preserve_rng_state: bool) -> tuple[list[_Found], list[_Found]]:
    """(blocking, guardable) hazards under NOTE [hazard policy]; RNG while preserved is neither."""
    blocking: list[_Found] = []
    guardable: list[_Found] = []
    for h, where in hazards:
        if h.kind is HazardKind.RNG and preserve_rng_state:
            continue   # same random numbers on replay
        if h.kind is HazardKind.BUFFER_MUTATION and h.guardable:
            guardable.append((h, where))
        elif h.kind is HazardKind.RNG:
            blocking.append((HazardRecord(kind=h.kind, detail=f"{h.detail}; RNG state is not preserved"), where))
        else:
            blocking.append((h, where))
    return blocking, guardable


def _unplannable(c: CandidateCost, report: ProfileReport) -> Exclusion | None:
    """Why ``c`` cannot be planned before its hazards are looked at (profiler exclusion, no mode), or None."""
    if c.name in report.excluded:
        return Exclusion(module=c.name, reason=report.excluded[c.name])
    if not checkpoint_modes(c):
        return Exclusion(module=c.name, reason="no checkpoint mode was measured for it")
    return None


def _hazard_exclusion(name: str, blocking: list[_Found], *, offloadable: bool = False) -> Exclusion:
    reasons = "; ".join(_hazard_text(h, w) for h, w in blocking)
    then = ("; recompute modes excluded, offload still planned (nothing replays)" if offloadable else
            f" (to plan it anyway: {spell(Option.ALLOW_HAZARDS)})")
    return Exclusion(module=name, reason=f"replay hazard: {reasons}{then}")


def classify_candidates(report: ProfileReport, *, allow_hazards: bool = False,
                        preserve_rng_state: bool = True) -> Eligibility:
    """Apply NOTE [hazard policy] to every candidate of ``report``."""
    cands = sorted(report.candidates, key=lambda c: (c.order, c.name))
    nested = _nested_candidates(cands)
    allowed: dict[str, list[CheckpointMode]] = {}
    guarded: set[str] = set()
    excluded: list[Exclusion] = []
    for c in cands:
        unplannable = _unplannable(c, report)
        if unplannable is not None:
            excluded.append(unplannable)
            continue
        blocking, guardable = _sort_hazards(_region_hazards(c, nested[c.name]), preserve_rng_state=preserve_rng_state)
        if blocking and not allow_hazards:
            offloadable = CheckpointMode.OFFLOAD in checkpoint_modes(c)
            excluded.append(_hazard_exclusion(c.name, blocking, offloadable=offloadable))
            if offloadable:
                allowed[c.name] = [CheckpointMode.OFFLOAD]   # nothing replays: NOTE [hazard policy]
            continue
        allowed[c.name] = checkpoint_modes(c)
        excluded += [Exclusion(module=c.name, reason=r) for r in report.mode_excluded.get(c.name, {}).values()]
        # --allow-hazards plans *everything* unguarded, BatchNorm included, so that
        # verification can be shown catching the double update the guard prevents
        if guardable and not blocking and not allow_hazards:
            guarded.add(c.name)
    known = {c.name for c in cands}
    excluded += [Exclusion(module=n, reason=r) for n, r in sorted(report.excluded.items()) if n not in known]
    return Eligibility(allowed=allowed, guarded=frozenset(guarded), excluded=excluded)


# -- planners ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanningContext:
    report: ProfileReport
    model: CostModel                  # compiled over the eligible candidates only
    eligibility: Eligibility
    budget_bytes: int | None          # effective target for the predicted peak (bytes), or None
    top_level: list[CandidateCost]    # NOTE [top-level blocks], forward order, excluded ones included
    requested_budget_bytes: int | None = None   # as asked, before reserve and margin (bytes)
    reserve: float = 0.0
    margin_bytes: int = 0

    def eligible(self, name: str, mode: CheckpointMode) -> bool:
        return mode in self.eligibility.allowed.get(name, ())


class Planner:
    """One override point: ``choose``. ``spec`` is what the Plan records."""

    spec: str = ""
    needs_budget: bool = False

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        raise NotImplementedError


class NonePlanner(Planner):
    spec = "none"

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        return {}


class _TopLevelPlanner(Planner):
    """Baselines: a mode for some top-level blocks, chosen by position."""

    mode = CheckpointMode.FULL

    def positions(self, n: int) -> list[int]:
        return list(range(n))

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        blocks = [ctx.top_level[i] for i in self.positions(len(ctx.top_level))]
        return {b.name: self.mode for b in blocks if ctx.eligible(b.name, self.mode)}


class AllPlanner(_TopLevelPlanner):
    spec = "all"


class SelectivePlanner(_TopLevelPlanner):
    spec = "selective"
    mode = CheckpointMode.SELECTIVE


class UniformPlanner(_TopLevelPlanner):
    """NOTE [uniform:K]."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise PlanError(f"uniform:K needs K >= 1, got {k}")
        self.k = k
        self.spec = f"uniform:{k}"

    def positions(self, n: int) -> list[int]:
        return list(range(0, n, self.k))


class SqrtPlanner(_TopLevelPlanner):
    """NOTE [sqrt for per-module wrappers]."""

    spec = "sqrt"

    def positions(self, n: int) -> list[int]:
        if n == 0:
            return []
        k = max(1, math.floor(math.sqrt(n) + 0.5))
        kept = {-(-(i + 1) * n // k) - 1 for i in range(k)}
        return [i for i in range(n) if i not in kept]


class GreedyPlanner(Planner):
    """NOTE [greedy]."""

    spec = "greedy"
    needs_budget = True

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        model, budget = ctx.model, ctx.budget_bytes
        assert budget is not None
        x = self.search(model, budget)
        if x is None and any(c.members for c in model.candidates):
            # a greedy pick of a long segment can block every finer plan: retry on modules alone
            model = CostModel(ctx.report, {n: m for n, m in ctx.eligibility.allowed.items()
                                           if n not in {c.name for c in model.candidates if c.members}},
                              host_budget_bytes=model.host_budget_bytes)
            x = self.search(model, budget)
            if x is None:
                model = ctx.model
        if x is None:
            floor = model.peak(model.lowest_peak_x())
            if floor > budget:
                raise _infeasible(ctx, floor)
            raise BudgetError(f"greedy found no plan under the effective budget of {format_bytes(budget)}, "
                              f"though one exists (the floor is {format_bytes(floor)})",
                              tip=f"use {spell(Option.PLANNER, 'optimal')}, which is exact")
        return model.choice(x)

    @staticmethod
    def search(model: CostModel, budget: int) -> np.ndarray | None:
        opts = model.options
        x = np.zeros(len(opts), dtype=np.int64)
        rows = model.base.copy()                      # (R,) bytes under the current x
        taken: dict[int, int] = {}                    # candidate index -> option index

        def excess(v: np.ndarray) -> int:
            return int(np.clip(v - budget, 0, None).sum())

        def ratio(k: int) -> float:
            o = opts[k]
            return math.inf if o.replay_ms <= 0 else o.saved_bytes / o.replay_ms

        ranking = sorted((k for k, o in enumerate(opts) if o.saved_bytes > 0),
                         key=lambda k: (-ratio(k), opts[k].index, k))
        progressed = True
        while progressed and excess(rows) > 0:
            progressed = False
            for k in ranking:
                if excess(rows) == 0:
                    break
                j = opts[k].index
                prev = taken.get(j)
                if prev == k or any(i in taken for i in model.related[j]):
                    continue
                if prev is not None and opts[k].saved_bytes <= opts[prev].saved_bytes:
                    continue
                trial = rows + model.delta[:, k] - (model.delta[:, prev] if prev is not None else 0)
                if excess(trial) < excess(rows) and _host_fits_with(model, x, k, prev):
                    rows, taken[j] = trial, k
                    x[k] = 1
                    if prev is not None:
                        x[prev] = 0
                    progressed = True
        if excess(rows) > 0:
            return None
        for k in sorted(taken.values(), key=lambda k: (-opts[k].replay_ms, k)):   # drop what is not needed
            trial = rows - model.delta[:, k]
            if int(trial.max()) <= budget:
                rows, x[k] = trial, 0
        return x


def _host_fits_with(model: CostModel, x: np.ndarray, k: int, prev: int | None) -> bool:
    """``x`` with option ``k`` taken (and ``prev`` dropped) stays within the host budget."""
    if model.host_budget_bytes is None:
        return True
    trial = x.copy()
    trial[k] = 1
    if prev is not None:
        trial[prev] = 0
    return model.host_fits(trial)


class OptimalPlanner(Planner):
    """Least predicted overhead with predicted peak <= effective budget, exact (HiGHS MILP, cost.py)."""

    spec = "optimal"
    needs_budget = True

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        assert ctx.budget_bytes is not None
        x = ctx.model.cheapest_within(ctx.budget_bytes)
        if x is None:
            raise _infeasible(ctx, ctx.model.peak(ctx.model.lowest_peak_x()))
        return ctx.model.choice(x)


class FloorPlanner(Planner):
    """The cheapest plan among those of least predicted peak (exact): the floor's witness.

    No budget needed; the closed loop measures it last when cheaper plans measured over the
    budget (NOTE [closed loop] in remat.closed_loop).
    """

    spec = "floor"

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        floor = ctx.model.peak(ctx.model.lowest_peak_x())
        x = ctx.model.cheapest_within(floor)
        return ctx.model.choice(x if x is not None else ctx.model.lowest_peak_x())


def _swap_for_block(ctx: PlanningContext, choice: dict[str, CheckpointMode], block: str,
                    chains: dict[str, tuple[str, ...]]) -> dict[str, CheckpointMode] | None:
    """``choice`` with ``block`` (FULL) instead of the chosen boundaries inside it, when that fits the
    budget at no more predicted overhead (NOTE [small boundaries]); None otherwise."""
    trial = {n: m for n, m in choice.items() if n != block and block not in chains.get(n, ())}
    trial[block] = CheckpointMode.FULL
    model = ctx.model
    try:
        x, xt = model.vector(choice), model.vector(trial)
    except PlanError:          # the block overlaps a chosen segment
        return None
    assert ctx.budget_bytes is not None
    if model.peak(xt) <= ctx.budget_bytes and model.overhead_ms(xt) <= model.overhead_ms(x):
        return trial
    return None


def prefer_blocks(ctx: PlanningContext, choice: dict[str, CheckpointMode]) -> dict[str, CheckpointMode]:
    """NOTE [small boundaries]: swap small chosen boundaries for their enclosing block where that costs nothing."""
    by_name = {c.name: c for c in ctx.model.candidates}
    chains = ancestor_chains(ctx.model.candidates)
    for name in sorted(choice, key=lambda n: (by_name[n].order, n)):
        if name not in choice:
            continue               # replaced by a block already
        saved = by_name[name].saved_bytes[choice[name]]
        for block in chains.get(name, ()):
            if not ctx.eligible(block, CheckpointMode.FULL) or \
                    saved >= SMALL_BOUNDARY_SHARE * by_name[block].saved_bytes[CheckpointMode.FULL]:
                continue
            swapped = _swap_for_block(ctx, choice, block, chains)
            if swapped is not None:
                choice = swapped
                break
    return choice


def small_candidates(report: ProfileReport, eligibility: Eligibility) -> SmallBoundaries:
    """NOTE [small boundaries], rule 1: the plannable candidates freeing under ``SMALL_BOUNDARY_PEAK_SHARE``
    of the unplanned step's peak in every plannable mode, in forward order."""
    threshold = int(SMALL_BOUNDARY_PEAK_SHARE * report.baseline_peak_bytes)   # bytes
    dropped = []
    for c in sorted(report.candidates, key=lambda c: (c.order, c.name)):
        modes = eligibility.allowed.get(c.name)
        if not modes:
            continue
        best = max(c.saved_bytes.get(m, 0) for m in modes)   # bytes, in its best mode
        if best < threshold:
            dropped.append(SmallCandidate(module=c.name, saved_bytes=best))
    return SmallBoundaries(threshold_bytes=threshold, dropped=dropped)


def _without(eligibility: Eligibility, small: SmallBoundaries) -> Eligibility:
    """``eligibility`` with the small candidates no longer plannable (not exclusions: nothing is wrong with
    them, and ``Plan.small_boundaries`` lists them)."""
    names = {c.module for c in small.dropped}
    return dataclasses.replace(eligibility, allowed={n: m for n, m in eligibility.allowed.items() if n not in names})


def _with_eligible(base: PlanningContext, eligibility: Eligibility, host_budget_bytes: int | None) -> PlanningContext:
    """``base`` planning over ``eligibility``, its cost model compiled over those candidates only."""
    model = CostModel(base.report, eligibility.allowed, host_budget_bytes=host_budget_bytes)
    return dataclasses.replace(base, model=model, eligibility=eligibility)


def _choose(p: Planner, base: PlanningContext, host_budget_bytes: int | None
            ) -> tuple[PlanningContext, dict[str, CheckpointMode], SmallBoundaries | None]:
    """``p``'s choice and the context it was made in. A searching planner searches without the small
    candidates unless nothing fits without them, and its small boundaries give way to blocks (NOTE [small
    boundaries]); the third item says what was left out (None: nothing was)."""
    searching = isinstance(p, (OptimalPlanner, GreedyPlanner))
    small = small_candidates(base.report, base.eligibility) if searching else None
    if small is not None and not small.dropped:
        small = None
    ctx = _with_eligible(base, base.eligibility if small is None else _without(base.eligibility, small),
                         host_budget_bytes)
    try:
        choice = p.choose(ctx)
    except BudgetError:
        if small is None:
            raise
        small = dataclasses.replace(small, admitted=True)   # nothing fits without them: let them back in
        ctx = _with_eligible(base, base.eligibility, host_budget_bytes)
        choice = p.choose(ctx)
    return ctx, prefer_blocks(ctx, choice) if searching else choice, small


def _chain(ctx: PlanningContext) -> list[CandidateCost]:
    """The main chain of blocks (NOTE [baseline families]): the top-level candidates that are children
    of the container holding the most of them, in forward order."""
    groups: dict[str, list[CandidateCost]] = {}
    for c in ctx.top_level:
        groups.setdefault(c.name.rpartition(".")[0], []).append(c)
    if not groups:
        return []
    return max(groups.values(), key=len)


class CheckpointSequentialPlanner(Planner):
    """torch's ``checkpoint_sequential(blocks, K, x)`` as a plan (NOTE [baseline families]).

    ``k=None``: the family at a budget, the K of least predicted overhead whose peak fits.
    """

    def __init__(self, k: int | None = None) -> None:
        if k is not None and k < 2:
            raise PlanError(f"checkpoint_sequential:K needs K >= 2 (K = 1 checkpoints nothing), got {k}")
        self.k = k
        self.spec = "checkpoint_sequential" if k is None else f"checkpoint_sequential:{k}"
        self.needs_budget = k is None

    @staticmethod
    def segments_for(ctx: PlanningContext, k: int) -> dict[str, CheckpointMode]:
        """The choice of ``checkpoint_sequential(chain, k)``; PlanError when a segment is not plannable."""
        chain = _chain(ctx)
        n = len(chain)
        if not 2 <= k <= n:
            raise PlanError(f"checkpoint_sequential:{k} needs 2 <= K <= {n} (the chain has {n} blocks)")
        length = n // k
        by_members = {c.members: c.name for c in ctx.report.candidates if c.members}
        choice: dict[str, CheckpointMode] = {}
        for i in range(k - 1):      # torch never checkpoints the last segment
            run = chain[i * length:(i + 1) * length]
            if length == 1:
                if ctx.eligible(run[0].name, CheckpointMode.FULL):   # an excluded block stays out, as for `all`
                    choice[run[0].name] = CheckpointMode.FULL
                continue
            name = by_members.get(tuple(c.name for c in run))
            if name is None or not ctx.eligible(name, CheckpointMode.FULL):
                what = f"{run[0].name} .. {run[-1].name}"
                why = ctx.report.excluded.get(name, "excluded from planning") if name else \
                    "not offered: the profiled step does not show these blocks passing one tensor along"
                raise PlanError(f"checkpoint_sequential:{k} needs one checkpoint around {what}: {why}")
            choice[name] = CheckpointMode.FULL
        return choice

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        if self.k is not None:
            return self.segments_for(ctx, self.k)
        options = []
        for k in range(2, len(_chain(ctx)) + 1):
            try:
                options.append(self.segments_for(ctx, k))
            except PlanError:
                continue
        return _cheapest_fitting(ctx, options, self.spec)


class FirstKPlanner(Planner):
    """Checkpoint the first k top-level blocks, each on its own (NOTE [baseline families]).

    ``k=None``: the k of least predicted overhead whose peak fits the budget.
    """

    def __init__(self, k: int | None = None) -> None:
        if k is not None and k < 1:
            raise PlanError(f"first-k:K needs K >= 1, got {k}")
        self.k = k
        self.spec = "first-k" if k is None else f"first-k:{k}"
        self.needs_budget = k is None

    @staticmethod
    def first(ctx: PlanningContext, k: int) -> dict[str, CheckpointMode]:
        return {b.name: CheckpointMode.FULL for b in ctx.top_level[:k] if ctx.eligible(b.name, CheckpointMode.FULL)}

    def choose(self, ctx: PlanningContext) -> dict[str, CheckpointMode]:
        if self.k is not None:
            return self.first(ctx, self.k)
        return _cheapest_fitting(ctx, [self.first(ctx, k) for k in range(1, len(ctx.top_level) + 1)], self.spec)


def _cheapest_fitting(ctx: PlanningContext, options: list[dict[str, CheckpointMode]], spec: str) -> dict[str, CheckpointMode]:
    """Among a family's plans, the least predicted overhead whose predicted peak fits (ties: fewer boundaries)."""
    assert ctx.budget_bytes is not None
    scored = []
    for choice in options:
        x = ctx.model.vector(choice)
        scored.append((ctx.model.peak(x), ctx.model.overhead_ms(x), len(choice), choice))
    fitting = [t for t in scored if t[0] <= ctx.budget_bytes]
    if fitting:
        return min(fitting, key=lambda t: (t[1], t[2]))[3]
    if not scored:
        raise PlanError(f"planner {spec!r} has no plan to offer on this model (no chain of blocks it can checkpoint)")
    raise _infeasible(ctx, min(t[0] for t in scored))


def _infeasible(ctx: PlanningContext, floor: int) -> InfeasibleBudget:
    assert ctx.requested_budget_bytes is not None
    return InfeasibleBudget(floor_bytes=floor, budget_bytes=ctx.requested_budget_bytes, reserve=ctx.reserve,
                            margin_bytes=ctx.margin_bytes, explanation=explain_floor(ctx.report, floor,
                                                                                     ctx.eligibility),
                            control_peak_bytes=ctx.report.baseline_peak_bytes or None)


def explain_floor(report: ProfileReport, floor: int, eligibility: Eligibility) -> str:
    """Why the floor is where it is (NOTE [nothing fits]): the phase that sets it, what would help, exclusions.

    NOTE [nothing fits]
    Checkpointing lowers only what forward keeps for backward. The live bytes of the batch
    and optimizer phases (parameters, gradients, optimizer state, the batch) are out of its
    reach: when the floor is within 2% of the larger of those phase peaks, the floor is set
    there, and the message says what would lower it instead. Otherwise the floor is set by
    activations that no plannable candidate covers, and the excluded candidates are listed
    with their reasons (the first few; ``plan.json`` has all).
    """
    phases = {k: v for k, v in report.phase_peak_bytes.items() if k in ("optimizer", "batch")}
    parts: list[str] = []
    if phases:
        phase, fixed = max(phases.items(), key=lambda kv: kv[1])
        if fixed >= floor * 0.98:
            parts.append(f"the floor is set by the {phase} phase ({format_bytes(fixed)}: parameters, gradients, "
                         "optimizer state and the batch), which checkpointing cannot lower; a smaller optimizer "
                         "state (SGD, a factored or 8-bit optimizer), lower-precision parameters, a smaller batch, "
                         f"or sharding ({spell(Option.FSDP2)}) would")
        else:
            parts.append(f"the floor is set by activations no plannable candidate covers (the optimizer and batch "
                         f"phases peak at {format_bytes(fixed)})")
    idle_names = set(report.idle)
    idle = [e for e in eligibility.excluded if e.module in idle_names]
    telling = [e for e in eligibility.excluded if e.module not in idle_names]
    # a failing mode leaves its candidate plannable in its other modes: say which is which
    whole = [e for e in telling if e.module not in eligibility.allowed]
    modes = [e for e in telling if e.module in eligibility.allowed]
    for what, group in (("candidates excluded", whole), ("modes excluded on candidates still plannable in "
                                                          "another mode", modes)):
        if group:
            shown = "; ".join(f"{e.module}: {e.reason}" for e in group[:4])
            more = f" (+{len(group) - 4} more)" if len(group) > 4 else ""
            parts.append(f"{len(group)} {what}: {shown}{more}")
    if idle:
        parts.append(f"{len(idle)} more free nothing until backward")
    return ". ".join(parts)


_SIMPLE: dict[PlannerKind, type[Planner]] = {
    PlannerKind.NONE: NonePlanner, PlannerKind.ALL: AllPlanner, PlannerKind.SQRT: SqrtPlanner,
    PlannerKind.SELECTIVE: SelectivePlanner, PlannerKind.GREEDY: GreedyPlanner, PlannerKind.OPTIMAL: OptimalPlanner,
    PlannerKind.FLOOR: FloorPlanner}
_WITH_K: dict[PlannerKind, type[Planner]] = {
    PlannerKind.UNIFORM: UniformPlanner, PlannerKind.CHECKPOINT_SEQUENTIAL: CheckpointSequentialPlanner,
    PlannerKind.FIRST_K: FirstKPlanner}


def planner_from_spec(spec: str | PlannerSpec) -> Planner:
    """A planner spec (NOTE [planner specs]) -> its Planner; PlanError for one no planner runs
    (unknown, ``planner@X``, ``origin->own``, ``torch-budget``)."""
    s = PlannerSpec.parse(spec)
    if s.budget is not None or s.fallback_of is not None or s.kind not in _SIMPLE.keys() | _WITH_K.keys():
        raise PlanError(f"unknown planner {str(spec)!r}; valid: {', '.join(PLANNER_SPECS)}")
    if s.kind in _SIMPLE:
        return _SIMPLE[s.kind]()
    return _WITH_K[s.kind](s.k)  # type: ignore[call-arg]


# -- entry points --------------------------------------------------------------------------

def _top_level(report: ProfileReport) -> list[CandidateCost]:
    names = {c.name for c in report.candidates}
    return sorted((c for c in report.candidates if (c.parent is None or c.parent not in names) and not c.members),
                  key=lambda c: (c.order, c.name))


def make_plan(report: ProfileReport, planner: str | PlannerSpec = "optimal", *, budget_bytes: int | None = None,
              reserve: float = 0.05, allow_hazards: bool = False, preserve_rng_state: bool = True,
              margin_bytes: int = 0, offload: OffloadPricing | None = None) -> Plan:
    """Plan checkpoint boundaries for ``report`` with the planner named by ``planner``.

    ``budget_bytes``: whole-step peak budget (bytes; required by optimal/greedy). The
    predicted peak must stay under ``int(budget * (1 - reserve)) - margin_bytes``
    (NOTE [closed-loop margin]). Raises PlanError (unknown planner), BudgetError (missing or
    bad budget; ``InfeasibleBudget``, naming the floor, when no plan reaches it),
    CandidateError (malformed candidates). ``offload``: also price an OFFLOAD mode per module
    candidate, and FULL_HOST_INPUT per segment whose input the profile shows freed, from these
    bandwidths (NOTE [offload cost model]), under its host budget.
    """
    p = planner_from_spec(planner)
    if isinstance(reserve, bool) or not (isinstance(reserve, (int, float)) and 0.0 <= reserve < 1.0):
        raise BudgetError(f"reserve must lie in [0, 1), got {reserve!r}")
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer))
                                     or budget_bytes <= 0):
        raise BudgetError(f"budget must be a positive whole number of bytes, got {budget_bytes!r}")
    if p.needs_budget and budget_bytes is None:
        raise BudgetError(f"planner {p.spec!r} needs a budget", tip=f"pass a budget, e.g. {spell(Option.BUDGET, '60%')} or {spell(Option.BUDGET, '1.5GiB')}")
    target = None if budget_bytes is None else effective_budget(int(budget_bytes), float(reserve), margin_bytes)

    if offload is not None:
        report = with_offload(report, offload)
    elig = classify_candidates(report, allow_hazards=allow_hazards, preserve_rng_state=preserve_rng_state)
    base = PlanningContext(report=report, model=CostModel(report, {}), eligibility=elig, budget_bytes=target,
                           top_level=_top_level(report),
                           requested_budget_bytes=None if budget_bytes is None else int(budget_bytes),
                           reserve=float(reserve), margin_bytes=int(margin_bytes))
    ctx, choice, small = _choose(p, base, None if offload is None else offload.host_budget_bytes)
    model = ctx.model
    x = model.vector(choice)

    by_name = {c.name: c for c in report.candidates}
    boundaries = []
    for k in np.flatnonzero(x):
        o = model.options[k]
        boundaries.append((by_name[o.candidate].order, Boundary(
            module=o.candidate, mode=o.mode, saved_bytes=o.saved_bytes, replay_ms=o.replay_ms,
            guarded=o.candidate in elig.guarded)))
    return Plan(
        planner=p.spec,
        budget_bytes=None if budget_bytes is None else int(budget_bytes),
        reserve=float(reserve),
        boundaries=[b for _, b in sorted(boundaries, key=lambda t: (t[0], t[1].module))],
        excluded=list(elig.excluded),
        predicted_peak_bytes=model.peak(x),
        predicted_overhead_ms=model.overhead_ms(x),
        baseline_peak_bytes=report.baseline_peak_bytes,
        baseline_step_ms=report.baseline_step_ms,
        fingerprint=report.fingerprint,
        preserve_rng_state=preserve_rng_state,
        memory_source=report.memory_source,
        simulated=report.simulated,
        device_model=report.device_model,
        offload=offload,
        small_boundaries=small,
    )


def correction_margin(plan: Plan, measured_peak_bytes: int, margin_bytes: int = 0) -> int:
    """New margin after measuring ``plan``: max(previous margin, measured - predicted), bytes."""
    return max(int(margin_bytes), int(measured_peak_bytes) - int(plan.predicted_peak_bytes))


def replan_with_correction(report: ProfileReport, previous: Plan, measured_peak_bytes: int, *,
                           margin_bytes: int = 0, allow_hazards: bool = False) -> tuple[Plan, int]:
    """Re-plan after ``previous`` was applied and measured (NOTE [closed-loop margin]).

    Same planner, budget, reserve and RNG policy as ``previous``; ``margin_bytes`` is the
    margin ``previous`` was planned with. Returns ``(new plan, new margin)``; raises
    InfeasibleBudget when the tightened target is below the floor.
    """
    if previous.budget_bytes is None:
        raise PlanError(f"plan by {previous.planner.format()!r} has no budget to correct against")
    margin = correction_margin(previous, measured_peak_bytes, margin_bytes)
    plan = make_plan(report, previous.planner, budget_bytes=previous.budget_bytes, reserve=previous.reserve,
                     allow_hazards=allow_hazards, preserve_rng_state=previous.preserve_rng_state,
                     margin_bytes=margin, offload=previous.offload)
    return plan, margin
