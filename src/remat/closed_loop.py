"""Closed loop: plan, apply to a fresh model, measure, and re-plan if the peak missed.

It sits below ``apply`` and the measurement stage (it plans, applies and measures), not in
either: wrapping modules is not re-planning, and measuring never imports ``plan``.

NOTE [closed loop]
The cost model (profile/model.py) is built from one baseline step (or a step sample, NOTE
[step sample]); real checkpointing can differ a little (the replay's early stop, allocation
order). So a budget-driven plan is applied to a fresh build of the workload and its whole-step
peak measured (at every point of the sample, the max); if the
measured peak misses the effective budget, the planner's margin grows by the observed
error (plan.replan_with_correction) and it plans again, at most ``max_tries`` times; then
it falls back to measured plans (NOTE [closed loop fallbacks]). The plan returned records
predicted *and* measured figures.

NOTE [one closed loop]
:func:`run_closed_loop` is the only loop that measures a plan and plans again; what differs
per caller is a :class:`LoopSteps` (how a plan is measured, what fitting means, how a miss is
corrected, whether a fit may be relaxed, which fallbacks exist) and its
:class:`ClosedLoopSettings`. One device (:func:`plan_closed_loop`): a ``Plan``, measured on a
fresh build, corrected by the margin rule, relaxed under ``compile``, with fallbacks. A
pipeline (NOTE [pipeline closed loop], remat/distributed/pipeline/worker.py): a ``PipelinePlan``,
measured by running the whole side on every rank, corrected per stage, with no relaxing and
no fallbacks.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

import torch

from ._codec import JsonCodec
from .wrap import PlanArm
from .memory.capacity import clear_refusal, last_refusal
from .errors import BudgetError, DeviceTooSmall, Option, PlanError, spell
from .measure import (Arm, CompileSpec, Prepared, StepMeasurement, Stream, measure_arm, measure_stream_peaks, prepare_arm,
                      release_memory, time_round_robin)
from .percentile import p50
from .plan import (InfeasibleBudget, PlannerKind, PlannerSpec, Plan, effective_budget, format_bytes, make_plan,
                   min_budget_for, replan_with_correction)
from .plan.offload import OffloadPricing
from .plan.timing import (MIN_RACE_ROUNDS, PairedRatio, RaceVerdict, TimeRace, calibrate_replay_ms, paired_ratio,
                          race_verdict, time_scales)
from .profile.model import BlockedStep, ProfileReport, SampleRecord, StepSample
from .profile.sample import sample_workloads, shape_streams
from .types import ProgressFn, no_progress
from .workload.contract import is_allocation_failure
from .workload.loader import LoadedWorkload

P = TypeVar("P")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt(JsonCodec):
    """One plan the closed loop measured: predicted and measured whole-step peak (bytes)."""

    predicted_peak_bytes: int
    measured_peak_bytes: int
    margin_bytes: int         # the planner's margin when it made this plan (NOTE [closed-loop margin])
    fits: bool                # measured peak <= effective budget


@dataclasses.dataclass(kw_only=True)
class ClosedLoopResult:
    plan: Plan
    attempts: list[Attempt]
    # how the loop planned and measured, and the plans it measured: for the time race (NOTE [time race])
    loop: "_OneDevice | None" = None
    tried: list[Plan] = dataclasses.field(default_factory=list)


# -- the loop, for any kind of plan (NOTE [one closed loop]) ----------------------------------------

@dataclasses.dataclass(kw_only=True)
class ClosedLoopSettings:
    """How many plans the loop measures before it stops correcting, and what it reports progress as."""

    max_tries: int = 3                    # plans measured by correcting (fallbacks come on top)
    what: str = "plan: apply and measure"  # the progress label

    def __post_init__(self) -> None:
        if self.max_tries < 1:
            raise PlanError(f"the closed loop needs max_tries >= 1, got {self.max_tries}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSteps(Generic[P]):
    """What the closed loop does with one caller's plans (NOTE [one closed loop])."""

    measure: Callable[[P], None]         # apply and run the plan; it (or the caller) keeps the measured peak(s)
    fits: Callable[[P], bool]            # its measured peak(s) within the target
    key: Callable[[P], Hashable]         # plans with one key are one plan: never measured twice
    cost: Callable[[P], float]           # predicted added time (ms): the cheapest plan measured to fit wins
    correct: Callable[[P], P] | None = None   # the next plan after a miss (BudgetError: none fits); None: never
    relax: Callable[[P], P | None] | None = None   # a cheaper plan after a fit, or None (NOTE [compiled closed loop])
    fallbacks: Callable[[], list[P]] | None = None  # plans to measure when correcting failed, in order
                                                    # (NOTE [closed loop fallbacks]); None: there are none


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tried(Generic[P]):
    plan: P
    fits: bool
    fallback: bool


@dataclasses.dataclass(kw_only=True)
class LoopOutcome(Generic[P]):
    plan: P | None        # the plan to ship; None: nothing measured to fit and the fallbacks missed too
    tried: list[Tried[P]]
    fallback: bool = False   # ``plan`` is a fallback: the model's own plans missed


def run_closed_loop(first: P | None, steps: LoopSteps[P], settings: ClosedLoopSettings | None = None,
                    progress: ProgressFn = no_progress) -> LoopOutcome[P]:
    """Measure ``first``, correct it until a plan measures to fit, then try the fallbacks (NOTE [one closed loop]).

    ``first`` None: the model said nothing fits, so only the fallbacks are measured.
    """
    settings = settings or ClosedLoopSettings()
    tried: list[Tried[P]] = []
    plan = _correct_until_fit(first, steps, settings, tried, progress)
    if steps.fallbacks is None or (plan is not None and steps.fits(plan)):
        return LoopOutcome(plan=plan, tried=tried)
    return _first_fallback_that_fits(steps.fallbacks(), steps, tried, progress)


