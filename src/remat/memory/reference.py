"""torch.profiler as an independent reference for the live-tensor tracker.

The profiler's raw ``[memory]`` events (kineto results, one per CPU allocation and free,
``nbytes`` signed) are summed in time order; the peak of that running sum is the peak of
bytes allocated *during* profiling, so callers add what was live before (the tracker's
starting bytes) to compare whole-step peaks.

NOTE [peaks at the edge]
The live-tensor tracker sees tensors made through the dispatcher, the profiler sees allocations:
buffers that never become tensors (oneDNN convolution workspaces) and tensors made outside the
dispatcher (``torch.get_rng_state()``'s 5056 bytes, which ``torch.utils.checkpoint`` keeps per
region with ``preserve_rng_state``) are invisible to the tracker, so it reads low or equal, never
high in any case measured (``benchmarks/tracker_error.py``; figures in benchmarks/RESULTS.md).
The error is a share of a large step and a fixed amount on a small one: the known error is the larger of
:data:`TRACKER_ERROR` of the budget and :data:`TRACKER_ERROR_BYTES` (about twice the largest
workspace seen). A CPU plan whose tracked peak clears its budget by less than that
(:func:`at_the_edge`) is not shipped on the tracker's word: the measurement runs one more step
under torch.profiler and the larger of the two figures is the plan's measured peak
(``remat.measure.measure_arm(confirm_under=)``; its ``memory_source`` says
``cpu-profiler-allocator`` when the profiler read higher). CUDA figures come from the allocator
itself: nothing to confirm.
"""

from __future__ import annotations

import dataclasses
import contextlib
import os
import sys
from typing import TYPE_CHECKING, Callable, Iterator

from torch.profiler import ProfilerActivity, profile

from ..types import MemorySource

if TYPE_CHECKING:
    from ..workload.contract import TrainingStep


TRACKER_ERROR = 0.03               # share of the budget the CPU tracker can read low (NOTE [peaks at the edge])
TRACKER_ERROR_BYTES = 2 * 2 ** 20  # bytes it can read low on a small step (2 MiB: twice the largest workspace seen)


def tracker_error_bytes(budget_bytes: int) -> int:
    """How far under the true peak the CPU tracker can read at ``budget_bytes`` (NOTE [peaks at the edge])."""
    return max(int(budget_bytes * TRACKER_ERROR), TRACKER_ERROR_BYTES)


def at_the_edge(peak_bytes: int, budget_bytes: int, source: MemorySource) -> bool:
    """A CPU live-tensor ``peak_bytes`` that clears ``budget_bytes`` by less than the tracker's known error
    (NOTE [peaks at the edge]): torch.profiler confirms it before it counts as fitting."""
    return (source is MemorySource.CPU_LIVE_TENSORS
            and budget_bytes - tracker_error_bytes(budget_bytes) < peak_bytes <= budget_bytes)


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


def _allocation_events(prof: profile) -> list:
    """The profiler's allocation records (every thread's) in time order: ``extra_fields`` holds
    ``ptr`` and a signed ``alloc_size`` (bytes; negative for a free)."""
    out, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            out.append(node)
    out.sort(key=lambda n: n.start_time_ns)
    return out


def profiler_memory_peak(fn: Callable[[], object]) -> ProfilerPeak:
    """Peak of the bytes allocated less freed while ``fn`` runs, by torch.profiler.

    NOTE [unseen frees]
    The profiler can miss a free made on another thread (gloo's, freeing a collective's buffer;
    benchmarks/RESULTS.md). Two live blocks
    cannot share an address, so an allocation at an address still live here proves the earlier block
    was freed before it: that free is counted then. A free the allocator never reuses stays unseen."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.__enter__()
    try:
        fn()
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)
    events = _allocation_events(prof)
    live: dict[int, int] = {}   # address -> bytes of the block allocated there during fn
    running = peak = 0
    for ev in events:
        ptr, nbytes = ev.extra_fields.ptr, ev.extra_fields.alloc_size
        if nbytes > 0:
            running -= live.pop(ptr, 0)   # an unseen free of the block that held this address
            live[ptr] = nbytes
        else:
            live.pop(ptr, None)
        running += nbytes
        peak = max(peak, running)
    return ProfilerPeak(peak, running, len(events))


def profiler_step_peak(step: "TrainingStep", step_index: int) -> int:
    """Whole-step peak (bytes) of ``step.run(step_index)`` by torch.profiler: the live state
    at its start (parameters, gradients, optimizer state, counted as the tracker counts them)
    plus the peak of the profiler's running sum over the step."""
    from .measure import step_state_bytes
    # registration only: the tracker's dispatch mode is never entered, so this also works on
    # a torch.compile'd model (Dynamo runs frames eagerly under a Python dispatch mode)
    start = step_state_bytes(step)
    return start + profiler_memory_peak(lambda: step.run(step_index)).peak_delta_bytes
