"""``run_frontier``: plan a set of ways to checkpoint, measure each, search capacity, decide.

NOTE [frontier run]
1. Profile the workload once (or take the caller's ``ProfileReport``) and make one plan per
   requested spec (``parse_plan_requests``). An ``optimal``/``greedy`` request without
   ``@`` is planned at the frontier's budget *with* its reserve and through the closed
   loop (apply, measure, re-plan: remat.closed_loop), because it is the plan most
   likely to ship. ``planner@X`` requests are sweep points: planned open-loop at budget X
   (bytes, a unit, or a share of the control's profiled peak) with no reserve, so
   ``optimal@50%`` means "predicted peak <= 50% of the control's". An impossible budget
   is a point with decision INFEASIBLE and the floor in its reason, never an error.
   The control (``none``) is always measured, first, even when not requested: every
   overhead is relative to it, in the same process run.
2. Peaks: every plan alone on the device (NOTE [solo peaks] in remat/measure/run.py).
3. Time: all plans interleaved round-robin (NOTE [interleaved timing]).
4. Capacity: per plan, search the capacity key (NOTE [capacity search]) against the
   effective budget, budget x (1 - reserve), the same bar the ship decision uses, so the
   samples/s reported are "qualified": reached by a configuration that clears the reserve.
   Then time every plan at its own capacity, again interleaved, for samples/s.
5. Pareto set and the ship decision (NOTE [ship decision] in pareto.py).

With ``compile`` (``remat frontier --compile``) every plan is measured twice, eager and
compiled (``<label>+compile``: NOTE [compiled arms] in remat/measure/compiled.py), and torch's
own memory knob is aimed at the same peak (NOTE [budget aimed at a peak]); all of them are
timed in the one interleaved run and the ship decision picks among all of them. A plan the
closed loop made (``optimal``/``greedy`` at the frontier's budget) is not merely compiled: its
twin is planned again through the closed loop on the compiled step's peak (NOTE [compiled
closed loop] in remat/closed_loop.py), so ``optimal+compile`` may hold other boundaries than
``optimal``; every other plan's twin keeps its boundaries.

NOTE [budget aimed at a peak]
``torch._functorch.config.activation_memory_budget`` is a ratio of saved-activation bytes, not
a peak: the same 0.5 landed at 68-76% of the control's peak on three workloads, and 0.0 can
peak higher than 0.5 (everything recomputed at once in backward). So remat measures instead of
predicting: the compiled control is ratio 1.0 (torch's default); if it does not fit, remat
bisects the ratio in [0, 1) (0.5 first; a ratio whose measured compiled peak fits moves the low
end up, one that does not moves the high end down), each try a recompile on a fresh build and
one measured warm step, at most ``budget_tries`` tries, stopping when the interval is under
0.02; if nothing fit, the last try is 0.0. Because the peak is not monotone in the ratio, the
answer is the largest ratio *seen* to fit, not a proven maximum. It becomes the point
``torch-budget@<ratio>`` (the unplanned model compiled at that ratio), timed with the rest;
every try is kept in ``budget_search``.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Sequence

import torch

from .. import __version__
from ..closed_loop import plan_closed_loop
from ..errors import BudgetError, PlanError, RematError, UserCodeError, WorkloadError
from ..plan import (InfeasibleBudget, Plan, PlannerKind, PlannerSpec, check_budget_syntax, make_plan, parse_budget,
                    planner_from_spec)
from ..profile import ProfileReport, profile_workload
from ..trace.model import HostContext, TraceContext
from ..types import MemorySource, ProgressFn, no_progress
from ..workload.loader import LoadedWorkload
from ..units import mib
from ..measure import (Arm, CompileSpec, StepMeasurement, Timings, discard, measure_arm, prepare_arm, probe_capacity,
                       release_memory, shape_value, time_round_robin)
from ..wrap import PlanArm
from .capacity import search_capacity
from .model import BudgetTry, CapacityTry, Decision, FrontierPoint, FrontierReport
from .pareto import decide

CONTROL = "none"
COMPILED = "+compile"            # label suffix of a plan's compiled twin
DEFAULT_COMPILED_PLANS: tuple[str, ...] = ("none", "all", "sqrt", "optimal")
# the strong baselines are plans on the frontier too (NOTE [baseline families] in plan/planners.py)
DEFAULT_PLANS: tuple[str, ...] = ("none", "all", "uniform:2", "sqrt", "selective", "checkpoint_sequential", "first-k",
                                  "optimal", "optimal@90%", "optimal@70%", "optimal@50%", "optimal@35%")
# a family that does not apply to a model is a data point
_FAMILIES = (PlannerKind.CHECKPOINT_SEQUENTIAL, PlannerKind.FIRST_K)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One plan to put on the frontier: its label as given and its spec (``planner@X``: planned at budget X)."""

    label: str
    spec: PlannerSpec

    @property
    def planner(self) -> str:
        """The planner's spec text, without ``@X`` (a frontier point's ``planner``)."""
        return self.spec.planner.format()

    @property
    def budget(self) -> str | None:
        """``"70%"``, ``"1.5GiB"``, ``"123456"``; None: the frontier's budget (budget planners)."""
        return self.spec.budget

    @property
    def needs_budget(self) -> bool:
        return self.spec.needs_budget

    @property
    def closed_loop_point(self) -> bool:
        """Planned at the frontier's own budget: through the closed loop when it runs (NOTE [frontier run])."""
        return self.needs_budget and self.budget is None


