"""Device-correct step timing, and the one percentile definition remat reports.

A leaf module (torch only), so that trace and the measurement stage share one clock.

NOTE [device-correct timing]
CUDA kernels run asynchronously: a host clock read right after a launch measures the launch,
not the kernel. So on CUDA every host clock read around a step is preceded by
``torch.cuda.synchronize(device)`` (the step's queued work finished before the first read,
the step's own work before the second), and a region timed *inside* a step (a module's
forward, read from hooks) is timed with a pair of ``torch.cuda.Event(enable_timing=True)``
recorded on the current stream, read after the step synchronises: syncing inside hooks
would serialise the step it measures. On CPU ``time.perf_counter_ns`` is exact enough and
needs neither. Every figure is milliseconds.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from .percentile import p50, p95, percentile  # noqa: F401  the one definition (NOTE [device-correct timing])


def p50_along(a: "np.ndarray", axis: int = -1) -> "np.ndarray":
    """:func:`percentile` at 50 along ``axis`` of an array (vectorised, for resampling: the
    bootstrap of NOTE [resolved differences] in remat.frontier.pareto). The same definition."""
    s = np.sort(np.asarray(a, dtype=np.float64), axis=axis)
    n = s.shape[axis]
    if n == 0:
        raise ValueError("percentile of no samples")
    pos = (n - 1) * 0.5
    lo, hi = int(pos), min(int(pos) + 1, n - 1)
    return np.take(s, lo, axis=axis) + (np.take(s, hi, axis=axis) - np.take(s, lo, axis=axis)) * (pos - lo)




class StepClock:
    """Wall time of one call on ``device`` (NOTE [device-correct timing]), in ms."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def span(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, int, int]:
        """``(fn(*args), start_ns, end_ns)`` on the host's perf_counter_ns clock, device idle at both reads
        (the trace's timeline needs the instants, not only the duration)."""
        self.sync()
        t0 = time.perf_counter_ns()
        out = fn(*args)
        self.sync()
        return out, t0, time.perf_counter_ns()

    def time(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``(fn(*args), ms)``: the device idle before the first clock read and after ``fn``."""
        self.sync()
        t0 = time.perf_counter_ns()
        out = fn(*args)
        self.sync()
        return out, (time.perf_counter_ns() - t0) / 1e6

    def resolution_ms(self, reads: int = 21) -> float:
        """The smallest duration this clock resolves (ms): the median of ``reads`` timings of an
        empty call (the reads' own cost, and on CUDA the synchronisations), never below the host
        clock's tick. A measured difference below it is not resolved (NOTE [measured replay costs]
        in remat/profile/replay.py)."""
        tick_ms = time.get_clock_info("perf_counter").resolution * 1e3
        return max(tick_ms, percentile((self.time(_nothing)[1] for _ in range(reads)), 50.0))


def _nothing() -> None:
    return None


class RegionTimer:
    """Times regions that start and end inside a step (module forwards, from hooks), in ms.

    ``start(key)``/``stop(key)`` may be called from hooks; on CUDA they record events and
    never synchronise, and :meth:`collect` (after the step) synchronises once and reads them
    (NOTE [device-correct timing]). Samples accumulate per key across steps.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._open: dict[Any, Any] = {}
        self._pending: list[tuple[Any, Any, Any]] = []   # (key, start event, end event), CUDA
        self.samples: dict[Any, list[float]] = {}

    def start(self, key: Any) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[key] = ev
        else:
            self._open[key] = time.perf_counter_ns()

    def stop(self, key: Any) -> None:
        begun = self._open.pop(key, None)
        if begun is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((key, begun, end))
        else:
            self.samples.setdefault(key, []).append((time.perf_counter_ns() - begun) / 1e6)

    def collect(self) -> None:
        """Read the CUDA events recorded so far (one synchronise); a no-op on CPU."""
        if not self._pending:
            return
        torch.cuda.synchronize(self.device)
        for key, a, b in self._pending:
            self.samples.setdefault(key, []).append(float(a.elapsed_time(b)))
        self._pending.clear()