def _correct_until_fit(plan: P | None, steps: LoopSteps[P], settings: ClosedLoopSettings, tried: list[Tried[P]],
                       progress: ProgressFn) -> P | None:
    """The corrected plans, measured in turn; the cheapest that fits, else the last one measured."""
    measured: dict[Hashable, P] = {}
    best_fit: P | None = None
    for i in range(settings.max_tries if plan is not None else 0):
        progress(settings.what, i, settings.max_tries)
        fits = _measure(steps, plan, tried, fallback=False)
        measured[steps.key(plan)] = plan
        best_fit = _cheaper_fit(steps, best_fit, plan) if fits else best_fit
        if i == settings.max_tries - 1 or (not fits and best_fit is not None):
            break   # out of tries, or a relaxed plan missed: the plan that fitted before it stands
        try:
            again = _next_plan(steps, plan, fits)
        except BudgetError:
            break   # the corrected target is below the floor: fall back to measuring
        if again is None:
            break
        plan = again
        if steps.key(plan) in measured:
            plan = measured[steps.key(plan)]
            break   # the re-plan is a plan already measured: nothing new to learn
    progress(settings.what, settings.max_tries, settings.max_tries)
    return best_fit if best_fit is not None else plan


def _cheaper_fit(steps: LoopSteps[P], best_fit: P | None, plan: P) -> P:
    """Of two plans measured to fit, the one of less predicted added time (the earlier on a tie)."""
    return plan if best_fit is None or steps.cost(plan) < steps.cost(best_fit) else best_fit


def _next_plan(steps: LoopSteps[P], plan: P, fits: bool) -> P | None:
    """The plan to measure next: corrected after a miss, relaxed after a fit; None: this one stands."""
    if not fits:
        return None if steps.correct is None else steps.correct(plan)
    return None if steps.relax is None else steps.relax(plan)


def _first_fallback_that_fits(fallbacks: list[P], steps: LoopSteps[P], tried: list[Tried[P]],
                              progress: ProgressFn) -> LoopOutcome[P]:
    """NOTE [closed loop fallbacks]: measure what the model ranks lower in peak, in order; the first that fits ships."""
    for fb in fallbacks:
        if any(steps.key(t.plan) == steps.key(fb) for t in tried):
            continue
        progress("plan: measure a fallback", 0, 1)
        if _measure(steps, fb, tried, fallback=True):
            return LoopOutcome(plan=fb, tried=tried, fallback=True)
    return LoopOutcome(plan=None, tried=tried)


def _measure(steps: LoopSteps[P], plan: P, tried: list[Tried[P]], *, fallback: bool) -> bool:
    steps.measure(plan)
    fits = steps.fits(plan)
    tried.append(Tried(plan=plan, fits=fits, fallback=fallback))
    return fits


# -- one device ---------------------------------------------------------------------------------------

def measure_plan(loaded: LoadedWorkload, plan: Plan | None, *, warmup: int = 1, steps: int = 3,
                 then: Sequence[Stream] = ()) -> StepMeasurement:
    """Peak and warm step times of ``plan`` applied to a fresh build of the workload (remat.measure);
    a CPU peak at the edge of the plan's effective budget confirmed by torch.profiler (NOTE [peaks at the edge]).

    One warm-up step: the optimizer state exists from the first step on, so the second is the steady
    step. ``then``: the later sampled points of the same shape, one peak step each on the same build
    afterwards (``then_peak_bytes``; NOTE [one build per shape])."""
    return measure_arm(loaded, PlanArm("plan", plan), warmup=warmup, steps=steps,
                       confirm_under=None if plan is None else plan.effective_budget_bytes, then=then)