def parse_plan_requests(specs: str | Sequence[str] | None) -> list[PlanRequest]:
    """``"none,all,uniform:2,optimal,optimal@50%"`` -> requests, control first; PlanError/BudgetError if bad.

    Planner specs are those of ``remat plan`` (none, all, uniform:K, sqrt, selective, greedy,
    optimal); ``optimal@X``/``greedy@X`` plan at budget X (see NOTE [frontier run]).
    """
    if specs is None:
        specs = DEFAULT_PLANS
    items = [s.strip() for s in (specs.split(",") if isinstance(specs, str) else specs)]
    items = [s for s in items if s]
    if not items:
        raise PlanError("no plans to measure: give a comma-separated list, e.g. none,all,optimal")
    out: list[PlanRequest] = []
    seen: set[str] = set()
    for item in items:
        spec = PlannerSpec.parse(item)
        planner_from_spec(spec.planner)  # PlanError for a spec no planner runs
        req = PlanRequest(label=item.replace(" ", ""), spec=spec)
        if req.budget is not None:
            check_budget_syntax(req.budget)  # syntax only; a share is resolved against the control's peak
        if req.label not in seen:
            seen.add(req.label)
            out.append(req)
    if CONTROL not in seen:
        out.insert(0, PlanRequest(label=CONTROL, spec=PlannerSpec.parse(CONTROL)))
    else:
        out.sort(key=lambda r: r.label != CONTROL)  # control first, the rest in the order given
    return out



def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def _boundaries(plan: Plan) -> list[str]:
    return [f"{b.module}:{b.mode.value}" for b in plan.boundaries]


