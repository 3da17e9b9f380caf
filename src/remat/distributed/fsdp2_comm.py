"""FSDP2's comm primitives, timed or no-op (NOTE [collective timing] in instrument.py).

Imported only when the engine is FSDP2 (importing FSDP2 costs about 1.5 s per rank).
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` take these.
"""

# No ``from __future__ import annotations``: FSDP2 may inspect the primitives' signatures.
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from .instrument import CommRecorder, _Pending, tensor_bytes


def _stamp_on_done(recorder: CommRecorder, pending: _Pending, _fut: torch.futures.Future) -> None:
    recorder.end(pending)


def _finish(recorder: CommRecorder, pending: _Pending, work: Any) -> Any:
    if work is None:  # synchronous: the call returned after the collective finished
        recorder.end(pending)
    else:
        work.get_future().then(functools.partial(_stamp_on_done, recorder, pending))
    return work


class TimedAllGather(DefaultAllGather):
    """FSDP2's default all-gather, timed."""

    def __init__(self, recorder: CommRecorder) -> None:
        self.recorder = recorder

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Any:
        pending = self.recorder.begin("all_gather", tensor_bytes(output_tensor))
        return _finish(self.recorder, pending, super().__call__(output_tensor, input_tensor, group, async_op))


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, timed."""

    def __init__(self, recorder: CommRecorder) -> None:
        self.recorder = recorder

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        pending = self.recorder.begin("reduce_scatter", tensor_bytes(input_tensor))
        return _finish(self.recorder, pending, super().__call__(output_tensor, input_tensor, group, op, async_op))


class NoopAllGather(DefaultAllGather):
    """The ablation: no communication; the other ranks' slots stay zero (no NaN, same compute)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        return None  # all_gather_copy_in already wrote this rank's slot


class NoopReduceScatter(DefaultReduceScatter):
    """The ablation: no communication; this rank keeps its own (unreduced) chunk."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None