def plan_closed_loop(loaded: LoadedWorkload, report: ProfileReport, planner: str | PlannerSpec = "optimal", *,
                     budget_bytes: int | None, reserve: float = 0.05, allow_hazards: bool = False,
                     preserve_rng_state: bool = True, max_tries: int = 3, steps: int = 1,
                     compile: CompileSpec | None = None, offload: OffloadPricing | None = None,
                     sample: StepSample | None = None, variants: list[LoadedWorkload] | None = None,
                     progress: ProgressFn = no_progress) -> ClosedLoopResult:
    """Plan, apply to a fresh build, measure; correct and fall back until a plan measures in budget.

    ``offload``: price an OFFLOAD mode beside recompute (NOTE [offload cost model]).

    ``steps``: timed steps of each plan's first-point measurement. One by default, as ``remat.auto``
    and the frontier's re-plans always took: the planned step's time is reported as one run, not
    interleaved and not an overhead (NOTE [auto overhead]); overheads are the frontier's interleaved
    measurement. (Three before: on gpt at n_layer 32, 2 of the closed loop's 11 step-equivalents.)

    NOTE [closed loop fallbacks]
    A budget-driven plan (``optimal``, ``greedy``) that measures over its effective budget is
    re-planned with a margin (NOTE [closed-loop margin]) up to ``max_tries`` times. If it
    still misses, or the corrected target falls below the predicted floor, or the model
    said from the start that nothing fits, the model is wrong somewhere, so remat trusts
    measurements instead: the plans that the model ranks lower in peak (``all``: every
    top-level block; ``floor``: the cheapest plan of least predicted peak) and the baseline
    families' fixed-K plans (``first-k:K``, ``checkpoint_sequential:K``: per family the cheapest
    predicted to fit and its neighbours in cost, ``_FAMILY_FALLBACKS``) are measured in
    order of predicted added time, and the first whose *measured* peak fits ships (it says
    so in its ``planner``). Fallbacks predicted more than ``_MODEL_ERROR`` over the target are
    not measured (no model error seen is that large). Only when none fits is it an error: the
    model's own InfeasibleBudget (naming why) when it said so from the start and nothing
    measured under the budget itself, its floor the lowest peak *measured* (the fallbacks', else
    the floor plan measured before refusing), so the budget its tip asks for is one a measured
    plan ships at, else :class:`BudgetMissed` (exit 2) with the
    measured gap, offering the cheapest plan measured under the budget itself with the reserve
    that would ship it (NOTE [the reserve] in remat/plan/budget.py).
    So ``optimal`` never ships worse than ``all`` or a baseline family's plan when that fits.

    ``compile`` (``remat plan --compile``): every plan is measured compiled (NOTE [compiled
    arms]) and carries the spec (``plan.compile``), so its measured peak is the compiled step's.

    ``sample`` (NOTE [step sample]): every plan is measured at each point of the sample (one
    peak step each after the first point's full measurement, on its build: NOTE [one build per
    shape]) and its measured peak is the max;
    ``variants`` are the builds at the boundary shapes, when the caller has them (remat.auto).

    NOTE [compiled closed loop]
    The cost model is built from the eager step, and a compiled step peaks elsewhere: inductor
    frees and fuses differently, and a checkpoint region changes how AOTAutograd partitions the
    graph. The zoo's Llama at 70%: the eager closed-loop plan measured 81.66 MiB eager and 83.54
    MiB compiled, 1.5% over; on the zoo's GPT-2 the compiled step peaks far *under* the eager
    one (unplanned: 71.08 against 108.35 MiB), so the eager plan over-checkpoints there (at 70%
    the relaxed compiled plan holds one selective MLP instead of four regions; benchmarks/RESULTS.md,
    torch.compile). So under ``compile`` the loop corrects in both directions: a plan that misses
    tightens the margin as always, and a plan that fits with its compiled peak under the
    prediction is planned again with that (negative) error as its margin, i.e. with the budget
    the compiled step leaves, which buys a cheaper plan. A relaxed plan is measured like any
    other; the cheapest plan (predicted added time) *measured* to fit is returned, so relaxing
    never returns a plan that misses. Eager keeps the one-way loop: its model error is within
    a few percent and one more measured build is not worth it there.
    """
    budget_driven = PlannerSpec.parse(planner).needs_budget
    device = _OneDevice(loaded, report, planner, compile=compile, steps=steps, sample=sample, variants=variants,
                        kw=dict(budget_bytes=budget_bytes, reserve=reserve, allow_hazards=allow_hazards,
                                preserve_rng_state=preserve_rng_state, offload=offload))
    try:
        first: Plan | None = make_plan(report, planner, **device.kw)
    except InfeasibleBudget as exc:
        if not budget_driven:
            raise
        first, infeasible = None, exc
    else:
        infeasible = None
    outcome = run_closed_loop(first, device.steps(budget_driven=budget_driven, budget_given=budget_bytes is not None,
                                                  relax=compile is not None),
                              ClosedLoopSettings(max_tries=max_tries), progress)
    attempts = device.attempts(outcome.tried)
    if outcome.plan is not None:
        fb = outcome.plan
        if outcome.fallback:
            # says what shipped and why: the model's pick missed (NOTE [planner specs])
            fb.planner = fb.planner.after_miss_of(PlannerSpec.parse(planner))
        return ClosedLoopResult(plan=fb, attempts=attempts, loop=device, tried=[t.plan for t in outcome.tried])
    in_budget = _cheapest_in_budget([t.plan for t in outcome.tried])
    if infeasible is not None and in_budget is None:
        # the model said so from the start, and no measurement disagreed: its floor, as measured
        raise _measured_refusal(infeasible, [t.plan for t in outcome.tried], loaded, report, reserve, progress)
    best = min((t.plan for t in outcome.tried), key=lambda p: p.measured_peak_bytes)
    raise BudgetMissed(best=best, tried=len(outcome.tried), in_budget=in_budget)


# How far the cost model's predicted peak has been seen from the measured one (a share of the
# target): fallbacks predicted further over the target than this are not worth measuring.
_MODEL_ERROR = 0.15