def _make_plans(loaded: LoadedWorkload, report: ProfileReport, requests: list[PlanRequest], *, budget_bytes: int,
                reserve: float, closed_loop: bool, progress: ProgressFn) -> tuple[dict[str, Plan], list[FrontierPoint]]:
    plans: dict[str, Plan] = {}
    points: list[FrontierPoint] = []
    control_peak = report.baseline_peak_bytes
    for i, req in enumerate(requests):
        progress("frontier: planning", i, len(requests))
        point = FrontierPoint(plan=req.label, planner=req.spec.planner)
        if req.closed_loop_point:
            b, r = budget_bytes, reserve
        elif req.needs_budget:
            b, r = parse_budget(req.budget, control_peak), 0.0  # type: ignore[arg-type]
        else:
            b, r = None, reserve
        point.plan_budget_bytes = b
        try:
            if closed_loop and req.closed_loop_point:
                plan = plan_closed_loop(loaded, report, req.planner, budget_bytes=b, reserve=r, steps=1).plan
            else:
                plan = make_plan(report, req.planner, budget_bytes=b, reserve=r)
        except InfeasibleBudget as exc:
            point.decision = Decision.INFEASIBLE
            point.reason = (f"infeasible (floor {mib(exc.floor_bytes)}, "
                            f"{exc.floor_bytes / max(1, control_peak):.0%} of the control's peak; "
                            f"target {mib(exc.effective_budget_bytes)})")
            points.append(point)
            continue
        except BudgetError as exc:
            point.decision = Decision.INFEASIBLE
            point.reason = f"infeasible: {exc.message}"
            points.append(point)
            continue
        except PlanError as exc:
            if req.spec.kind not in _FAMILIES:
                raise
            point.decision = Decision.INFEASIBLE
            point.reason = f"not applicable: {exc.message}"
            points.append(point)
            continue
        except RematError:
            raise
        except Exception as exc:  # noqa: BLE001 - the closed loop ran the plan and it failed: a data point
            point.decision = Decision.FAILED
            point.reason = f"the plan's step raised {_first_line(exc)}"
            points.append(point)
            continue
        point.predicted_peak_bytes = plan.predicted_peak_bytes
        point.predicted_overhead_ms = plan.predicted_overhead_ms
        point.boundaries = _boundaries(plan)
        plans[req.label] = plan
        points.append(point)
    progress("frontier: planning", len(requests), len(requests))
    return plans, points


def _context(loaded: LoadedWorkload, report: ProfileReport, settings: FrontierSettings, *, start: int | None,
             interleaved: bool) -> dict:
    ctx = dataclasses.asdict(TraceContext.capture(workload=loaded.spec, shape=loaded.shape, dtype=loaded.dtype,
                                                  device=loaded.device, warmup=settings.warmup, steps=settings.steps))
    host = HostContext.capture()
    ctx.update(cpu_count=host.cpu_count, platform=host.platform)
    if loaded.device.startswith("cuda") and torch.cuda.is_available():
        ctx["cuda_device"] = torch.cuda.get_device_name(torch.device(loaded.device))
    compile = settings.compile
    ctx.update({
        "remat_version": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "warm whole steps (batch, forward, backward, optimizer), plans interleaved round-robin "
                  "(unless interleaved is false: all plans resident at once ran out of device memory)",
        "peaks": "each plan alone on the device, one warm step",
        "memory_source": report.memory_source.value,
        "control_profiled_peak_bytes": report.baseline_peak_bytes,
        "capacity_key": settings.capacity_key,
        "capacity_start": start, "capacity_max": settings.capacity_max_for(start),
        "capacity_tries": settings.capacity_tries, "capacity_steps": settings.capacity_steps,
        "capacity_granularity": settings.capacity_granularity,
        "closed_loop": settings.closed_loop, "interleaved": interleaved,
        "compile": None if compile is None else compile.to_json(),
        "compiled_peaks": None if compile is None else (
            "compiled points: cuda-allocator on CUDA; on CPU cpu-profiler-allocator "
            "(torch.profiler's allocator events; the live-tensor tracker would run the "
            "compiled model eagerly)"),
    })
    return ctx


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontierSettings:
    """What :func:`run_frontier` measures, and how long (NOTE [frontier run]); checked on construction.

    ``budget_bytes``: whole-step peak budget (bytes); a plan fits when its measured peak is
    <= :attr:`limit`. ``plans``: specs as in :func:`parse_plan_requests` (None:
    :data:`DEFAULT_PLANS`, with ``compile`` :data:`DEFAULT_COMPILED_PLANS`). ``steps``: timed warm
    steps per plan (>= 10 for a published figure; fewer allowed for tests). ``capacity_key``: shape
    keyword to search (None: skip capacity); ``capacity_max`` bounds it (None: 64x its current
    value), ``capacity_tries`` bounds the probes per plan, ``capacity_steps`` is the timed steps
    per plan at capacity, ``capacity_granularity`` how close the bisection gets (1: the exact
    value). ``closed_loop``: plan budget planners at this budget through the closed loop.
    ``compile``: also measure every plan compiled, and torch's activation_memory_budget aimed at
    the budget with at most ``budget_tries`` recompiles (NOTE [budget aimed at a peak]).
    Raises BudgetError for a bad budget or reserve, RematError for bad counts.
    """

    budget_bytes: int
    reserve: float = 0.05
    plans: str | Sequence[str] | None = None
    steps: int = 10
    warmup: int = 2
    capacity_key: str | None = "batch_size"
    capacity_max: int | None = None
    capacity_tries: int = 8
    capacity_steps: int = 3
    capacity_granularity: int = 1
    closed_loop: bool = True
    compile: CompileSpec | None = None
    budget_tries: int = 6

    def __post_init__(self) -> None:
        b, r = self.budget_bytes, self.reserve
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise BudgetError(f"budget must be a positive whole number of bytes, got {b!r}")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r < 1.0:
            raise BudgetError(f"reserve must lie in [0, 1), got {r!r}")
        if self.steps < 1 or self.warmup < 1:
            raise RematError(f"the frontier needs steps >= 1 and warmup >= 1 "
                             f"(got steps={self.steps}, warmup={self.warmup})")
        if self.budget_tries < 1:
            raise RematError(f"budget_tries must be >= 1, got {self.budget_tries}")

    @property
    def limit(self) -> int:
        """The effective budget, budget x (1 - reserve) (bytes): what a measured peak must clear."""
        return int(self.budget_bytes * (1.0 - self.reserve))

    def requests(self) -> list[PlanRequest]:
        default = DEFAULT_COMPILED_PLANS if self.compile is not None else None
        return parse_plan_requests(default if self.plans is None else self.plans)

    def capacity_max_for(self, start: int | None) -> int | None:
        """The capacity search's upper bound when the key's value is ``start`` (None: no search)."""
        return (self.capacity_max or 64 * start) if start else None


