"""Storage resizes, which neither the CPU allocator counter nor the live-tensor tracker sees by itself.

NOTE [storage resizes]
FSDP2 keeps each parameter's all-gathered (unsharded) storage as one long-lived ``UntypedStorage``
and frees and re-allocates its bytes in place: ``free_storage`` is ``storage.resize_(0)`` after
forward and backward, ``alloc_storage`` is ``storage.resize_(numel * itemsize)`` before each
all-gather (``torch.distributed.fsdp._fully_shard._fsdp_param``). On CPU that resize is
``resize_bytes_cpu``: a new buffer from the storage's *own* allocator (``StorageImpl::allocator()``,
fixed when the storage was made), then the old buffer's free. No operator runs, so no dispatch
mode sees it, and the allocator is whichever one was current when FSDP2 made the storage, at its
first all-gather:

- the CPU allocator counter (NOTE [CPU allocator counter] in memory/allocator.py) is installed at
  the first CPU measurement. A job that ran a step before that (``remat.auto``'s profile traces the
  step with the tracker first; a user calls it mid-training) has every all-gather storage on the
  wrapped allocator, and its resizes go around the counter: it reads low by the unsharded
  parameters FSDP2 keeps from forward into backward, and a plan can then "fit" and run over its
  budget (figures in benchmarks/RESULTS.md, "FSDP2 peaks").
- the live-tensor tracker sees a storage when an op outputs a view of it (the ``t()`` of a
  weight) and never sees ``resize_(0)``, so it counts every block's unsharded parameters as
  live to the end, and reads high.

So while either instrument measures, ``torch.UntypedStorage.resize_`` (the Python method
``alloc_storage`` and ``free_storage`` call; torch's own ``torch.distributed._tools.MemTracker``
patches the same one for the same reason) is replaced by :func:`_observed_resize`, which tells each
registered :class:`ResizeListener` before and after the resize: the counter points the storage at
itself before it allocates (``adopt`` in ``csrc/cpu_alloc_counter.cpp``), so the new buffer is
counted like any other allocation in the window; the tracker books the new size as a new record
and frees the old one, as the allocator does. The replacement is process-wide (like the counter)
and removed when the last listener leaves. The profiler is not exact either on small FSDP2
steps: its running sum can end whole all-gather buffers above the counter's live bytes (read as
the buffer's free happening on gloo's thread: the profiler records the thread it runs on; the
counter, any thread), so compare the two on large steps or on the same step.
A ``Tensor.resize_`` (an operator, seen by the tracker) of a storage made before the counter was
installed still goes around the counter; FSDP2 does not do that.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class ResizeListener(Protocol):
    """Told about every ``torch.UntypedStorage.resize_`` while it is registered."""

    def before_resize(self, storage: torch.UntypedStorage) -> None: ...

    def after_resize(self, storage: torch.UntypedStorage) -> None: ...


_listeners: list[ResizeListener] = []
_lock = threading.Lock()
_own: list[object] = []   # while installed: UntypedStorage's own resize_ before it (someone's patch), if any


def _wrapped_resize() -> object:
    """The resize_ :func:`_observed_resize` calls: an earlier patch's, else torch's C method."""
    return _own[0] if _own else torch._C.StorageBase.resize_


def _observed_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """``torch.UntypedStorage.resize_`` while anything listens (NOTE [storage resizes])."""
    listeners = tuple(_listeners)
    for listener in listeners:
        listener.before_resize(storage)
    out = _wrapped_resize()(storage, size)
    for listener in listeners:
        listener.after_resize(storage)
    return out


def listen_to_resizes(listener: ResizeListener) -> None:
    """Register ``listener``; the first one installs :func:`_observed_resize`."""
    with _lock:
        if not _listeners:
            own = torch.UntypedStorage.__dict__.get("resize_")
            _own[:] = [] if own is None else [own]
            torch.UntypedStorage.resize_ = _observed_resize   # type: ignore[method-assign]
        _listeners.append(listener)


def stop_listening(listener: ResizeListener) -> None:
    """Unregister ``listener`` (nothing if it is not registered); the last one puts back what was there,
    unless someone patched ``resize_`` over it meanwhile (their restore puts :func:`_observed_resize`
    back, which then tells no one)."""
    with _lock:
        if not any(l is listener for l in _listeners):
            return
        _listeners[:] = [l for l in _listeners if l is not listener]
        if _listeners or torch.UntypedStorage.__dict__.get("resize_") is not _observed_resize:
            return
        if _own:
            torch.UntypedStorage.resize_ = _own.pop()   # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_


def resize_listeners() -> tuple[ResizeListener, ...]:
    """What is registered now (empty: ``torch.UntypedStorage.resize_`` is torch's own)."""
    return tuple(_listeners)
