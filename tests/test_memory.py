"""The CPU live-tensor tracker against a hand count and against torch.profiler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.memory import (LiveTensorTracker, measure_step_peak, profiler_memory_peak, profiler_step_peak,
                          track_step_state)
from remat.types import MemCategory, MemorySource
from remat.workload import TrainingStep, load_workload

from .conftest import TINY

F32 = 4  # bytes


def test_hand_counted_forward_bytes():
    """Live bytes after a forward equal a count by hand of what autograd must keep."""
    B, D_IN, D_H, D_OUT = 8, 64, 128, 16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_H, bias=False), nn.ReLU(), nn.Linear(D_H, D_OUT, bias=False))
    with LiveTensorTracker() as t:
        t.track(model.parameters(), MemCategory.PARAMETERS)
        x = torch.randn(B, D_IN)
        loss = model(x).pow(2).mean()
        live_after_forward = t.live_bytes
        peak_forward = t.peak_bytes
    params = (D_IN * D_H + D_H * D_OUT) * F32
    # kept for backward: x (mm input), relu output (threshold_backward + second mm input),
    # second mm output (pow saves its input); the pre-ReLU h1 and pow's output are freed.
    saved = (B * D_IN + B * D_H + B * D_OUT) * F32
    loss_bytes = 1 * F32
    assert live_after_forward == params + saved + loss_bytes
    # the peak adds the transient pre-ReLU h1 (B*D_H) at the moment relu allocates its output
    assert peak_forward == params + (B * D_IN + 2 * B * D_H) * F32
    del loss


def test_views_and_inplace_counted_once():
    with LiveTensorTracker() as t:
        a = torch.zeros(1000)  # 4000 bytes
        v = a[10:20].view(2, 5)
        v.add_(1)
        a.mul_(2)
        assert t.live_bytes == 4000
        del a, v
        assert t.live_bytes == 0
    assert t.peak_bytes == 4000


def test_existing_tensors_are_live_and_freed():
    p = torch.ones(256)
    with LiveTensorTracker() as t:
        t.track([p], MemCategory.PARAMETERS)
        assert t.live_bytes == 1024
        del p
        assert t.live_bytes == 0


@pytest.mark.parametrize("spec,shape,tol", [
    ("gpt", {**TINY["gpt"], "batch_size": 4, "seq_len": 64}, 0.01),
    ("mlp", TINY["mlp"], 0.01),
    # oneDNN convolutions allocate kernel workspaces that never become tensors: the tracker
    # cannot see them (tracker/profiler = 0.974 at the default cnn shape, 0.88 at the tiny
    # one); trace.json reports the profiler's figure beside the tracker's for this reason.
    ("cnn", {}, 0.03),
])
def test_tracker_agrees_with_profiler(spec, shape, tol):
    step = TrainingStep(load_workload(spec, shape).workload)
    step.run(0)
    step.run(1)
    measured = measure_step_peak(step, 2)
    assert measured.source is MemorySource.CPU_LIVE_TENSORS
    raw = profiler_memory_peak(lambda: step.run(2))
    assert raw.events > 100
    assert raw.end_delta_bytes == 0  # a warm step returns to where it started
    assert measured.peak_bytes == pytest.approx(profiler_step_peak(step, 2), rel=tol)


class _PerTensorTracker(LiveTensorTracker):
    """A deliberately wrong tracker: counts every op output's own bytes (views and in-place
    results included), i.e. no storage de-duplication."""

    def _see(self, t, op):
        known = t.untyped_storage()._cdata in self.records
        rec = super()._see(t, op)
        if known and op != "<existing>":
            self._event(t.numel() * t.element_size())  # a view / in-place result counted again
        return rec


def test_profiler_comparison_rejects_a_tracker_without_storage_dedupe():
    """Negative control: the profiler check must be able to fail."""
    step = TrainingStep(load_workload("gpt", {**TINY["gpt"], "batch_size": 4, "seq_len": 64}).workload)
    step.run(0)
    step.run(1)
    ref = profiler_step_peak(step, 2)
    with _PerTensorTracker(keep_timeline=False) as wrong:
        track_step_state(wrong, step)
        step.run(2)
    assert wrong.peak_bytes > ref * 1.01