def run_frontier(loaded: LoadedWorkload, settings: FrontierSettings, *, report: ProfileReport | None = None,
                 progress: ProgressFn = no_progress) -> FrontierReport:
    """Measure every requested plan on ``loaded`` and decide which one to ship (NOTE [frontier run]).

    ``report``: a profile of ``loaded`` made earlier. Raises BudgetError/PlanError for malformed
    plan specs, WorkloadError for a capacity key the workload lacks; infeasible plans and
    out-of-memory probes are data points.
    """
    requests = settings.requests()
    start = _capacity_start(loaded, settings.capacity_key)
    if report is None:
        report = profile_workload(loaded, progress=progress)
    # 1. plans (with --compile, their compiled twins)
    plans, points = _make_plans(loaded, report, requests, budget_bytes=settings.budget_bytes,
                                reserve=settings.reserve, closed_loop=settings.closed_loop, progress=progress)
    arms = [PlanArm(p.plan, plans[p.plan]) for p in points if p.plan in plans]
    if settings.compile is not None:
        arms += _compiled_twins(loaded, report, requests, points, plans, settings, progress)
    by_label = {p.plan: p for p in points}
    # 2. peaks, one plan at a time (and torch's budget aimed at the limit)
    measured = _measure_peaks(loaded, arms, by_label, warmup=settings.warmup, limit=settings.limit, progress=progress)
    budget_search: list[BudgetTry] = []
    if settings.compile is not None and CONTROL in plans:
        budget_search = _add_torch_budget(loaded, settings, plans, points, by_label, measured, progress)
    # 3. time, interleaved
    interleaved = _time_measured(loaded, measured, by_label, plans, settings, progress)
    _predict_step_times(points, by_label.get(CONTROL))
    # 4. capacity
    if start is not None and measured:
        _capacity(loaded, measured, by_label, key=settings.capacity_key, start=start,  # type: ignore[arg-type]
                  limit=settings.limit, abort_bytes=settings.budget_bytes,
                  max_value=settings.capacity_max_for(start),  # type: ignore[arg-type]
                  max_tries=settings.capacity_tries, granularity=settings.capacity_granularity,
                  steps=settings.capacity_steps, progress=progress)
    # 5. decide
    decided, shipped = decide(points, budget_bytes=settings.budget_bytes, reserve=settings.reserve, control=CONTROL)
    return FrontierReport(context=_context(loaded, report, settings, start=start, interleaved=interleaved),
                          budget_bytes=settings.budget_bytes, reserve=float(settings.reserve),
                          capacity_key=settings.capacity_key or "", points=decided, control=CONTROL,
                          shipped_plan=None if shipped is None else plans[shipped.plan],
                          budget_search=budget_search, plans=dict(plans))


