"""torch.profiler as an independent reference for the live-tensor tracker.

The profiler's raw ``[memory]`` events (kineto results, one per CPU allocation and free,
``nbytes`` signed) are summed in time order; the peak of that running sum is the peak of
bytes allocated *during* profiling, so callers add what was live before (the tracker's
starting bytes) to compare whole-step peaks.
"""

from __future__ import annotations

import dataclasses
import contextlib
import os
import sys
from typing import TYPE_CHECKING, Callable, Iterator

from torch.profiler import ProfilerActivity, profile

if TYPE_CHECKING:
    from ..workload.contract import TrainingStep


@dataclasses.dataclass(frozen=True)
class ProfilerPeak:
    peak_delta_bytes: int  # max over time of (bytes allocated - bytes freed) since start
    end_delta_bytes: int   # the running sum at the end
    events: int            # number of [memory] events seen


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence fd 2 while the profiler starts/stops: its native layer prints 'USDT: ...
    profiler_start/stop' lines there that no Python setting turns off."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiler_memory_peak(fn: Callable[[], object]) -> ProfilerPeak:
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.__enter__()
    try:
        fn()
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)
    events = [ev for ev in prof.profiler.kineto_results.events() if ev.name() == "[memory]"]
    events.sort(key=lambda ev: ev.start_ns())
    running = peak = 0
    for ev in events:
        running += ev.nbytes()
        peak = max(peak, running)
    return ProfilerPeak(peak, running, len(events))


def profiler_step_peak(step: "TrainingStep", step_index: int) -> int:
    """Whole-step peak (bytes) of ``step.run(step_index)`` by torch.profiler: the live state
    at its start (parameters, gradients, optimizer state, counted as the tracker counts them)
    plus the peak of the profiler's running sum over the step."""
    from .measure import track_step_state
    from .tracker import LiveTensorTracker
    # registration only: the tracker's dispatch mode is never entered, so this also works on
    # a torch.compile'd model (Dynamo runs frames eagerly under a Python dispatch mode)
    state = LiveTensorTracker(keep_timeline=False)
    track_step_state(state, step)
    start = state.live_bytes
    state.close()
    return start + profiler_memory_peak(lambda: step.run(step_index)).peak_delta_bytes