class _OneDevice:
    """NOTE [closed loop] on one device: plans from the profile, each measured on a fresh build of the workload."""

    def __init__(self, loaded: LoadedWorkload, report: ProfileReport, planner: str | PlannerSpec, *, compile: CompileSpec | None,
                 steps: int, kw: dict[str, Any], sample: StepSample | None = None,
                 variants: list[LoadedWorkload] | None = None) -> None:
        self.loaded, self.report, self.planner, self.compile, self.n_steps = loaded, report, planner, compile, steps
        self.sample = sample
        self.points = sample_workloads(loaded, sample, variants=variants) if sample is not None else [loaded]
        self.kw = kw                    # make_plan's budget, reserve, hazards and RNG policy
        self.margin = 0                 # bytes: the planner's margin for the plan being made (NOTE [closed-loop margin])
        self.margins: list[int] = []    # the margin of each plan measured, in order

    def steps(self, *, budget_driven: bool, budget_given: bool, relax: bool) -> LoopSteps[Plan]:
        """Only a budget-driven plan is corrected; under ``compile`` with a budget it is also relaxed
        (NOTE [compiled closed loop]); fallbacks are for a budget-driven plan at a budget."""
        return LoopSteps(measure=self.measure, fits=_fits, key=_key, cost=_overhead_ms,
                         correct=self.correct if budget_driven else None,
                         relax=self.relax if relax and budget_driven and budget_given else None,
                         fallbacks=self.fallbacks if budget_driven and budget_given else None)

    def measure(self, plan: Plan) -> None:
        if self.sample is None:
            _measure_into(self.points[0], plan, self.n_steps, self.compile)
        else:   # the first shape's later points on the first point's build (NOTE [one build per shape])
            groups = shape_streams(self.points, self.sample)
            m = _measure_into(self.points[0], plan, self.n_steps, self.compile, then=groups[0][1][1:])
            if m is not None:   # None: refused by the device, a miss already (NOTE [blocked step])
                _record_sample(plan, self.sample,
                               [m.peak_bytes, *m.then_peak_bytes, *_shape_peaks(groups[1:], plan)])
        self.margins.append(self.margin)

    def correct(self, plan: Plan) -> Plan:
        assert plan.measured_peak_bytes is not None
        plan, self.margin = replan_with_correction(self.report, plan, plan.measured_peak_bytes, margin_bytes=self.margin,
                                                   allow_hazards=self.kw["allow_hazards"])
        return plan

    def relax(self, plan: Plan) -> Plan | None:
        """Compiled and under its prediction: plan again at the compiled step's own (negative) error."""
        assert plan.measured_peak_bytes is not None
        error = plan.measured_peak_bytes - plan.predicted_peak_bytes    # bytes; < 0: the step peaked lower
        if error >= 0:
            return None
        self.margin = error
        return make_plan(self.report, self.planner, margin_bytes=error, **self.kw)

    def fallbacks(self) -> list[Plan]:
        """NOTE [closed loop fallbacks]: ``all``, ``floor`` and the baseline families' plans (NOTE [baseline
        families]), cheapest first, when the model could be wrong about them (predicted within its error
        bound of the target); at most ``_FAMILY_FALLBACKS`` of each family."""
        target = effective_budget(self.kw["budget_bytes"], self.kw["reserve"])
        near = [fb for fb in [*(make_plan(self.report, spec, **self.kw) for spec in ("all", "floor")),
                              *_family_plans(self.report, self.kw, target)]
                if fb.boundaries and fb.predicted_peak_bytes <= target * (1 + _MODEL_ERROR)]
        return sorted(near, key=lambda p: (p.predicted_overhead_ms, p.predicted_peak_bytes))

    def attempts(self, tried: list[Tried[Plan]]) -> list[Attempt]:
        return [Attempt(predicted_peak_bytes=t.plan.predicted_peak_bytes, measured_peak_bytes=t.plan.measured_peak_bytes,
                        margin_bytes=0 if t.fallback else margin, fits=t.fits)
                for t, margin in zip(tried, self.margins)]


# Per baseline family (first-k, checkpoint_sequential), how many plans are measured as fallbacks
# (each measurement is a fresh build): the family's cheapest plan predicted to fit, and its neighbours
# in predicted overhead (one cheaper, predicted over the target; one dearer).
_FAMILY_FALLBACKS = 3


def _family_plans(report: ProfileReport, kw: dict[str, Any], target: int) -> list[Plan]:
    """The fixed-K plans of ``first-k`` and ``checkpoint_sequential`` (NOTE [baseline families]) predicted
    within ``_MODEL_ERROR`` of ``target``: per family ``_FAMILY_FALLBACKS`` around its cheapest predicted fit."""
    first_k: list[Plan] = []
    for k in range(1, len(report.candidates) + 1):
        plan = make_plan(report, f"first-k:{k}", **kw)
        if first_k and _key(plan) == _key(first_k[-1]):
            break                      # past the last top-level block: every block is taken
        first_k.append(plan)
    sequential: list[Plan] = []
    for k in range(2, len(first_k) + 1):
        try:
            sequential.append(make_plan(report, f"checkpoint_sequential:{k}", **kw))
        except PlanError:              # no chain, or a segment the profile does not offer
            continue
    out: list[Plan] = []
    for family in (first_k, sequential):
        near = sorted((p for p in family if p.boundaries and p.predicted_peak_bytes <= target * (1 + _MODEL_ERROR)),
                      key=_overhead_ms)
        fit = next((i for i, p in enumerate(near) if p.predicted_peak_bytes <= target), len(near) - 1)
        start = max(0, fit - 1)
        out += near[start:start + _FAMILY_FALLBACKS]
    return out


def _cheapest_in_budget(plans: list[Plan]) -> Plan | None:
    """Of plans that missed the effective budget, the cheapest whose measured peak is under the budget itself
    (it eats into the reserve: NOTE [the reserve]); None when none is."""
    inside = [p for p in plans if p.budget_bytes is not None and p.measured_peak_bytes is not None
              and p.measured_peak_bytes <= p.budget_bytes]
    return min(inside, key=lambda p: (p.predicted_overhead_ms, p.measured_peak_bytes), default=None)