def _capacity_start(loaded: LoadedWorkload, key: str | None) -> int | None:
    """The capacity key's value in ``loaded``'s shape (None: no key); WorkloadError unless a positive int."""
    if key is None:
        return None
    start = shape_value(loaded, key)
    if isinstance(start, bool) or not isinstance(start, int) or start < 1:
        raise WorkloadError(f"capacity key {key!r} must be a positive integer shape keyword; "
                            f"its value here is {start!r}")
    return start


def _compiled_twins(loaded: LoadedWorkload, report: ProfileReport, requests: list[PlanRequest],
                    points: list[FrontierPoint], plans: dict[str, Plan], settings: FrontierSettings,
                    progress: ProgressFn) -> list[Arm]:
    """Every request's compiled twin, its point appended to ``points`` and its plan to ``plans``; their arms."""
    assert settings.compile is not None
    arms: list[Arm] = []
    for req in requests:
        point = by_plan(points, req.label)
        if settings.closed_loop and req.closed_loop_point:
            # NOTE [compiled closed loop]: planned again on the compiled step's peak, even when the
            # eager plan was infeasible (the compiled step may peak lower than the eager model says)
            twin, plan = _compiled_closed_loop(loaded, report, point, settings.compile,
                                               budget_bytes=settings.budget_bytes, reserve=settings.reserve,
                                               progress=progress)
        elif req.label in plans:
            twin = _compiled_twin(point, settings.compile)
            plan = dataclasses.replace(plans[req.label], compile=settings.compile)
        else:
            continue
        points.append(twin)
        if plan is not None:
            plans[twin.plan] = plan
            arms.append(PlanArm(twin.plan, plan))
    return arms


def _measure_peaks(loaded: LoadedWorkload, arms: list[Arm], by_label: dict[str, FrontierPoint], *, warmup: int,
                   limit: int | None, progress: ProgressFn) -> list[Arm]:
    """Each arm's peak alone on the device (NOTE [solo peaks]) into its point; the arms measured. A CPU peak
    at the edge of ``limit`` (bytes, the effective budget) is confirmed by torch.profiler (NOTE [peaks at the edge]).

    A plan whose step raises or runs out of memory is a FAILED point; the control's own error propagates."""
    measured: list[Arm] = []
    for i, arm in enumerate(arms):
        progress("frontier: peaks", i, len(arms))
        point = by_label[arm.label]
        try:
            peak = measure_arm(loaded, arm, warmup=warmup, steps=0, confirm_under=limit)
        except UserCodeError as exc:
            if arm.label == CONTROL:
                raise   # the unplanned step itself fails: the workload's own error
            # a plan, or a compile of it, made the step raise: a data point
            _failed(point, f"the plan's step raised {_first_line(exc)}")
            continue
        except RematError:
            raise  # e.g. FingerprintMismatch: the report was made for another model
        except Exception as exc:  # noqa: BLE001 - OOM, or the wrapped step raised: a data point
            _failed(point, f"out of memory at the base shape: {_first_line(exc)}"
                    if isinstance(exc, torch.OutOfMemoryError) else f"the plan's step raised {_first_line(exc)}")
            continue
        _record_peak(point, peak)
        measured.append(arm)
    progress("frontier: peaks", len(arms), len(arms))
    return measured


