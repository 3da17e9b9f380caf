"""``simulate_workload``: the phase trace and the predicted step time of a step that never runs.

The memory side is ``remat.trace.trace_step`` itself, run on a fake step (NOTE [simulated
step]): same recorder, same phase and category accounting, ``memory_source: simulated``.
The time side is one more fake step under :class:`~remat.simulate.costs.OpCostRecorder`,
priced by the device model (NOTE [roofline runtime model]). The trace's wall-clock fields
are replaced by predictions: ``phases[].duration_ms`` and ``step_ms`` are the device model's,
and the timeline's time axis is rescaled phase by phase onto the predicted durations (within
a phase, points keep the spacing the fake run gave them). ``reference_peak_bytes`` (the
torch.profiler cross-check of a real CPU trace) does not apply and is ``None``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from torch._subclasses import fake_tensor as _ft

from .._codec import JsonCodec, json_field
from ..trace.model import StepTrace, TimelinePoint, TraceContext
from ..trace.tracer import trace_step
from ..types import MemorySource, Phase, ProgressFn, no_progress
from ..workload.contract import TrainingStep
from ..workload.loader import LoadedWorkload, ShapeValue
from .build import SimulatedWorkload, load_simulated
from .costs import OpCostRecorder
from .devices import DeviceModel
from .errors import SimulationError
from .runtime import RuntimePrediction, predict_runtime

# What fake mode raises for steps it cannot run without values (all are plain Python errors
# raised in forward/optimizer code; see docs/TORCH-NOTES.md on errors raised during backward).
_FAKE_ERRORS = tuple(e for e in (getattr(_ft, n, None) for n in (
    "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
    "UnsupportedFakeTensorException")) if isinstance(e, type))


@dataclasses.dataclass(kw_only=True)
class Simulation(JsonCodec):
    """A simulated trace with its runtime prediction, for one shape (and its boundary shape). Its JSON holds
    the simulation-only figures (``trace.json`` holds the trace itself), some computed from the trace and
    the device model (written after ``device_model``; never read back)."""

    device_model: DeviceModel = json_field(then=("memory_source", "predicted_peak_bytes", "predicted_peak_phase",
                                                 ("fits_device_memory", "fits")))
    runtime: RuntimePrediction
    scalar_placeholders: int              # .item() calls answered with a placeholder, per simulated run
    wall_s: float = json_field(key="simulation_wall_s")   # how long the simulation took on this machine (s)
    boundary: Simulation | None = None
    trace: StepTrace = json_field(skip=True)   # memory_source SIMULATED; times are predictions

    @property
    def fits(self) -> bool:
        """Whether the predicted whole-step peak fits the device's memory (no headroom kept)."""
        return self.trace.peak_bytes <= self.device_model.memory_bytes

    @property
    def memory_source(self) -> MemorySource:
        return self.trace.memory_source

    @property
    def predicted_peak_bytes(self) -> int:
        return self.trace.peak_bytes

    @property
    def predicted_peak_phase(self) -> Phase | None:
        return self.trace.peak_phase


def estimate_step_runtime(step: TrainingStep, device: DeviceModel, step_index: int) -> RuntimePrediction:
    """Run one step under :class:`OpCostRecorder` and price it on ``device``.

    Call it inside ``SimulatedWorkload.session()`` (nothing is computed), after the warm-up
    steps; on a real step it works too, but then it really runs the step.
    """
    with OpCostRecorder(step.workload.model) as costs:
        step.run(step_index, marker=costs.marker)
    return predict_runtime(costs.ops, device)


