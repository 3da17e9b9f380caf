"""Closed loop: plan, apply to a fresh model, measure, and re-plan if the peak missed.

NOTE [closed loop]
The cost model (profile/model.py) is built from one baseline step; real checkpointing
can differ a little (the replay's early stop, allocation order). So a budget-driven plan
is applied to a fresh build of the workload and its whole-step peak measured; if the
measured peak misses the effective budget, the planner's margin grows by the observed
error (plan.replan_with_correction) and it plans again, at most ``max_tries`` times.
The plan returned records predicted *and* measured figures.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from ..errors import BudgetError
from ..memory.measure import measure_step_peak
from ..plan import BUDGET_PLANNERS, Plan, make_plan, replan_with_correction
from ..profile.model import ProfileReport
from ..types import ProgressFn, no_progress
from ..workload.contract import TrainingStep
from ..workload.loader import LoadedWorkload
from .handle import apply


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanMeasurement:
    peak_bytes: int
    step_ms: list[float]      # warm whole steps (batch, forward, backward, optimizer)
    memory_source: str
    num_alloc_retries: int = 0

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.step_ms)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt:
    predicted_peak_bytes: int
    measured_peak_bytes: int
    margin_bytes: int
    fits: bool


@dataclasses.dataclass(kw_only=True)
class ClosedLoopResult:
    plan: Plan
    attempts: list[Attempt]


def measure_plan(loaded: LoadedWorkload, plan: Plan | None, *, warmup: int = 2, steps: int = 3) -> PlanMeasurement:
    """Peak and warm step times of ``plan`` applied to a fresh build of the workload."""
    fresh = loaded.rebuild()
    handle = apply(fresh.workload.model, plan) if plan is not None and plan.boundaries else None
    try:
        step = TrainingStep(fresh.workload)
        for i in range(warmup):
            step.run(i)
        peak = measure_step_peak(step, warmup)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            step.run(warmup + 1 + i)
            if fresh.device.startswith("cuda"):
                import torch
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        if handle is not None:
            handle.remove()
    return PlanMeasurement(peak_bytes=peak.peak_bytes, step_ms=times, memory_source=peak.source.value,
                           num_alloc_retries=peak.num_alloc_retries)


def plan_closed_loop(loaded: LoadedWorkload, report: ProfileReport, planner: str = "optimal", *,
                     budget_bytes: int | None, reserve: float = 0.05, allow_hazards: bool = False,
                     preserve_rng_state: bool = True, max_tries: int = 3, steps: int = 3,
                     progress: ProgressFn = no_progress) -> ClosedLoopResult:
    plan = make_plan(report, planner, budget_bytes=budget_bytes, reserve=reserve, allow_hazards=allow_hazards,
                     preserve_rng_state=preserve_rng_state)
    margin = 0
    attempts: list[Attempt] = []
    budget_driven = planner.split(":")[0] in BUDGET_PLANNERS
    for i in range(max_tries):
        progress("plan: apply and measure", i, max_tries)
        m = measure_plan(loaded, plan, steps=steps)
        plan.measured_peak_bytes = m.peak_bytes
        plan.measured_step_ms = m.p50_ms
        target = plan.effective_budget_bytes
        fits = target is None or m.peak_bytes <= target
        attempts.append(Attempt(predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=m.peak_bytes,
                                margin_bytes=margin, fits=fits))
        if fits or not budget_driven or i == max_tries - 1:
            break
        try:
            plan, margin = replan_with_correction(report, plan, m.peak_bytes, margin_bytes=margin,
                                                  allow_hazards=allow_hazards)
        except BudgetError:
            break  # the corrected target is below the floor: keep the best measured attempt
    progress("plan: apply and measure", max_tries, max_tries)
    return ClosedLoopResult(plan=plan, attempts=attempts)