def _failed(point: FrontierPoint, reason: str) -> None:
    point.decision = Decision.FAILED
    point.reason = reason
    release_memory()


def _add_torch_budget(loaded: LoadedWorkload, settings: FrontierSettings, plans: dict[str, Plan],
                      points: list[FrontierPoint], by_label: dict[str, FrontierPoint], measured: list[Arm],
                      progress: ProgressFn) -> list[BudgetTry]:
    """torch's budget aimed at the limit (NOTE [budget aimed at a peak]); its point, when one fits, joins the run."""
    assert settings.compile is not None
    ctrl_twin = by_label.get(CONTROL + COMPILED)
    found, tries = _aim_torch_budget(loaded, plans[CONTROL], settings.compile, settings.limit,
                                     None if ctrl_twin is None else ctrl_twin.peak_bytes,
                                     tries=settings.budget_tries, warmup=settings.warmup, progress=progress)
    if found is not None:
        arm, point, plan = found
        points.append(point)
        by_label[point.plan] = point
        plans[point.plan] = plan
        measured.append(arm)
    return tries


def _time_measured(loaded: LoadedWorkload, measured: list[Arm], by_label: dict[str, FrontierPoint],
                   plans: dict[str, Plan], settings: FrontierSettings, progress: ProgressFn) -> bool:
    """Time the measured arms interleaved into their points and plans; whether they ran interleaved."""
    timings, interleaved = _time_arms(loaded, measured, warmup=settings.warmup, steps=settings.steps,
                                      progress=progress)
    for arm in measured:
        point = by_label[arm.label]
        point.step_ms = [round(t, 4) for t in timings.step_ms[arm.label]]
        point.p50_ms = timings.p50(arm.label)
        point.p95_ms = timings.p95(arm.label)
        if point.num_alloc_retries is not None:
            point.num_alloc_retries += timings.num_alloc_retries[arm.label]
        plan = plans[arm.label]
        plan.measured_peak_bytes = point.peak_bytes
        plan.measured_step_ms = point.p50_ms
    return interleaved


def _predict_step_times(points: list[FrontierPoint], control: FrontierPoint | None) -> None:
    """Predicted step time = the control's measured p50 + the predicted overhead (ms)."""
    if control is None or control.p50_ms is None:
        return
    for point in points:
        if point.predicted_overhead_ms is not None and point.p50_ms is not None:
            point.predicted_step_ms = control.p50_ms + point.predicted_overhead_ms


def by_plan(points: list[FrontierPoint], label: str) -> FrontierPoint:
    return next(p for p in points if p.plan == label)


def _record_peak(point: FrontierPoint, peak: StepMeasurement) -> None:
    point.peak_bytes = peak.peak_bytes
    point.memory_source = peak.memory_source
    point.num_alloc_retries = peak.num_alloc_retries if peak.memory_source is MemorySource.CUDA_ALLOCATOR else None
    point.compile_s = None if peak.compile_s is None else round(peak.compile_s, 3)


def _compiled_twin(point: FrontierPoint, spec: CompileSpec) -> FrontierPoint:
    """The compiled twin of an eager plan's point: same boundaries, run through torch.compile."""
    return FrontierPoint(plan=point.plan + COMPILED, planner=point.planner, plan_budget_bytes=point.plan_budget_bytes,
                         predicted_peak_bytes=point.predicted_peak_bytes,
                         predicted_overhead_ms=point.predicted_overhead_ms, boundaries=list(point.boundaries),
                         compile=spec.to_json())