def reserve_that_ships(plan: Plan) -> float:
    """The largest reserve (to 0.1%) under which ``plan``'s measured peak clears its budget (NOTE [the reserve])."""
    assert plan.budget_bytes is not None and plan.measured_peak_bytes is not None
    r = math.floor((1.0 - plan.measured_peak_bytes / plan.budget_bytes) * 1000) / 1000
    while r > 0 and effective_budget(plan.budget_bytes, r) < plan.measured_peak_bytes:   # float rounding
        r = round(r - 0.001, 3)
    return max(r, 0.0)


def _key(plan: Plan) -> tuple:
    return tuple((b.module, b.mode.value) for b in plan.boundaries)


def _overhead_ms(plan: Plan) -> float:
    return plan.predicted_overhead_ms


def _fits(plan: Plan) -> bool:
    target = plan.effective_budget_bytes
    return target is None or (plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= target)


def _measure_into(loaded: LoadedWorkload, plan: Plan, steps: int, compile: CompileSpec | None = None,
                  then: Sequence[Stream] = ()) -> StepMeasurement | None:
    if compile is not None:
        plan.compile = compile
    clear_refusal()   # a refusal read below is this measurement's, never an earlier step's
    try:
        m = measure_plan(loaded, plan, steps=steps, then=then)
    except torch.OutOfMemoryError:
        # a plan that does not fit the device (NOTE [blocked step]): a miss whose peak is at least what
        # was live plus the refused allocation (the CPU capacity's record), else just over the budget
        refusal = last_refusal()
        floor = max(plan.effective_budget_bytes or 0, plan.predicted_peak_bytes) + 1
        plan.measured_peak_bytes = max(floor, refusal.live_bytes + refusal.requested_bytes) if refusal else floor
        plan.measured_step_ms = None
        return None
    plan.measured_peak_bytes = m.peak_bytes
    plan.measured_step_ms = m.p50_ms
    if compile is not None or m.tracker_peak_bytes is not None:
        # the compiled step's instrument, or torch.profiler where it confirmed a peak at the edge
        plan.memory_source = m.memory_source
    return m


def _record_sample(plan: Plan, sample: StepSample, peaks: list[int]) -> None:
    """Record ``plan``'s peak at every point (bytes, in ``sample.points()`` order) in ``plan.sample``;
    ``plan.measured_peak_bytes`` becomes their max (NOTE [step sample])."""
    plan.sample = SampleRecord(sample=sample, point_peaks=peaks)
    plan.measured_peak_bytes = max(peaks)


def measure_sample_peaks(points: list[LoadedWorkload], plan: Plan, sample: StepSample) -> None:
    """Measure ``plan`` at every point after the first (``plan.measured_peak_bytes`` is the first's) and
    record them (``_record_sample``)."""
    assert plan.measured_peak_bytes is not None
    _record_sample(plan, sample, sample_peaks(points, sample, plan, plan.measured_peak_bytes))


def sample_peaks(points: list[LoadedWorkload], sample: StepSample, plan: Plan, first_peak: int) -> list[int]:
    """``first_peak`` (bytes, measured at ``points[0]``) and ``plan``'s peak at every later point: the
    first shape's later points on one fresh build, each boundary shape's points on one of their own,
    after 1 warm-up step (compiled when the plan is; NOTE [one build per shape])."""
    groups = shape_streams(points, sample)
    first, streams = groups[0]
    return [first_peak, *measure_stream_peaks(first, PlanArm("plan", plan), streams[1:]), *_shape_peaks(groups[1:], plan)]


def _shape_peaks(groups: list[tuple[LoadedWorkload, list[Stream]]], plan: Plan) -> list[int]:
    """``plan``'s peak at every point of each shape of ``groups``, one fresh build per shape."""
    arm = PlanArm("plan", plan)
    return [peak for loaded, streams in groups for peak in measure_stream_peaks(loaded, arm, streams)]


class BudgetMissed(BudgetError):
    """Every plan the closed loop measured (its own and the fallbacks) peaked over the effective budget.

    ``in_budget``: the cheapest of them measured under the budget itself (inside the reserve), offered
    with the reserve that would ship it (NOTE [the reserve])."""

    def __init__(self, *, best: Plan, tried: int, in_budget: Plan | None = None) -> None:
        self.best = best
        self.in_budget = in_budget
        target = best.effective_budget_bytes or 0
        gap = (best.measured_peak_bytes or 0) - target
        offer, tip = "", ""
        if in_budget is not None:
            r = reserve_that_ships(in_budget)
            offer = (f"; {in_budget.planner} ({len(in_budget.boundaries)} boundaries) measured "
                     f"{format_bytes(in_budget.measured_peak_bytes or 0)}, under the budget of "
                     f"{format_bytes(in_budget.budget_bytes or 0)} itself but inside its "
                     f"{in_budget.reserve:.1%} reserve")
            tip = f"pass {spell(Option.RESERVE, r)} to ship that plan, or "
        super().__init__(
            f"no plan measured under the effective budget of {format_bytes(target)}: the lowest measured peak of the "
            f"{tried} plans tried is {format_bytes(best.measured_peak_bytes or 0)} ({best.planner}, "
            f"{len(best.boundaries)} boundaries), {format_bytes(gap)} over" + offer,
            tip=tip + "ask for a budget of at least "
                f"{format_bytes(min_budget_for(best.measured_peak_bytes or 0, best.reserve))} "
                "(that plan measured under it), lower the reserve, or make more candidates plannable")


# -- a device's capacity as the budget (NOTE [device capacity] in remat/autoplan/run.py) ---------------

