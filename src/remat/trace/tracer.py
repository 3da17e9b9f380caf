"""``trace_workload``: warm the step, then trace whole steps by phase."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ..clock import StepClock
from ..memory.cuda import read_cuda_stats, reset_cuda_peak
from ..memory.measure import model_device
from ..memory.reference import profiler_step_peak
from ..types import MemCategory, MemorySource, Phase, ProgressFn, Refusal, no_progress
from ..workload.contract import TrainingStep
from ..workload.loader import LoadedWorkload
from .model import ModuleBytes, PhaseStats, StepTrace, TimelinePoint, TraceContext
from .recorder import StepRecorder

TIMELINE_POINTS = 2000  # downsampled live-bytes curve kept in trace.json


def _phase_stats(rec: StepRecorder, step_end_ns: int) -> list[PhaseStats]:
    t = rec.tracker
    marks = t.marks[-len(Phase):]  # the last step's four marks
    out = []
    for i, m in enumerate(marks):
        end_event = marks[i + 1].event if i + 1 < len(marks) else t.events
        end_ns = marks[i + 1].time_ns if i + 1 < len(marks) else step_end_ns
        start_bytes = t.live_after[m.event - 1] if m.event > 0 else 0
        window = t.live_after[m.event:end_event]
        end_bytes = window[-1] if window else start_bytes
        out.append(PhaseStats(name=m.phase, start_bytes=start_bytes, end_bytes=end_bytes,
                              peak_bytes=max(window, default=start_bytes), duration_ms=(end_ns - m.time_ns) / 1e6))
    return out


def _breakdown(rec: StepRecorder, event: int, top: int) -> tuple[dict[MemCategory, int], list[ModuleBytes]]:
    cats: dict[MemCategory, int] = {c: 0 for c in MemCategory}
    mods: dict[str, int] = defaultdict(int)
    for r in rec.tracker.live_at(event):
        cat = r.category
        if r.phase is Phase.BATCH and cat in (MemCategory.OTHER, MemCategory.ACTIVATIONS):
            cat = MemCategory.BATCH
        cats[cat] += r.nbytes
        if cat in (MemCategory.ACTIVATIONS, MemCategory.OTHER):
            mods[r.module or "<outside modules>"] += r.nbytes
    ranked = sorted(mods.items(), key=lambda kv: -kv[1])[:top]
    return cats, [ModuleBytes(module=m, bytes=b) for m, b in ranked]


def _timeline(rec: StepRecorder, start_event: int, start_ns: int) -> list[TimelinePoint]:
    t = rec.tracker
    n = t.events - start_event
    stride = max(1, n // TIMELINE_POINTS)
    pts = []
    for e in range(start_event, t.events, stride):
        pts.append(TimelinePoint(t_ms=(t.times_ns[e] - start_ns) / 1e6, live_bytes=t.live_after[e], phase=t.phase_at(e)))
    return pts


def trace_step(step: TrainingStep, *, context: TraceContext, warmup: int = 2, steps: int = 3,
               top_modules: int = 10, progress: ProgressFn = no_progress) -> StepTrace:
    """Trace ``steps`` whole steps after ``warmup`` untraced ones; figures from the peak step."""
    total = warmup + steps
    for i in range(warmup):
        progress("warm-up", i, total)
        step.run(i)
    device = model_device(step)
    on_cuda = device.type == "cuda"
    clock = StepClock(device)
    best: tuple[int, StepRecorder, int, int, int] | None = None  # (peak, rec, start_event, start_ns, end_ns)
    step_peaks: list[int] = []
    step_ms: list[float] = []
    retries = 0
    for i in range(warmup, total):
        progress("tracing", i, total)
        if on_cuda:
            reset_cuda_peak(device)
        with StepRecorder(step) as rec:
            start_event = rec.tracker.events
            rec.tracker.reset_peak()
            _, start_ns, end_ns = clock.span(rec.run, i)   # NOTE [device-correct timing] in remat/clock.py
        peak = rec.tracker.peak_bytes
        if on_cuda:
            stats = read_cuda_stats(device)
            peak, retries = stats.peak_bytes, max(retries, stats.num_alloc_retries)
        step_peaks.append(peak)
        step_ms.append((end_ns - start_ns) / 1e6)
        if best is None or peak > best[0]:
            best = (peak, rec, start_event, start_ns, end_ns)
    progress("tracing", total, total)
    assert best is not None
    reference = None if on_cuda else profiler_step_peak(step, total)
    peak, rec, start_event, start_ns, end_ns = best
    cats, mods = _breakdown(rec, rec.tracker.peak_event, top_modules)
    return StepTrace(
        context=context,
        memory_source=MemorySource.CUDA_ALLOCATOR if on_cuda else MemorySource.CPU_LIVE_TENSORS,
        peak_bytes=peak,
        peak_phase=rec.tracker.peak_phase,
        phases=_phase_stats(rec, end_ns),
        categories_at_peak=cats,
        top_modules_at_peak=mods,
        step_peaks=step_peaks,
        step_ms=step_ms,
        timeline=_timeline(rec, start_event, start_ns),
        num_alloc_retries=retries,
        reference_peak_bytes=reference,
    )


def trace_workload(loaded: LoadedWorkload, *, warmup: int = 2, steps: int = 3,
                   boundary_shape: dict | None = None, progress: ProgressFn = no_progress) -> StepTrace:
    """Trace ``loaded`` at its shape and, when given, at ``boundary_shape`` (nested as ``.boundary``)."""
    if warmup < 1 or steps < 1:
        from ..errors import WorkloadError
        raise WorkloadError(f"--warmup and --steps must be at least 1 (got {warmup}, {steps}): "
                            "the first step creates optimizer state and is never representative")

    def one(lw: LoadedWorkload) -> StepTrace:
        ctx = TraceContext.capture(workload=lw.spec, shape=lw.shape, dtype=lw.dtype, device=lw.device,
                                   warmup=warmup, steps=steps)
        return trace_step(TrainingStep(lw.workload), context=ctx, warmup=warmup, steps=steps, progress=progress)

    target = one(loaded)
    if boundary_shape:
        target.boundary = one(loaded.rebuild(**boundary_shape))
    return target


def trace_on_device(loaded: LoadedWorkload, capacity_bytes: int, **kw: Any) -> "tuple[StepTrace | None, Refusal | None]":
    """``trace_workload`` with every CPU step under ``capacity_bytes`` (NOTE [CPU device capacity]): the trace,
    or, when the step does not fit, None and the refused allocation (the blocked step's evidence: NOTE
    [blocked step]). On CUDA the capacity is not enforced here: the device's own allocator refuses."""
    from ..memory.capacity import clear_refusal, last_refusal, step_capacity
    clear_refusal()
    try:
        with step_capacity(capacity_bytes if loaded.device == "cpu" else None):
            return trace_workload(loaded, **kw), None
    except torch.OutOfMemoryError:
        refusal = last_refusal()
        if refusal is None:
            raise
        return None, refusal