def _compiled_closed_loop(loaded: LoadedWorkload, report: ProfileReport, point: FrontierPoint, spec: CompileSpec, *,
                          budget_bytes: int, reserve: float,
                          progress: ProgressFn) -> tuple[FrontierPoint, Plan | None]:
    """The compiled twin of a closed-loop plan, planned again through the closed loop on the
    *compiled* step's peak (NOTE [compiled closed loop]): its boundaries may differ from the
    eager plan's. A budget the compiled loop cannot meet is a data point (plan None)."""
    twin = FrontierPoint(plan=point.plan + COMPILED, planner=point.planner, plan_budget_bytes=budget_bytes,
                         compile=spec.to_json())
    try:
        plan = plan_closed_loop(loaded, report, point.planner, budget_bytes=budget_bytes, reserve=reserve, steps=1,
                                compile=spec, progress=progress).plan
    except BudgetError as exc:   # InfeasibleBudget or BudgetMissed: measured, nothing compiled fits
        twin.decision = Decision.INFEASIBLE
        twin.reason = f"compiled closed loop: {exc.message}"
        return twin, None
    except Exception as exc:  # noqa: BLE001 - inductor or the compiled plan's step raised: a data point
        if isinstance(exc, RematError) and not isinstance(exc, UserCodeError):
            raise   # remat's own refusal, not the compiled step's failure
        twin.decision = Decision.FAILED
        twin.reason = f"the compiled plan's step raised {_first_line(exc)}"
        return twin, None
    twin.predicted_peak_bytes = plan.predicted_peak_bytes
    twin.predicted_overhead_ms = plan.predicted_overhead_ms
    twin.boundaries = _boundaries(plan)
    return twin, plan


def _aim_torch_budget(loaded: LoadedWorkload, control: Plan, spec: CompileSpec, limit: int,
                      control_compiled_peak: int | None, *, tries: int, warmup: int,
                      progress: ProgressFn) -> tuple[tuple[PlanArm, FrontierPoint, Plan] | None, list[BudgetTry]]:
    """torch's activation_memory_budget aimed at ``limit`` bytes (NOTE [budget aimed at a peak]).

    Returns (the largest fitting ratio's arm, its point with the measured peak, its plan) or
    None when no ratio tried fits, and every try."""
    out: list[BudgetTry] = []
    if control_compiled_peak is not None:   # the compiled control ran at torch's default (1.0)
        out.append(BudgetTry(ratio=1.0, peak_bytes=control_compiled_peak, fits=control_compiled_peak <= limit))
        if control_compiled_peak <= limit:
            return None, out   # torch's default budget already fits: the point none+compile is that arm
    best: tuple[PlanArm, FrontierPoint, Plan] | None = None
    lo, hi = 0.0, 1.0
    for i in range(tries):
        progress("frontier: torch budget", i, tries)
        last = i == tries - 1 or hi - lo < 0.02
        ratio = 0.0 if (last and best is None) else round((lo + hi) / 2, 4)
        plan = dataclasses.replace(control, compile=dataclasses.replace(spec, memory_budget=ratio))
        label = PlannerSpec(kind=PlannerKind.TORCH_BUDGET, ratio=ratio).format()
        arm = PlanArm(label, plan)
        try:
            m = measure_arm(loaded, arm, warmup=warmup, steps=0)
        except Exception as exc:  # noqa: BLE001 - a ratio whose compiled step fails is a data point
            if isinstance(exc, RematError) and not isinstance(exc, UserCodeError):
                raise   # remat's own refusal, not the compiled step's failure
            out.append(BudgetTry(ratio=ratio, peak_bytes=None, fits=False, error=_first_line(exc)))
            release_memory()
            hi = ratio
            continue
        fits = m.peak_bytes <= limit
        out.append(BudgetTry(ratio=ratio, peak_bytes=m.peak_bytes, fits=fits,
                             compile_s=None if m.compile_s is None else round(m.compile_s, 3)))
        if fits and (best is None or ratio > (best[2].compile.memory_budget or 0.0)):  # type: ignore[union-attr]
            point = FrontierPoint(plan=label, planner=PlannerSpec(kind=PlannerKind.TORCH_BUDGET), compile=plan.compile.to_json())  # type: ignore[union-attr]
            _record_peak(point, m)
            best = (arm, point, plan)
        if fits:
            lo = ratio
        else:
            hi = ratio
        if last:
            break
    progress("frontier: torch budget", tries, tries)
    return best, out


