"""Trace results: dataclasses with a JSON form (``to_json``/``from_json``)."""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
from typing import Any

import torch

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
    duration_ms: float


@dataclasses.dataclass(kw_only=True)
class ModuleBytes:
    module: str   # module path that produced the storages ("<outside modules>" for loss/optimizer code)
    bytes: int


@dataclasses.dataclass(kw_only=True)
class TimelinePoint:
    t_ms: float        # since the traced step started
    live_bytes: int
    phase: Phase | None


@dataclasses.dataclass(kw_only=True)
class StepTrace:
    """One traced shape: whole-step peak, per-phase figures, what is live at the peak."""

    context: TraceContext
    memory_source: MemorySource
    peak_bytes: int
    peak_phase: Phase | None
    phases: list[PhaseStats]
    categories_at_peak: dict[MemCategory, int]
    top_modules_at_peak: list[ModuleBytes]
    step_peaks: list[int]            # peak of each traced step (reproducibility)
    step_ms: list[float]             # wall time of each traced step
    timeline: list[TimelinePoint]    # the peak step's live bytes, downsampled
    num_alloc_retries: int = 0       # CUDA only
    # CPU only: the same step's peak from torch.profiler's [memory] events. It also sees
    # kernel workspaces that never become tensors (oneDNN convolutions), which the
    # live-tensor tracker cannot; the two agree exactly on gpt and mlp.
    reference_peak_bytes: int | None = None
    boundary: "StepTrace | None" = None
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "context": dataclasses.asdict(self.context),
            "memory_source": self.memory_source.value,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase.value if self.peak_phase else None,
            "phases": [{**dataclasses.asdict(p), "name": p.name.value} for p in self.phases],
            "categories_at_peak": {c.value: b for c, b in self.categories_at_peak.items()},
            "top_modules_at_peak": [dataclasses.asdict(m) for m in self.top_modules_at_peak],
            "step_peaks": list(self.step_peaks),
            "step_ms": list(self.step_ms),
            "num_alloc_retries": self.num_alloc_retries,
            "reference_peak_bytes": self.reference_peak_bytes,
            "timeline": [[p.t_ms, p.live_bytes, p.phase.value if p.phase else None] for p in self.timeline],
            "boundary": self.boundary.to_json() if self.boundary else None,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StepTrace":
        return cls(
            schema_version=int(d["schema_version"]),
            context=TraceContext(**d["context"]),
            memory_source=MemorySource(d["memory_source"]),
            peak_bytes=int(d["peak_bytes"]),
            peak_phase=Phase(d["peak_phase"]) if d.get("peak_phase") else None,
            phases=[PhaseStats(**{**p, "name": Phase(p["name"])}) for p in d["phases"]],
            categories_at_peak={MemCategory(k): int(v) for k, v in d["categories_at_peak"].items()},
            top_modules_at_peak=[ModuleBytes(**m) for m in d["top_modules_at_peak"]],
            step_peaks=[int(x) for x in d["step_peaks"]],
            step_ms=[float(x) for x in d["step_ms"]],
            num_alloc_retries=int(d.get("num_alloc_retries", 0)),
            reference_peak_bytes=None if d.get("reference_peak_bytes") is None else int(d["reference_peak_bytes"]),
            timeline=[TimelinePoint(t_ms=float(t), live_bytes=int(b), phase=Phase(p) if p else None)
                      for t, b, p in d.get("timeline", [])],
            boundary=cls.from_json(d["boundary"]) if d.get("boundary") else None,
        )

