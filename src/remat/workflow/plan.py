"""``plan_step`` and ``plan_simulated``: profile a workload and plan it under a budget, what ``remat plan`` runs.

The CLI parses the flags, refuses the combinations that make no sense, and calls one of these; the
order of the work (profile, budget, plan, the closed loop unless ``measure`` is off) and what the plan
records about how it was made (its workload, compile spec, step sample, blocked step) live here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..closed_loop import ClosedLoopResult, TimeRaceSettings, plan_for_device
from ..measure import CompileSpec
from ..memory.capacity import step_capacity
from ..plan import Plan, PlannerSpec, PlanWorkload, budget_on_device, make_plan, parse_budget
from ..plan.offload import OffloadPricing
from ..profile import ProfileReport, profile_simulated
from ..profile.blocked import profile_on_device
from ..profile.model import SampleRecord, StepSample
from ..types import ProgressFn, no_progress
from ..workload import LoadedWorkload


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """What to plan for: the planner, the budget and what the plan may use (bytes where a figure is a size)."""

    planner: str | PlannerSpec = "optimal"    # a planner spec: "optimal", "greedy", "uniform:2", ...; text is parsed
    budget: str | int | None = None           # as ``remat plan --budget`` takes it: bytes, "800MiB", "60%"
    reserve: float = 0.05                     # share of the budget kept free
    capacity_bytes: int | None = None         # the device's stated capacity (NOTE [blocked step]); None: not stated
    candidates: list[str] | None = None       # module paths, class names or regexes; None: the default candidates
    allow_hazards: bool = False               # plan hazardous candidates unguarded
    measure: bool = True                      # apply and measure: the closed loop (False: the planner's pick only)
    offload: OffloadPricing | None = None     # offer activation offload, priced so (NOTE [offload cost model])
    compile: CompileSpec | None = None        # run compiled (NOTE [compiled arms])
    time_race: bool = True                    # race the plan against the fastest simple plan (NOTE [time race])

    def __post_init__(self) -> None:
        object.__setattr__(self, "planner", PlannerSpec.parse(self.planner))   # once, before any work


def recorded_workload(loaded: LoadedWorkload) -> PlanWorkload:
    """The PlanWorkload a plan made on ``loaded`` records (NOTE [plan workload])."""
    return PlanWorkload(spec=loaded.spec, shape=dict(loaded.shape), device=loaded.device, dtype=loaded.dtype,
                        autocast=loaded.autocast)


def plan_step(loaded: LoadedWorkload, settings: PlanSettings, sample: StepSample,
              progress: ProgressFn = no_progress) -> tuple[ProfileReport, ClosedLoopResult | Plan]:
    """Profile ``loaded`` over ``sample`` and plan it: (the profile, the closed loop's result, or with
    ``settings.measure`` off the planner's plan, unmeasured). On the CPU every step runs under the stated
    capacity, enforced (NOTE [device capacity])."""
    s = settings
    with step_capacity(s.capacity_bytes if loaded.device == "cpu" else None):
        report, blocked = profile_on_device(loaded, sample, capacity_bytes=s.capacity_bytes, candidates=s.candidates,
                                            progress=progress)
        budget = budget_on_device(s.budget, report.baseline_peak_bytes, s.capacity_bytes)
        if not s.measure:
            plan = make_plan(report, s.planner, budget_bytes=budget, reserve=s.reserve,
                             allow_hazards=s.allow_hazards, offload=s.offload)
            # run compiled wherever it is applied by remat (not measured here); profiled on the sample, not measured
            return report, dataclasses.replace(
                plan, compile=s.compile, workload=recorded_workload(loaded), blocked=blocked,
                sample=None if sample.is_single else SampleRecord(sample=sample))
        result = plan_for_device(loaded, report, s.planner, budget_bytes=budget, capacity_bytes=s.capacity_bytes,
                                 blocked=blocked, reserve=s.reserve, allow_hazards=s.allow_hazards, compile=s.compile,
                                 offload=s.offload, sample=None if sample.is_single else sample, progress=progress,
                                 race=TimeRaceSettings.unless_disabled(s.time_race))
    plan = dataclasses.replace(result.plan, workload=recorded_workload(loaded))   # NOTE [plan workload]
    return report, dataclasses.replace(result, plan=plan)


def plan_simulated(workload: str, shape: dict[str, Any], *, dtype: str, device: str, target_device: str,
                   settings: PlanSettings, progress: ProgressFn = no_progress) -> tuple[ProfileReport, Plan]:
    """Profile ``workload`` under FakeTensorMode with times from ``target_device``'s model and plan it
    (no closed loop: nothing is measured; the plan says its figures are simulated)."""
    s = settings
    report = profile_simulated(workload, shape, dtype=dtype, target_device=target_device, candidates=s.candidates,
                               progress=progress)
    budget = parse_budget(s.budget, report.baseline_peak_bytes) if s.budget is not None else None
    plan = make_plan(report, s.planner, budget_bytes=budget, reserve=s.reserve, allow_hazards=s.allow_hazards,
                     offload=s.offload)
    return report, dataclasses.replace(plan, workload=PlanWorkload(spec=workload, shape=dict(shape), device=device,
                                                                   dtype=dtype))