def _time_arms(loaded: LoadedWorkload, arms: list[Arm], *, warmup: int, steps: int,
               progress: ProgressFn) -> tuple[Timings, bool]:
    """Interleaved timings of every arm; if all builds resident at once run out of device
    memory, each arm alone instead (returns ``interleaved=False``: the context says so)."""
    prepared: list = []
    try:
        for arm in arms:
            prepared.append(prepare_arm(loaded, arm))
        return time_round_robin(prepared, warmup=warmup, steps=steps, progress=progress,
                                what="frontier: timing"), True
    except torch.OutOfMemoryError:
        pass
    finally:
        discard(prepared)
    merged = Timings(step_ms={}, num_alloc_retries={})
    for arm in arms:
        one = [prepare_arm(loaded, arm)]
        try:
            t = time_round_robin(one, warmup=warmup, steps=steps, progress=progress, what="frontier: timing (alone)")
        finally:
            discard(one)
        merged.step_ms.update(t.step_ms)
        merged.num_alloc_retries.update(t.num_alloc_retries)
    return merged, False


def capacity_try(loaded: LoadedWorkload, arm: Arm, key: str, value: int, limit_bytes: int, *,
                 warmup: int = 1) -> CapacityTry:
    """remat.measure.probe_capacity, as the frontier's record of one capacity try."""
    r = probe_capacity(loaded, arm, key, value, limit_bytes, warmup=warmup)
    return CapacityTry(value=r.value, peak_bytes=r.peak_bytes, oom=r.oom, error=r.error)


def _capacity(loaded: LoadedWorkload, arms: list[Arm], by_label: dict[str, FrontierPoint], *, key: str, start: int,
              limit: int, abort_bytes: int, max_value: int, max_tries: int, granularity: int, steps: int,
              progress: ProgressFn) -> None:
    """Each arm's capacity under ``limit`` (bytes: the budget less its reserve); a probe is stopped only past
    ``abort_bytes`` (the budget itself), so a value that fits inside the reserve is measured and said
    (``CapacityResult.inside_reserve``) rather than reported as out of memory."""
    for i, arm in enumerate(arms):
        progress("frontier: capacity", i, len(arms))
        point = by_label[arm.label]
        first = CapacityTry(value=start, peak_bytes=point.peak_bytes) if start <= max_value else None
        result = search_capacity(lambda v, arm=arm: capacity_try(loaded, arm, key, v, max(limit, abort_bytes)),
                                 key=key, start=start, limit_bytes=limit, max_value=max_value,
                                 max_tries=max_tries, first=first, granularity=granularity)
        point.capacity_search = result
        point.capacity = result.capacity
    progress("frontier: capacity", len(arms), len(arms))

    # time every plan at its own capacity, interleaved, for samples/s
    timed = [a for a in arms if (by_label[a.label].capacity or 0) >= 1]
    if not timed or steps < 1:
        return
    try:
        batch = None if key == "batch_size" else shape_value(loaded, "batch_size")
    except WorkloadError:
        batch = None
    prepared = []
    try:
        for arm in timed:
            prepared.append(prepare_arm(loaded, arm, **{key: by_label[arm.label].capacity}))
        timings = time_round_robin(prepared, warmup=1, steps=steps, progress=progress,
                                   what="frontier: timing at capacity")
    except torch.OutOfMemoryError as exc:  # all plans resident at capacity did not fit together
        for arm in timed:
            by_label[arm.label].capacity_search = dataclasses.replace(
                by_label[arm.label].capacity_search,  # type: ignore[arg-type]
                note=f"not timed at capacity: {str(exc).splitlines()[0][:160]}")
        return
    finally:
        discard(prepared)
    for arm in timed:
        point = by_label[arm.label]
        point.capacity_p50_ms = timings.p50(arm.label)
        per_step = point.capacity if key == "batch_size" else batch
        if isinstance(per_step, int) and not isinstance(per_step, bool) and point.capacity_p50_ms > 0:
            point.samples_per_s = per_step / (point.capacity_p50_ms / 1e3)
