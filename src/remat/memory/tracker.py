"""CPU live-tensor tracker: every storage counted once, from allocation to its finaliser.

NOTE [live-tensor tracker]
torch has no allocator statistics on CPU, and process RSS says nothing (glibc keeps freed
pages). A ``TorchDispatchMode`` sees every op's outputs, including backward and optimizer
ops; for each output we look at its *storage* (views and in-place results share one, so
each is counted once, keyed by the StorageImpl address) and attach a weakref callback
to the storage's Python object, which torch keeps alive exactly as long as the storage
(PyObject preservation), so the finaliser marks the free. Pre-existing tensors (parameters,
gradients, optimizer state) are registered with :meth:`LiveTensorTracker.track` so that
the live total is the step's whole footprint, not only what the step allocates. A storage
resized in place (``UntypedStorage.resize_``, no op: FSDP2's all-gathered parameters) is told
to the tracker by NOTE [storage resizes] in memory/resize.py.

Every alloc/free is an *event* with a running index; the tracker keeps the live-bytes
curve and a record per storage (bytes, op, module, category, alloc and free event), so
any instant can be reconstructed after the step (breakdown at the peak) without copying
the live set while the step runs. Overhead is one Python call per op plus one finaliser
per new storage; benchmarks/RESULTS.md has the measured cost.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..types import MemCategory, Phase
from .resize import listen_to_resizes, stop_listening


@dataclasses.dataclass(slots=True)
class StorageRecord:
    """One storage's life. Event indices are positions in the tracker's event stream."""

    key: int                  # StorageImpl address (unique while alive)
    nbytes: int               # bytes
    alloc_event: int          # event index of the allocation (-1: existed before tracking)
    op: str                   # the op that produced it ("<existing>" when registered)
    module: str               # innermost module running when it was produced ("" = none)
    phase: Phase | None
    category: MemCategory = MemCategory.OTHER
    free_event: int | None = None  # None: still alive at the end


@dataclasses.dataclass(frozen=True)
class PhaseMark:
    phase: Phase
    event: int        # first event index that belongs to this phase
    time_ns: int


class LiveTensorTracker(TorchDispatchMode):
    """Counts live tensor storage bytes on CPU (works for any device it sees, see NOTE above).

    Use as a context manager around the work to measure::

        with LiveTensorTracker() as t:
            t.track(model.parameters(), MemCategory.PARAMETERS)
            step.run(0, marker=t.mark)
        t.peak_bytes, t.peak_phase
    """

    def __init__(self, *, keep_timeline: bool = True) -> None:
        super().__init__()
        self.keep_timeline = keep_timeline
        self.records: dict[int, StorageRecord] = {}     # alive, by key
        self.history: list[StorageRecord] = []           # every record, alive or freed
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_event = -1
        self.events = 0
        self.times_ns: list[int] = []                    # per event
        self.live_after: list[int] = []                  # per event: live bytes after it
        self.marks: list[PhaseMark] = []
        self.module = ""                                 # set by StepRecorder (trace/profile)
        # Optional per-op callback (func, args, kwargs, out, duration_ns, first event index of the op),
        # for profiling passes only:
        # op timing, device moves, in-place writes. None on the measuring hot path.
        self.op_observer: Callable[[Any, tuple, dict, Any, int, int], None] | None = None
        self._phase: Phase | None = None
        self._closed = False
        self._refs: dict[int, weakref.ref] = {}         # storage key -> weakref whose callback frees it

    # -- registration -------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor | None], category: MemCategory) -> None:
        """Count tensors that exist already; (re)label any already-counted ones as ``category``."""
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            rec = self._see(t, op="<existing>")
            if rec is not None:
                rec.category = category

    def mark(self, phase: Phase) -> None:
        """A ``PhaseMarker``: everything after this call belongs to ``phase``."""
        self._phase = phase
        self.marks.append(PhaseMark(phase, self.events, time.perf_counter_ns()))

    # -- dispatch -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        t0 = time.perf_counter_ns() if self.op_observer is not None else 0
        first_event = self.events
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter_ns() - t0 if self.op_observer is not None else 0
        if isinstance(out, torch.Tensor):
            self._see(out, op=func.__name__)
        elif isinstance(out, (tuple, list)):
            name = func.__name__
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see(o, op=name)
                elif isinstance(o, (tuple, list)):  # e.g. _foreach ops return lists
                    for oo in o:
                        if isinstance(oo, torch.Tensor):
                            self._see(oo, op=name)
        if self.op_observer is not None:  # after _see: the outputs' records exist
            self.op_observer(func, args, kwargs or {}, out, dt, first_event)
        return out

    def _see(self, t: torch.Tensor, op: str) -> StorageRecord | None:
        local = getattr(t, "_local_tensor", None)   # a DTensor: this rank's shard (NOTE [FSDP2 peaks on CPU])
        if isinstance(local, torch.Tensor):
            t = local
        if t.is_meta:
            return None
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, nested, functional wrappers
            return None
        key = storage._cdata
        rec = self.records.get(key)
        nbytes = storage.nbytes()
        if rec is not None:
            if nbytes != rec.nbytes:  # resize_ of an out= tensor: account the change
                self._event(nbytes - rec.nbytes)
                rec.nbytes = nbytes
            return rec
        return self._new_record(storage, nbytes, op)

    def _new_record(self, storage: torch.UntypedStorage, nbytes: int, op: str,
                    category: MemCategory = MemCategory.OTHER) -> StorageRecord:
        key = storage._cdata
        rec = StorageRecord(key=key, nbytes=nbytes, alloc_event=self.events if op != "<existing>" else -1,
                            op=op, module=self.module, phase=self._phase, category=category)
        self.records[key] = rec
        self.history.append(rec)
        if key not in self._refs:   # a resized storage keeps the weakref it had
            # a bare weakref with a callback (cheaper than weakref.finalize, which also registers
            # an atexit hook); dropping the ref in close() cancels the callback
            self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
        self._event(nbytes)
        return rec

    # -- storage resizes (a ResizeListener: NOTE [storage resizes] in memory/resize.py) ------------
    def before_resize(self, storage: torch.UntypedStorage) -> None:
        pass

    def after_resize(self, storage: torch.UntypedStorage) -> None:
        """A storage resized in place (FSDP2's all-gathered parameters): as the allocator does it, a new
        record of the new size (bytes; none when 0), then the old record's free."""
        if self._closed:
            return
        key, nbytes = storage._cdata, storage.nbytes()
        old = self.records.get(key)
        if nbytes == (0 if old is None else old.nbytes):
            return
        if old is not None:
            del self.records[key]
        if nbytes > 0:
            self._new_record(storage, nbytes, "resize_", MemCategory.OTHER if old is None else old.category)
        if old is not None:
            old.free_event = self.events
            self._event(-old.nbytes)
        if nbytes == 0:
            self._refs.pop(key, None)

    def _free(self, key: int, _ref: Any = None) -> None:
        if self._closed:
            return
        self._refs.pop(key, None)
        rec = self.records.pop(key, None)
        if rec is None:
            return
        rec.free_event = self.events
        self._event(-rec.nbytes)

    def _event(self, delta: int) -> None:
        self.live_bytes += delta
        if self.keep_timeline:
            self.times_ns.append(time.perf_counter_ns())
            self.live_after.append(self.live_bytes)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_event = self.events
        self.events += 1

    def __enter__(self) -> "LiveTensorTracker":
        listen_to_resizes(self)
        try:
            return super().__enter__()
        except BaseException:
            stop_listening(self)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            self.close()

    def close(self) -> None:
        """Stop counting and detach every finaliser and the resize listener (the tracker holds no storage alive)."""
        self._closed = True
        self._refs.clear()
        stop_listening(self)

    # -- reading -----------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (like reset_peak_memory_stats)."""
        self.peak_bytes = self.live_bytes
        self.peak_event = self.events - 1

    def live_at(self, event: int) -> Iterator[StorageRecord]:
        """Records alive just after ``event`` (its allocation counted, later frees not)."""
        for rec in self.history:
            if rec.alloc_event <= event and (rec.free_event is None or rec.free_event > event):
                yield rec

    @property
    def phase(self) -> Phase | None:
        """The phase running now (the last ``mark``)."""
        return self._phase

    def phase_at(self, event: int) -> Phase | None:
        phase = None
        for m in self.marks:
            if m.event <= event:
                phase = m.phase
            else:
                break
        return phase

    @property
    def peak_phase(self) -> Phase | None:
        return self.phase_at(self.peak_event)