def plan_for_device(loaded: LoadedWorkload, report: ProfileReport, planner: str | PlannerSpec, *, budget_bytes: int | None,
                    capacity_bytes: int | None, blocked: BlockedStep | None = None,
                    race: TimeRaceSettings | None = None, **kw: Any) -> ClosedLoopResult:
    """:func:`plan_closed_loop`; where the budget is the device's capacity and no plan fits it, DeviceTooSmall
    with the floor plan's peak measured at the target under the capacity (NOTE [blocked step]). The plan
    records ``blocked``. ``race``: then time the plan against the fastest simple plan that fits and ship the
    faster (NOTE [time race]); None: no race."""
    try:
        result = plan_closed_loop(loaded, report, planner, budget_bytes=budget_bytes, **kw)
    except (InfeasibleBudget, BudgetMissed) as exc:
        if capacity_bytes is None or budget_bytes is None or budget_bytes < capacity_bytes:
            raise   # a budget under the device: the budget's own error says what would meet it
        if isinstance(exc, BudgetMissed):   # plans were measured: the lowest of them
            floor = exc.best.measured_peak_bytes or 0
            lowest = f"the lowest peak measured ({exc.best.planner}) is {format_bytes(floor)}"
        elif exc.measured_by is not None:   # the closed loop measured its floor already
            floor = exc.floor_bytes
            lowest = f"the lowest peak measured ({exc.measured_by}) is {format_bytes(floor)}"
        else:
            floor, how = _measured_floor(loaded, report, kw.get("reserve", 0.05), kw.get("progress", no_progress))
            lowest = f"the floor plan's peak is {how} {format_bytes(floor)}"
        raise DeviceTooSmall(f"the step does not fit the device capacity of {format_bytes(capacity_bytes)} less its "
                             f"reserve with any plan: {lowest}"
                             + (f" ({blocked.describe()})" if blocked is not None else ""),
                             capacity_bytes=capacity_bytes, floor_bytes=floor) from exc
    if race is not None and budget_bytes is not None:
        race_simple_plan(result, race, kw.get("progress", no_progress))
    result.plan.blocked = blocked
    return result


def _measured_refusal(infeasible: InfeasibleBudget, tried: list[Plan], loaded: LoadedWorkload, report: ProfileReport,
                      reserve: float, progress: ProgressFn) -> InfeasibleBudget:
    """The model's refusal with its floor replaced by the lowest peak measured: of the fallbacks tried, else the
    floor plan measured now, so the budget its tip asks for is one a measured plan ships at (NOTE [closed loop
    fallbacks]). The prediction stands only when measuring the floor failed."""
    measured = [p for p in tried if p.measured_peak_bytes is not None]
    if measured:
        best = min(measured, key=lambda p: p.measured_peak_bytes or 0)
        floor, by = best.measured_peak_bytes or 0, best.planner
    else:
        floor, how = _measured_floor(loaded, report, reserve, progress)
        if how.startswith("predicted"):
            return infeasible
        if floor <= infeasible.effective_budget_bytes:   # the profile is off by more than _MODEL_ERROR here
            return InfeasibleBudget(
                floor_bytes=infeasible.floor_bytes, budget_bytes=infeasible.budget_bytes, reserve=infeasible.reserve,
                control_peak_bytes=infeasible.control_peak_bytes,
                explanation=f"{infeasible.explanation + '; ' if infeasible.explanation else ''}but the floor plan "
                            f"measured {format_bytes(floor)}, within the budget: the profile is wrong on this step "
                            "(plan it with --planner floor / planner=\"floor\", which the closed loop measures)")
        by = "the floor plan" + (", at least: the device refused it" if "least" in how else "")
    return InfeasibleBudget(floor_bytes=floor, budget_bytes=infeasible.budget_bytes, reserve=infeasible.reserve,
                            explanation=infeasible.explanation, control_peak_bytes=infeasible.control_peak_bytes,
                            measured_by=by)


def _measured_floor(loaded: LoadedWorkload, report: ProfileReport, reserve: float,
                    progress: ProgressFn) -> tuple[int, str]:
    """The floor plan (the least predicted peak) measured at the target under the capacity: (bytes, how);
    a plan the capacity refuses measures at least what was live plus the refused allocation."""
    floor = make_plan(report, "floor", budget_bytes=None, reserve=reserve)
    progress("plan: nothing is predicted to fit the device; measuring the floor plan", 0, 1)
    clear_refusal()
    try:
        return measure_plan(loaded, floor, steps=1).peak_bytes, "measured"
    except torch.OutOfMemoryError:
        refusal = last_refusal()
        if refusal is None:
            return floor.predicted_peak_bytes, "predicted (measuring it ran out of memory)"
        return refusal.live_bytes + refusal.requested_bytes, "measured at least"


# -- the time race (NOTE [time race]) -----------------------------------------------------------------

RACE_ENV_VAR = "REMAT_TIME_RACE"   # "0", "off", "false", "no": no time race (remat.auto; the test suite sets it)