def _rescale_timeline(trace: StepTrace, predicted: dict[Phase, float]) -> list[TimelinePoint]:
    wall_start: dict[Phase, float] = {}
    pred_start: dict[Phase, float] = {}
    w = p = 0.0
    for ph in trace.phases:
        wall_start[ph.name], pred_start[ph.name] = w, p
        w += ph.duration_ms
        p += predicted.get(ph.name, 0.0)
    wall_dur = {ph.name: ph.duration_ms for ph in trace.phases}
    out = []
    for pt in trace.timeline:
        if pt.phase is None or pt.phase not in wall_start:
            out.append(TimelinePoint(t_ms=0.0, live_bytes=pt.live_bytes, phase=pt.phase))
            continue
        frac = (pt.t_ms - wall_start[pt.phase]) / wall_dur[pt.phase] if wall_dur[pt.phase] > 0 else 0.0
        t = pred_start[pt.phase] + min(max(frac, 0.0), 1.0) * predicted.get(pt.phase, 0.0)
        out.append(TimelinePoint(t_ms=t, live_bytes=pt.live_bytes, phase=pt.phase))
    return out


def _simulate_one(sim: SimulatedWorkload, *, warmup: int, steps: int, progress: ProgressFn) -> Simulation:
    t0 = time.perf_counter()
    lw = sim.loaded
    ctx = TraceContext.capture(workload=lw.spec, shape=lw.shape, dtype=lw.dtype, device=lw.device,
                               warmup=warmup, steps=steps)
    step = sim.training_step()
    before = sim.dispatch.placeholders
    try:
        with sim.session():
            trace = trace_step(step, context=ctx, warmup=warmup, steps=steps, progress=progress)
            runtime = estimate_step_runtime(step, sim.device_model, warmup + steps + 1)
    except _FAKE_ERRORS as exc:
        raise SimulationError(
            f"workload {lw.spec!r} cannot be simulated: {type(exc).__name__}: {exc}",
            tip="the step needs a tensor's value (data-dependent shape or unsupported op); "
                "trace it for real on a smaller shape instead") from exc
    trace.memory_source = MemorySource.SIMULATED
    trace.reference_peak_bytes = None
    trace.timeline = _rescale_timeline(trace, runtime.phase_ms)
    for ph in trace.phases:
        ph.duration_ms = runtime.phase_ms.get(ph.name, 0.0)
    trace.step_ms = [runtime.step_ms for _ in trace.step_ms]
    return Simulation(trace=trace, runtime=runtime, device_model=sim.device_model,
                      scalar_placeholders=sim.dispatch.placeholders - before, wall_s=time.perf_counter() - t0)


def simulate_workload(workload: str | LoadedWorkload | SimulatedWorkload, shape: dict[str, ShapeValue] | None = None, *,
                      dtype: str = "float32", target_device: str | DeviceModel = "cpu", warmup: int = 2,
                      steps: int = 1, boundary_shape: dict[str, ShapeValue] | None = None,
                      progress: ProgressFn = no_progress) -> Simulation:
    """Simulate ``workload`` at ``shape`` for ``target_device``, allocating nothing (NOTE [simulated step]).

    ``workload`` is a spec (``gpt``, ``file.py:fn``, ``pkg.mod:fn``), a LoadedWorkload (rebuilt
    from its spec on meta: its real model is not used), or a SimulatedWorkload. ``warmup`` steps
    create the optimizer state (>= 1); fake steps are deterministic, so one traced step suffices.
    """
    if warmup < 1 or steps < 1:
        raise SimulationError(f"warmup and steps must be at least 1 (got {warmup}, {steps}): "
                              "the first step creates optimizer state and is never representative")
    sim = workload if isinstance(workload, SimulatedWorkload) else load_simulated(
        workload, shape, dtype=dtype, target_device=target_device)
    out = _simulate_one(sim, warmup=warmup, steps=steps, progress=progress)
    if boundary_shape:
        out.boundary = _simulate_one(sim.rebuild(**boundary_shape), warmup=warmup, steps=steps, progress=progress)
        out.trace.boundary = out.boundary.trace
    return out


def simulate_trace(workload: str | LoadedWorkload | SimulatedWorkload, shape: dict[str, ShapeValue] | None = None,
                   **kwargs: Any) -> StepTrace:
    """:func:`simulate_workload` and keep only the StepTrace (a drop-in for ``trace_workload``)."""
    return simulate_workload(workload, shape, **kwargs).trace
