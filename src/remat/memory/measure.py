"""One whole-step peak, from whichever instrument the device has."""

from __future__ import annotations

import dataclasses

import torch

from ..types import MemCategory, MemorySource, Phase
from ..workload.contract import TrainingStep
from .allocator import CpuAllocatorWindow, counter_status
from .cuda import read_cuda_stats, reset_cuda_peak
from .tracker import LiveTensorTracker


@dataclasses.dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int
    source: MemorySource
    peak_phase: Phase | None      # None on CUDA: the allocator does not say when
    num_alloc_retries: int = 0    # CUDA only
    loss: float = float("nan")


def model_device(step: TrainingStep) -> torch.device:
    for p in step.workload.model.parameters():
        return p.device
    return torch.device("cpu")


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def track_step_state(tracker: LiveTensorTracker, step: TrainingStep) -> None:
    """Register what is live before a step starts: parameters, buffers, grads, optimizer state."""
    model = step.workload.model
    tracker.track(model.parameters(), MemCategory.PARAMETERS)
    tracker.track(model.buffers(), MemCategory.PARAMETERS)
    tracker.track((p.grad for p in model.parameters()), MemCategory.GRADIENTS)
    tracker.track(optimizer_state_tensors(step.optimizer), MemCategory.OPTIMIZER_STATE)


def cuda_step_peak(step: TrainingStep, step_index: int, device: torch.device) -> PeakMeasurement:
    """Run one step on CUDA and return the allocator's peak for it (bytes)."""
    reset_cuda_peak(device)
    loss = step.run(step_index)
    stats = read_cuda_stats(device)
    return PeakMeasurement(stats.peak_bytes, MemorySource.CUDA_ALLOCATOR, None, stats.num_alloc_retries, loss)


def measure_step_peak(step: TrainingStep, step_index: int) -> PeakMeasurement:
    """Run one step and return its whole-step peak (bytes), CUDA allocator or CPU tracker."""
    device = model_device(step)
    if device.type == "cuda":
        return cuda_step_peak(step, step_index, device)
    if counter_status().available and not _fake(step):
        return _counted_step_peak(step, step_index)
    with LiveTensorTracker(keep_timeline=False) as tracker:
        track_step_state(tracker, step)
        loss = step.run(step_index, marker=tracker.mark)
    return PeakMeasurement(tracker.peak_bytes, MemorySource.CPU_LIVE_TENSORS, tracker.peak_phase, 0, loss)


def _fake(step: TrainingStep) -> bool:
    """A simulated step (remat.simulate: FakeTensorMode): it allocates nothing, so only the live-tensor
    tracker, which counts the bytes its fake tensors would hold, can measure it."""
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(p, FakeTensor) or p.is_meta for p in step.workload.model.parameters())


def peak_costs_nothing(step: TrainingStep) -> bool:
    """Whether measuring ``step``'s peak leaves its time as it is: the CUDA allocator's counters, or
    the CPU allocator counter (NOTE [CPU allocator counter]); not the live-tensor tracker."""
    return model_device(step).type == "cuda" or (counter_status().available and not _fake(step))


def step_state_bytes(step: TrainingStep) -> int:
    """Bytes live before a step starts (parameters, buffers, gradients, optimizer state; each storage
    once), counted as the live-tensor tracker counts them (registration only, no dispatch mode)."""
    state = LiveTensorTracker(keep_timeline=False)
    track_step_state(state, step)
    state.close()
    return state.live_bytes


def _counted_step_peak(step: TrainingStep, step_index: int) -> PeakMeasurement:
    """One CPU step measured by the allocator counter (NOTE [CPU allocator counter]): the state live at
    its start plus the peak of what the step allocates; the phase is the one whose window peaked highest."""
    start = step_state_bytes(step)
    phase_peaks: list[tuple[int, Phase | None]] = []
    current: Phase | None = None
    with CpuAllocatorWindow() as window:
        def mark(phase: Phase) -> None:   # the peak of the phase that ends here, then a new one
            nonlocal current
            phase_peaks.append((window.peak_bytes, current))
            window.reset_peak()
            current = phase
        loss = step.run(step_index, marker=mark)
        phase_peaks.append((window.peak_bytes, current))
    peak, phase = max(phase_peaks, key=lambda p: p[0])   # the first phase of the highest peak
    return PeakMeasurement(start + peak, MemorySource.CPU_ALLOCATOR, phase, 0, loss)
