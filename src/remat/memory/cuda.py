"""CUDA allocator statistics: the measured peak on a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..errors import MemoryMeasurementError


@dataclasses.dataclass(frozen=True)
class CudaMemoryStats:
    peak_bytes: int          # torch.cuda.max_memory_allocated since the last reset
    allocated_bytes: int     # torch.cuda.memory_allocated now
    num_alloc_retries: int   # cudaMalloc retries after freeing cached blocks (fragmentation signal)
    num_ooms: int


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise MemoryMeasurementError("CUDA was requested but torch.cuda.is_available() is False",
                                     tip="use --device cpu, or install a CUDA build of torch")


def reset_cuda_peak(device: torch.device | str | None = None) -> None:
    require_cuda()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def read_cuda_stats(device: torch.device | str | None = None) -> CudaMemoryStats:
    require_cuda()
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    return CudaMemoryStats(
        peak_bytes=int(torch.cuda.max_memory_allocated(device)),
        allocated_bytes=int(torch.cuda.memory_allocated(device)),
        num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
        num_ooms=int(stats.get("num_ooms", 0)),
    )


def dump_memory_snapshot(path: Path, fn, *, max_entries: int = 100_000) -> None:  # noqa: ANN001
    """Run ``fn()`` with allocator history recorded and write a memory_viz pickle to ``path``."""
    require_cuda()
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        fn()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
