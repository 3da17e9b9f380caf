"""The blocked step, unlocked and shown: the unplanned step refused on a stated CPU capacity, the plan
``remat.auto`` makes for it, and the user's own steps with that plan under the same capacity.

``remat demo`` ends with it (NOTE [blocked step]); benchmarks/blocked.py measures the same on three models.
"""

from __future__ import annotations

import copy
import dataclasses
import torch

from ..memory.capacity import CpuCapacity, clear_refusal, last_refusal, step_capacity
from ..types import Refusal
from ..types import ProgressFn, no_progress
from ..workload import LoadedWorkload, TrainingStep, Workload
from .report import AutoReport
from .run import auto


@dataclasses.dataclass(frozen=True)
class Unlock:
    """What unlocking a blocked step showed (bytes)."""

    capacity_bytes: int
    control_refusal: Refusal | None   # the unplanned step on a copy, under the capacity (None: it fitted)
    report: AutoReport                 # remat.auto's, planned for the capacity and verified (quick)
    step_peaks: tuple[int, ...]        # the user's planned steps after it, each enforced and counted by the capacity


def unlock(loaded: LoadedWorkload, capacity_bytes: int, *, steps: int = 3,
           progress: ProgressFn = no_progress) -> Unlock:
    """Run ``loaded``'s step unplanned on a copy under ``capacity_bytes`` (the evidence that it is blocked),
    then ``remat.auto(device_memory=capacity_bytes, verify="quick")`` on its model, then ``steps`` training
    steps of that model with the plan, each under the capacity."""
    wl = loaded.workload
    batch = wl.batch(0)
    control = TrainingStep(Workload(model=copy.deepcopy(wl.model), batch=lambda i: batch, loss=wl.loss,
                                    optimizer=wl.optimizer))
    refusal: Refusal | None = None
    progress("unlock: the unplanned step under the capacity", 0, 1)
    clear_refusal()
    try:
        with step_capacity(capacity_bytes):
            for i in range(2):   # the second step holds the optimizer state
                control.run(i)
    except torch.OutOfMemoryError:
        refusal = last_refusal()
    del control
    optimizer = wl.make_optimizer()
    handle = auto(wl.model, batch, loss_fn=wl.loss, optimizer=optimizer, device_memory=capacity_bytes,
                  verify="quick", use_cache=False, progress=progress)
    planned = TrainingStep(Workload(model=wl.model, batch=lambda i: batch, loss=wl.loss, optimizer=wl.optimizer))
    planned.optimizer = optimizer
    peaks = []
    for i in range(steps):
        with CpuCapacity(capacity_bytes, wl.model, optimizer) as step_cap:
            planned.run(i)
        peaks.append(step_cap.peak_bytes)
    return Unlock(capacity_bytes=capacity_bytes, control_refusal=refusal, report=handle.report,
                  step_peaks=tuple(peaks))


def describe(u: Unlock) -> list[str]:
    """A few lines for a terminal or a log."""
    from ..profile.model import describe_refusal
    from ..units import fmt_bytes
    r = u.report
    lines = [f"unplanned on a device of {fmt_bytes(u.capacity_bytes)}: "
             + (f"refused, {describe_refusal(u.control_refusal)}" if u.control_refusal is not None else "it fits")]
    if r.blocked is not None:
        lines.append(f"remat.auto: {r.blocked.describe()}")
    lines.append(f"plan: {len(r.boundaries)} boundaries ({', '.join(r.boundaries) or 'none'}); measured "
                 f"{fmt_bytes(r.measured_peak_bytes or 0)} at the target; {r.verify_note}")
    lines.append(f"your steps with the plan, under the capacity: {', '.join(fmt_bytes(p) for p in u.step_peaks)}")
    return lines
