"""Closed loop: plan, apply to a fresh model, measure, and re-plan if the peak missed.

It sits below ``apply`` and the measurement stage (it plans, applies and measures), not in
either: wrapping modules is not re-planning, and measuring never imports ``plan``.

NOTE [closed loop]
The cost model (profile/model.py) is built from one baseline step; real checkpointing
can differ a little (the replay's early stop, allocation order). So a budget-driven plan
is applied to a fresh build of the workload and its whole-step peak measured; if the
measured peak misses the effective budget, the planner's margin grows by the observed
error (plan.replan_with_correction) and it plans again, at most ``max_tries`` times; then
it falls back to measured plans (NOTE [closed loop fallbacks]). The plan returned records
predicted *and* measured figures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .wrap import PlanArm
from .errors import BudgetError
from .measure import CompileSpec, StepMeasurement, measure_arm
from .plan import (InfeasibleBudget, PlannerSpec, Plan, effective_budget, format_bytes, make_plan,
                   min_budget_for, replan_with_correction)
from .profile.model import ProfileReport
from .types import ProgressFn, no_progress
from .workload.loader import LoadedWorkload


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt:
    """One plan the closed loop measured: predicted and measured whole-step peak (bytes)."""

    predicted_peak_bytes: int
    measured_peak_bytes: int
    margin_bytes: int         # the planner's margin when it made this plan (NOTE [closed-loop margin])
    fits: bool                # measured peak <= effective budget

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Attempt":
        return cls(predicted_peak_bytes=d["predicted_peak_bytes"], measured_peak_bytes=d["measured_peak_bytes"],
                   margin_bytes=d["margin_bytes"], fits=d["fits"])


@dataclasses.dataclass(kw_only=True)
class ClosedLoopResult:
    plan: Plan
    attempts: list[Attempt]


def measure_plan(loaded: LoadedWorkload, plan: Plan | None, *, warmup: int = 2, steps: int = 3) -> StepMeasurement:
    """Peak and warm step times of ``plan`` applied to a fresh build of the workload (remat.measure)."""
    return measure_arm(loaded, PlanArm("plan", plan), warmup=warmup, steps=steps)


def plan_closed_loop(loaded: LoadedWorkload, report: ProfileReport, planner: str | PlannerSpec = "optimal", *,
                     budget_bytes: int | None, reserve: float = 0.05, allow_hazards: bool = False,
                     preserve_rng_state: bool = True, max_tries: int = 3, steps: int = 3,
                     compile: CompileSpec | None = None,
                     progress: ProgressFn = no_progress) -> ClosedLoopResult:
    """Plan, apply to a fresh build, measure; correct and fall back until a plan measures in budget.

    NOTE [closed loop fallbacks]
    A budget-driven plan (``optimal``, ``greedy``) that measures over its effective budget is
    re-planned with a margin (NOTE [closed-loop margin]) up to ``max_tries`` times. If it
    still misses, or the corrected target falls below the predicted floor, or the model
    said from the start that nothing fits, the model is wrong somewhere, so remat trusts
    measurements instead: the plans that the model ranks lower in peak (``all``: every
    top-level block; ``floor``: the cheapest plan of least predicted peak) are measured in
    order of predicted added time, and the first whose *measured* peak fits ships (it says
    so in its ``planner``). Fallbacks predicted more than ``_MODEL_ERROR`` over the target are
    not measured (no model error seen is that large). Only when none fits is it an error: the
    model's own InfeasibleBudget (naming the floor and why) when it said so from the start,
    else :class:`BudgetMissed` (exit 2) with the measured gap.
    So ``optimal`` never ships worse than ``all`` when ``all`` fits.

    ``compile`` (``remat plan --compile``): every plan is measured compiled (NOTE [compiled
    arms]) and carries the spec (``plan.compile``), so its measured peak is the compiled step's.

    NOTE [compiled closed loop]
    The cost model is built from the eager step, and a compiled step peaks elsewhere: inductor
    frees and fuses differently, and a checkpoint region changes how AOTAutograd partitions the
    graph. The zoo's Llama at 70%: the eager closed-loop plan measured 81.66 MiB eager and 83.54
    MiB compiled, 1.5% over; on the zoo's GPT-2 the compiled step peaks far *under* the eager
    one (unplanned: 71.08 against 108.35 MiB), so the eager plan over-checkpoints there (at 70%
    the relaxed compiled plan holds one selective MLP instead of four regions; RESULTS.md,
    torch.compile). So under ``compile`` the loop corrects in both directions: a plan that misses
    tightens the margin as always, and a plan that fits with its compiled peak under the
    prediction is planned again with that (negative) error as its margin, i.e. with the budget
    the compiled step leaves, which buys a cheaper plan. A relaxed plan is measured like any
    other; the cheapest plan (predicted added time) *measured* to fit is returned, so relaxing
    never returns a plan that misses. Eager keeps the one-way loop: its model error is within
    a few percent and one more measured build is not worth it there.
    """
    budget_driven = PlannerSpec.parse(planner).needs_budget
    attempts: list[Attempt] = []
    kw = dict(budget_bytes=budget_bytes, reserve=reserve, allow_hazards=allow_hazards,
              preserve_rng_state=preserve_rng_state)
    try:
        plan: Plan | None = make_plan(report, planner, **kw)
    except InfeasibleBudget as exc:
        if not budget_driven:
            raise
        plan, infeasible = None, exc
    else:
        infeasible = None
    margin = 0
    measured: dict[tuple, Plan] = {}
    relax = compile is not None and budget_driven and budget_bytes is not None   # NOTE [compiled closed loop]
    best_fit: Plan | None = None     # the cheapest (predicted added time) plan measured to fit
    for i in range(max_tries if plan is not None else 0):
        progress("plan: apply and measure", i, max_tries)
        _measure_into(loaded, plan, steps, compile)
        measured[_key(plan)] = plan
        fits = _fits(plan)
        attempts.append(Attempt(predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=plan.measured_peak_bytes,
                                margin_bytes=margin, fits=fits))
        if fits and (best_fit is None or plan.predicted_overhead_ms < best_fit.predicted_overhead_ms):
            best_fit = plan
        if not budget_driven or i == max_tries - 1:
            break
        error = plan.measured_peak_bytes - plan.predicted_peak_bytes    # bytes; < 0: the step peaked lower
        if fits and not (relax and error < 0):
            break
        if not fits and best_fit is not None:
            break   # a relaxed plan missed: the plan that fitted before it stands
        try:
            if fits:   # compiled and under its prediction: plan again at the compiled step's own error
                margin = error
                plan = make_plan(report, planner, margin_bytes=margin, **kw)
            else:
                plan, margin = replan_with_correction(report, plan, plan.measured_peak_bytes, margin_bytes=margin,
                                                      allow_hazards=allow_hazards)
        except BudgetError:
            break  # the corrected target is below the floor: fall back to measuring (below)
        if _key(plan) in measured:
            plan = measured[_key(plan)]
            break  # the re-plan is a plan already measured: nothing new to learn
    progress("plan: apply and measure", max_tries, max_tries)
    if best_fit is not None:
        plan = best_fit
    if plan is not None and (not budget_driven or budget_bytes is None or _fits(plan)):
        return ClosedLoopResult(plan=plan, attempts=attempts)

    # NOTE [closed loop fallbacks]: measure what the model ranks lower in peak, cheapest first
    fallbacks = []
    target = effective_budget(budget_bytes, reserve)
    for spec in ("all", "floor"):
        fb = make_plan(report, spec, **kw)
        # only plans the model could be wrong about: predicted within its error bound of the target
        if fb.boundaries and _key(fb) not in measured and fb.predicted_peak_bytes <= target * (1 + _MODEL_ERROR):
            fallbacks.append(fb)
    for fb in sorted(fallbacks, key=lambda p: (p.predicted_overhead_ms, p.predicted_peak_bytes)):
        if _key(fb) in measured:
            continue
        progress("plan: measure a fallback", 0, 1)
        _measure_into(loaded, fb, steps, compile)
        measured[_key(fb)] = fb
        attempts.append(Attempt(predicted_peak_bytes=fb.predicted_peak_bytes, measured_peak_bytes=fb.measured_peak_bytes,
                                margin_bytes=0, fits=_fits(fb)))
        if _fits(fb):
            # says what shipped and why: the model's pick missed (NOTE [planner specs])
            fb.planner = PlannerSpec.parse(fb.planner).after_miss_of(PlannerSpec.parse(planner)).format()
            return ClosedLoopResult(plan=fb, attempts=attempts)
    if infeasible is not None:
        raise infeasible   # the model said so from the start, and no measurement disagreed
    best = min(measured.values(), key=lambda p: p.measured_peak_bytes)
    raise BudgetMissed(best=best, tried=len(measured))


# How far the cost model's predicted peak has been seen from the measured one (a share of the
# target): fallbacks predicted further over the target than this are not worth measuring.
_MODEL_ERROR = 0.15


def _key(plan: Plan) -> tuple:
    return tuple((b.module, b.mode.value) for b in plan.boundaries)


def _fits(plan: Plan) -> bool:
    target = plan.effective_budget_bytes
    return target is None or (plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= target)


def _measure_into(loaded: LoadedWorkload, plan: Plan, steps: int, compile: CompileSpec | None = None) -> None:
    if compile is not None:
        plan.compile = compile
    m = measure_plan(loaded, plan, steps=steps)
    plan.measured_peak_bytes = m.peak_bytes
    plan.measured_step_ms = m.p50_ms
    if compile is not None:
        plan.memory_source = m.memory_source.value   # the compiled step's instrument


class BudgetMissed(BudgetError):
    """Every plan the closed loop measured (its own and the fallbacks) peaked over the budget."""

    def __init__(self, *, best: Plan, tried: int) -> None:
        self.best = best
        target = best.effective_budget_bytes or 0
        gap = (best.measured_peak_bytes or 0) - target
        super().__init__(
            f"no plan measured under the effective budget of {format_bytes(target)}: the lowest measured peak of the "
            f"{tried} plans tried is {format_bytes(best.measured_peak_bytes or 0)} ({best.planner}, "
            f"{len(best.boundaries)} boundaries), {format_bytes(gap)} over",
            tip=f"ask for a budget of at least {format_bytes(min_budget_for(best.measured_peak_bytes or 0, best.reserve))} "
                "(that plan measured under it), lower the reserve, or make more candidates plannable")