@dataclasses.dataclass(kw_only=True)
class TimeRaceSettings:
    """How much the time race may cost (NOTE [time race]): interleaved rounds and simple plans measured."""

    rounds: int = MIN_RACE_ROUNDS   # timed interleaved rounds of the three arms (NOTE [paired ratio interval])
    warmup: int = 1                 # untimed rounds first (the optimizer's state exists from the first step)
    max_simple_peaks: int = 3       # simple plans measured for their peak at most (each a fresh build)
    extra_rounds: int = MIN_RACE_ROUNDS   # rounds added once to a tie that leans (NOTE [race extension]); 0: never
    lean: float = 0.03              # how far from 1 a tied ratio's median must be to add them (a ratio)

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.warmup < 0 or self.max_simple_peaks < 1 or self.extra_rounds < 0 or self.lean < 0:
            raise PlanError(f"the time race needs rounds >= 1, warmup >= 0, max_simple_peaks >= 1, extra_rounds >= 0 "
                            f"and lean >= 0, got {self.rounds}, {self.warmup}, {self.max_simple_peaks}, "
                            f"{self.extra_rounds}, {self.lean}")

    def extends(self, first: PairedRatio) -> bool:
        """Whether a race whose first rounds read ``first`` gets ``extra_rounds`` more (NOTE [race extension]).

        NOTE [race extension]
        Six rounds resolve only what all six agree on, so on a busy machine a real difference
        often reads as a tie: the diffusers UNet at 70%, one plan, raced five times, won four
        (-4.7% to -10.7%) and tied once, so the same inputs shipped two plans. A tie whose
        median leans (``|ratio - 1| >= lean``) gets ``extra_rounds`` more rounds, once, and the
        verdict is read over all of them (at 12 rounds the interval is [r_(3), r_(10)]: two
        rounds against the rest are allowed). A tie that does not lean is a tie: measuring
        it longer costs steps and changes nothing that ships. The second look is a second
        chance to resolve, so a difference that is not there resolves with probability at most
        2 x 5% (each look at least 95%), instead of 5%, and then only for a tie that leaned.
        """
        return self.extra_rounds > 0 and not first.resolved and abs(first.ratio - 1.0) >= self.lean

    @classmethod
    def unless_disabled(cls, enabled: bool = True) -> "TimeRaceSettings | None":
        """The default race, or None when ``enabled`` is False or ``$REMAT_TIME_RACE`` says off."""
        off = os.environ.get(RACE_ENV_VAR, "").strip().lower() in ("0", "off", "false", "no")
        return cls() if enabled and not off else None


def race_simple_plan(result: ClosedLoopResult, settings: TimeRaceSettings, progress: ProgressFn = no_progress) -> None:
    """Race a budget-driven plan against the fastest simple plan that fits; ship the faster (in ``result``).

    NOTE [time race]
    The cost model prices a plan's added time from each boundary's replay timed alone, and it can be
    wrong in a way no peak measurement shows: on HF GPT-2 at 70% remat's mixed selective/full plan
    was predicted +31 ms and measured +45 ms, resolved slower than checkpointing the first 2 blocks,
    a plan inside its own search space. So before a budget-driven plan (``optimal``, ``greedy``)
    ships, the closed loop races it against the fastest *simple* plan that fits: of ``all``,
    ``uniform:K`` (every K-th block), ``first-k:K`` and ``checkpoint_sequential:K`` (NOTE [baseline
    families] in plan/planners.py), those predicted to fit and then those predicted within the model's
    error over the target, each group in order of predicted added time, the first whose *measured* peak
    fits (a plan the loop measured already
    is not measured again; at most ``max_simple_peaks`` new builds). Then the unplanned step, remat's
    plan and the simple plan run interleaved (NOTE [interleaved timing], ``rounds`` timed rounds
    after ``warmup``), and the paired ratio remat / simple with its interval (NOTE [paired ratio
    interval] in plan/timing.py) decides: resolved faster, remat's plan ships; resolved slower, the
    simple plan ships (its ``planner`` reads ``optimal->first-k:2``); a tie ships the simpler, the
    simple plan unless remat's has fewer boundaries. The shipped plan's ``time_race`` says which
    simple plan it was raced against, by how much it won or lost, and what shipped.

    The measured added times (each arm's paired difference from the unplanned step, ms) are fed back
    into the profile's replay prices per checkpoint mode, as the closed-loop margin feeds back the
    peak error: FULL from the simple plan, the other modes of remat's plan from what FULL leaves of
    its time (``time_scales``; a factor outside 1/4..4 is not believed). Later plans from the same
    profile (the frontier's, a re-plan at a new shape) are priced with them.

    Skipped: no budget, a plan that is not remat's own pick (a fallback, a simple planner asked
    for, ``floor``), no boundaries, a job (ranks must not branch on a rank-local time: NOTE [one
    plan per job]), ``$REMAT_TIME_RACE=0`` or ``remat plan --no-time-race``. Three resident builds
    that do not fit the device side by side record ``untimed`` and remat's plan ships.
    Cost: ``(warmup + rounds) x 3`` steps plus up to ``max_simple_peaks`` peak measurements
    (7 x 3 = 21 steps by default), and ``extra_rounds x 3`` more for a tie that leans (NOTE [race
    extension]); the race's verdict is only as stable as the machine, so the default needs all six
    rounds to agree (or all but two of twelve) before it overrides the simpler plan.
    """
    plan, loop = result.plan, result.loop
    spec = plan.planner
    if (loop is None or loop.loaded.ranks is not None or not plan.boundaries or spec.fallback_of is not None
            or spec.kind not in (PlannerKind.OPTIMAL, PlannerKind.GREEDY)):
        return
    simple = _fastest_simple_that_fits(loop, plan, result.tried, settings.max_simple_peaks, progress)
    if simple is None:
        return
    if _key(simple) == _key(plan):
        plan.time_race = TimeRace(simple=simple.planner.format(), simple_boundaries=len(simple.boundaries),
                                  verdict=RaceVerdict.SAME, shipped_simple=False, rounds=0)
        return
    timed = _time_side_by_side(loop, plan, simple, settings, progress)
    if timed is None:
        plan.time_race = TimeRace(simple=simple.planner.format(), simple_boundaries=len(simple.boundaries),
                                  verdict=RaceVerdict.UNTIMED, shipped_simple=False, rounds=0)
        return
    result.plan = _decide_race(loop.report, plan, simple, *timed)


