"""Chrome/Perfetto trace export: phases as slices, live bytes as a counter track."""

from __future__ import annotations

from typing import Any

from .model import StepTrace


def to_perfetto(trace: StepTrace) -> dict[str, Any]:
    """A Trace Event Format document (ui.perfetto.dev and chrome://tracing open it). Times in us."""
    pid, tid = 1, 1
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"remat step ({trace.context.workload})"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": "training step"}},
    ]
    t0 = 0.0
    for p in trace.phases:
        events.append({"name": p.name.value, "cat": "phase", "ph": "X", "pid": pid, "tid": tid,
                       "ts": t0 * 1e3, "dur": p.duration_ms * 1e3,
                       "args": {"start_bytes": p.start_bytes, "end_bytes": p.end_bytes, "peak_bytes": p.peak_bytes}})
        t0 += p.duration_ms
    for pt in trace.timeline:
        events.append({"name": "live bytes", "ph": "C", "pid": pid, "ts": pt.t_ms * 1e3,
                       "args": {"bytes": pt.live_bytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"memory_source": trace.memory_source.value, "peak_bytes": trace.peak_bytes}}
