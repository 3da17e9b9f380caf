"""One whole-step peak, from whichever instrument the device has."""

from __future__ import annotations

import dataclasses

import torch

from ..types import MemCategory, MemorySource, Phase
from ..workload.contract import TrainingStep
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


def measure_step_peak(step: TrainingStep, step_index: int) -> PeakMeasurement:
    """Run one step and return its whole-step peak (bytes), CUDA allocator or CPU tracker."""
    device = model_device(step)
    if device.type == "cuda":
        reset_cuda_peak(device)
        loss = step.run(step_index)
        stats = read_cuda_stats(device)
        return PeakMeasurement(stats.peak_bytes, MemorySource.CUDA_ALLOCATOR, None,
                               stats.num_alloc_retries, loss)
    with LiveTensorTracker(keep_timeline=False) as tracker:
        track_step_state(tracker, step)
        loss = step.run(step_index, marker=tracker.mark)
    return PeakMeasurement(tracker.peak_bytes, MemorySource.CPU_LIVE_TENSORS, tracker.peak_phase, 0, loss)