def _decide_race(report: ProfileReport, plan: Plan, simple: Plan, unplanned: list[float], remat: list[float],
                 simple_ms: list[float]) -> Plan:
    """The race's verdict from the interleaved step times (ms, one per round), the time error fed back into
    ``report``, and the plan that ships, its ``time_race`` recorded (NOTE [time race])."""
    ratio = paired_ratio(remat, simple_ms)
    verdict, ship_simple = race_verdict(ratio, plan, simple)
    scales = time_scales(plan, p50([a - u for a, u in zip(remat, unplanned)]),
                         simple, p50([b - u for b, u in zip(simple_ms, unplanned)]))
    calibrate_replay_ms(report, scales)
    record = TimeRace(simple=simple.planner.format(), simple_boundaries=len(simple.boundaries), verdict=verdict,
                      shipped_simple=ship_simple, rounds=ratio.rounds, ratio=ratio.ratio, low=ratio.low,
                      high=ratio.high, remat_ms=p50(remat), simple_ms=p50(simple_ms), unplanned_ms=p50(unplanned),
                      time_scale=tuple(sorted(scales.items(), key=lambda kv: kv[0].value)))
    shipped = simple if ship_simple else plan
    if ship_simple:   # says what shipped and why (NOTE [planner specs])
        shipped.planner = simple.planner.after_miss_of(plan.planner)
    shipped.time_race = record
    return shipped


def _simple_plans(report: ProfileReport, kw: dict[str, Any]) -> list[Plan]:
    """Every plan of ``all``, ``uniform:K``, ``first-k:K`` and ``checkpoint_sequential:K`` (NOTE [baseline
    families]), one per set of boundaries (the first spec that makes it)."""
    names = {c.name for c in report.candidates}
    n = sum(1 for c in report.candidates if c.parent is None or c.parent not in names)
    specs = ["all", *(f"uniform:{k}" for k in range(2, n + 1)), *(f"first-k:{k}" for k in range(1, n + 1)),
             *(f"checkpoint_sequential:{k}" for k in range(2, n + 1))]
    out: dict[tuple, Plan] = {}
    for spec in specs:
        try:
            plan = make_plan(report, spec, **kw)
        except PlanError:   # no chain, or a segment the profile does not offer
            continue
        if plan.boundaries:
            out.setdefault(_key(plan), plan)
    return list(out.values())


def _fastest_simple_that_fits(loop: "_OneDevice", plan: Plan, tried: list[Plan], max_new: int,
                              progress: ProgressFn) -> Plan | None:
    """The simple plan of least predicted added time whose measured peak fits (NOTE [time race]); None: none of
    those predicted near the target measured to fit within ``max_new`` new measurements."""
    target = effective_budget(loop.kw["budget_bytes"], loop.kw["reserve"])
    measured = {_key(p): p for p in [*tried, plan] if p.measured_peak_bytes is not None}
    near = sorted((p for p in _simple_plans(loop.report, loop.kw) if p.predicted_peak_bytes <= target * (1 + _MODEL_ERROR)),
                  key=lambda p: (p.predicted_peak_bytes > target, p.predicted_overhead_ms, p.predicted_peak_bytes,
                                 len(p.boundaries)))   # those predicted to fit first, then the model's error band
    new = 0
    for candidate in near:
        if _key(candidate) in measured:
            seen = measured[_key(candidate)]
            if _fits(seen):
                candidate.measured_peak_bytes, candidate.measured_step_ms = seen.measured_peak_bytes, seen.measured_step_ms
                candidate.memory_source, candidate.sample, candidate.compile = seen.memory_source, seen.sample, seen.compile
                return candidate
            continue
        if new == max_new:
            return None
        progress(f"plan: measure the simple plan {candidate.planner} for the time race", new, max_new)
        loop.measure(candidate)
        new += 1
        if _fits(candidate):
            return candidate
    return None


def _time_side_by_side(loop: "_OneDevice", plan: Plan, simple: Plan, settings: TimeRaceSettings,
                       progress: ProgressFn) -> tuple[list[float], list[float], list[float]] | None:
    """Warm step times (ms per round) of the unplanned step, ``plan`` and ``simple``, interleaved on fresh builds
    (NOTE [interleaved timing]); None when the three builds do not fit the device side by side."""
    runners: list[Prepared] = []
    arms = [Arm("unplanned", compile=loop.compile), PlanArm("remat", plan), PlanArm("simple", simple)]
    try:
        for arm in arms:
            runners.append(prepare_arm(loop.points[0], arm))
        what = f"plan: time race against {simple.planner}"
        timings = time_round_robin(runners, warmup=settings.warmup, steps=settings.rounds, progress=progress, what=what)
        times = [timings.step_ms[a.label] for a in arms]
        if settings.extends(paired_ratio(times[1], times[2])):   # NOTE [race extension]
            more = time_round_robin(runners, warmup=0, steps=settings.extra_rounds, progress=progress,
                                    what=f"{what} (more rounds)")
            times = [t + more.step_ms[a.label] for t, a in zip(times, arms)]
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_allocation_failure(exc):
            raise
        return None
    finally:
        for r in reversed(runners):
            r.close()
        runners.clear()
        release_memory()
    return times[0], times[1], times[2]
