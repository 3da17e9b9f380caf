"""Trace results: dataclasses with a JSON form (``to_json``/``from_json``)."""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
from typing import Any

import torch

from .._codec import FloatAsWritten, JsonCodec, json_field
from ..types import MemCategory, MemorySource, Phase

SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostContext:
    """The machine and software a figure came from: remat's one capture of them (trace, frontier and
    receipt contexts are built from it, with the same field names)."""

    torch_version: str
    python_version: str
    platform: str
    hostname: str
    cpu_count: int | None
    threads: int                      # torch intra-op threads

    @classmethod
    def capture(cls) -> "HostContext":
        return cls(torch_version=torch.__version__, python_version=platform.python_version(),
                   platform=platform.platform(), hostname=socket.gethostname(), cpu_count=os.cpu_count(),
                   threads=torch.get_num_threads())


@dataclasses.dataclass(kw_only=True)
class TraceContext:
    """Where and how a figure was produced: enough to reproduce it."""

    workload: str
    shape: dict[str, Any]
    dtype: str
    device: str
    torch_version: str
    python_version: str
    threads: int
    hostname: str
    warmup: int
    steps: int

    @classmethod
    def capture(cls, *, workload: str, shape: dict[str, Any], dtype: str, device: str,
                warmup: int, steps: int) -> "TraceContext":
        host = HostContext.capture()
        return cls(workload=workload, shape=dict(shape), dtype=dtype, device=device,
                   torch_version=host.torch_version, python_version=host.python_version,
                   threads=host.threads, hostname=host.hostname, warmup=warmup, steps=steps)


@dataclasses.dataclass(kw_only=True)
class PhaseStats:
    name: Phase
    start_bytes: int
    end_bytes: int
    peak_bytes: int
    duration_ms: FloatAsWritten


@dataclasses.dataclass(kw_only=True)
class ModuleBytes:
    module: str   # module path that produced the storages ("<outside modules>" for loss/optimizer code)
    bytes: int


@dataclasses.dataclass(kw_only=True)
class TimelinePoint:
    t_ms: float        # since the traced step started
    live_bytes: int
    phase: Phase | None


def timeline_to_json(points: list[TimelinePoint]) -> list[list[Any]]:
    """A timeline as ``[t_ms, live_bytes, phase]`` triples: thousands of points, so no keys."""
    return [[p.t_ms, p.live_bytes, None if p.phase is None else p.phase.value] for p in points]


def timeline_from_json(triples: list[list[Any]]) -> list[TimelinePoint]:
    return [TimelinePoint(t_ms=float(t), live_bytes=int(b), phase=Phase(p) if p else None) for t, b, p in triples]


@dataclasses.dataclass(kw_only=True)
class StepTrace(JsonCodec):
    """One traced shape: whole-step peak, per-phase figures, what is live at the peak."""

    schema_version: int = SCHEMA_VERSION
    context: TraceContext
    memory_source: MemorySource
    peak_bytes: int
    peak_phase: Phase | None
    phases: list[PhaseStats]
    categories_at_peak: dict[MemCategory, int]
    top_modules_at_peak: list[ModuleBytes]
    step_peaks: list[int]            # peak of each traced step (reproducibility)
    step_ms: list[float]             # wall time of each traced step
    num_alloc_retries: int = 0       # CUDA only
    # CPU only: the same step's peak from torch.profiler's [memory] events. It also sees
    # kernel workspaces that never become tensors (oneDNN convolutions), which the
    # live-tensor tracker cannot; the two agree exactly on gpt and mlp.
    reference_peak_bytes: int | None = None
    # the peak step's live bytes, downsampled
    timeline: list[TimelinePoint] = json_field(default_factory=list, encode=timeline_to_json, decode=timeline_from_json)
    boundary: StepTrace | None = None
