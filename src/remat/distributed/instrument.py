"""Instruments that run inside a rank: collective timing hooks, the compute timer, the tracker.

NOTE [collective timing]
Every collective of the step goes through a hook the engine offers for exactly this:

* DDP: a comm hook (``DistributedDataParallel.register_comm_hook``) that wraps
  ``default_hooks.allreduce_hook``: the start is stamped when DDP hands over a ready
  bucket, the end in a ``fut.then(...)`` callback, which runs when the all-reduce future
  completes (on gloo this agrees with the profiler's ``gloo:all_reduce`` events).
* FSDP2 (fsdp2_comm.py, imported only for FSDP2): ``FSDPModule.set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` with subclasses of FSDP2's own ``DefaultAllGather`` / ``DefaultReduceScatter``: the start is
  stamped at the call, the end when a synchronous call returns or, for an async one, in a
  callback on ``work.get_future()``. FSDP2 issues the reduce-scatter synchronously on CPU.

Bytes are computed from the op type and the tensor sizes, never from what the backend did
(gloo runs FSDP2's reduce-scatter as a full all-reduce): per call, the payload of one rank,
``all_reduce``: the tensor's bytes; ``all_gather``: the gathered output's bytes
(world size x input); ``reduce_scatter``: the input's bytes (world size x output).

The ablation replaces the hooks by no-ops (same compute, no communication): DDP's hook
returns the local bucket unreduced; FSDP2's all-gather leaves the other ranks' slots of a
zero-filled buffer as they are, and its reduce-scatter copies this rank's own chunk. The
numbers it trains on are wrong by design; only its step time is reported.

On NCCL the hooks still count collectives and bytes, but a callback stamp is not the time
the kernel finished; those times would come from the profiler's kernel trace, which this
package does not read yet, so exposed communication is reported as null on CUDA.
"""

# No ``from __future__ import annotations`` here: DDP compares the comm hooks' annotations
# with the real types (dist.GradBucket, torch.futures.Future[torch.Tensor]).
import dataclasses
import functools
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory.tracker import LiveTensorTracker, StorageRecord

@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveEvent:
    """One collective call on one rank. ``step`` is the recorder's step when it started."""

    op: str          # "all_reduce", "all_gather", "reduce_scatter"
    nbytes: int      # payload bytes, NOTE [collective timing]
    start_ns: int    # time.perf_counter_ns
    end_ns: int
    step: int


@dataclasses.dataclass(slots=True)
class _Pending:
    op: str
    nbytes: int
    start_ns: int
    step: int


class CommRecorder:
    """Collects :class:`CollectiveEvent` s; hooks call :meth:`begin` and :meth:`end`.

    ``end`` may run on a backend thread (future callbacks), hence the lock.
    """

    def __init__(self) -> None:
        self.step = -1
        self.events: list[CollectiveEvent] = []
        self.last: _Pending | None = None   # the collective this rank started last (a timeout names it)
        self._lock = threading.Lock()

    def begin(self, op: str, nbytes: int) -> _Pending:
        self.last = _Pending(op, nbytes, time.perf_counter_ns(), self.step)
        return self.last

    def end(self, pending: _Pending) -> None:
        ev = CollectiveEvent(pending.op, pending.nbytes, pending.start_ns, time.perf_counter_ns(), pending.step)
        with self._lock:
            self.events.append(ev)

    def of_step(self, step: int) -> list[CollectiveEvent]:
        with self._lock:
            return [e for e in self.events if e.step == step]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- DDP ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class DDPHookState:
    """State of :func:`timed_allreduce_hook`: where to record, which group to reduce over."""

    recorder: CommRecorder
    process_group: dist.ProcessGroup | None = None


def timed_allreduce_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (average), timed: NOTE [collective timing]."""
    pending = state.recorder.begin("all_reduce", tensor_bytes(bucket.buffer()))
    fut = default_hooks.allreduce_hook(state.process_group, bucket)
    return fut.then(functools.partial(_stamp_and_pass, state.recorder, pending))


def _stamp_and_pass(recorder: CommRecorder, pending: _Pending, fut: torch.futures.Future) -> Any:
    recorder.end(pending)
    return fut.value()


def noop_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The ablation: no communication, the local (unreduced) bucket goes back to DDP."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# -- compute intervals ---------------------------------------------------------------------------

NOT_COMPUTE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "profiler"})


class ComputeTimer(TorchDispatchMode):
    """Records (start_ns, end_ns) of every operator this thread dispatches, collectives excluded.

    The compute side of NOTE [exposed communication]. Only ops are compute: a rank blocked
    in ``Work.wait()`` or in DDP's end-of-backward wait runs no op, so that time is not
    covered. Its own overhead (one Python call per op) lengthens the step; it is only
    turned on for the ``comm_steps`` that measure overlap, never for timed steps.
    """

    def __init__(self) -> None:
        super().__init__()
        self.intervals: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.namespace in NOT_COMPUTE_NAMESPACES:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter_ns()
        out = func(*args, **(kwargs or {}))
        self.intervals.append((t0, time.perf_counter_ns()))
        return out


# -- memory ------------------------------------------------------------------------------------

class ShardAwareTracker(LiveTensorTracker):
    """The CPU live-tensor tracker, counting a DTensor by its local shard.

    NOTE [FSDP2 peaks on CPU]
    A DTensor is a wrapper: asking it for its storage answers with the *global* size, so the
    plain tracker would count every sharded parameter, gradient and optimizer state world
    size times over. Here each DTensor is counted as its ``_local_tensor``. Ops the DTensor
    layer runs internally (for instance temporaries of the optimizer's foreach ops on
    sharded parameters) are below the dispatch mode and not seen; forward and backward run
    on plain (unsharded) tensors and are counted in full.
    """

    def _see(self, t: torch.Tensor, op: str) -> StorageRecord | None:
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            t = local
        return super()._see(t, op)
