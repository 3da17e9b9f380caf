"""torch.profiler as an independent reference for the live-tensor tracker.

The profiler's raw ``[memory]`` events (kineto results, one per CPU allocation and free,
``nbytes`` signed) are summed in time order; the peak of that running sum is the peak of
bytes allocated *during* profiling, so callers add what was live before (the tracker's
starting bytes) to compare whole-step peaks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch.profiler import ProfilerActivity, profile


@dataclasses.dataclass(frozen=True)
class ProfilerPeak:
    peak_delta_bytes: int  # max over time of (bytes allocated - bytes freed) since start
    end_delta_bytes: int   # the running sum at the end
    events: int            # number of [memory] events seen


def profiler_memory_peak(fn: Callable[[], object]) -> ProfilerPeak:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [ev for ev in prof.profiler.kineto_results.events() if ev.name() == "[memory]"]
    events.sort(key=lambda ev: ev.start_ns())
    running = peak = 0
    for ev in events:
        running += ev.nbytes()
        peak = max(peak, running)
    return ProfilerPeak(peak, running, len(events))
