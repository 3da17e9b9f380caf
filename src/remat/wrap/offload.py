"""``OffloadWrapper``: a planned module whose saved activations wait in host memory until backward.

NOTE [activation offload]
A boundary in mode OFFLOAD recomputes nothing. Its forward runs under
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves inside the region
is *packed* into host memory and *unpacked* (brought back to the device) when the backward
that needs it runs. What stays on the device between the two is nothing but the packed
handle, so the device saves what a FULL checkpoint saves (the region's activations) without
a replay, and therefore with none of the replay hazards: a hook, a global, a BatchNorm's
running statistics or a Python RNG draw runs exactly once, as in the unplanned step.
- What is not packed: tensors sharing a storage with a parameter or buffer of the region
  (weights and their views, e.g. ``weight.t()`` saved by ``addmm``: they stay resident
  anyway, so copying them would cost bandwidth and host memory for no device byte), and
  tensors under ``_MIN_PACK_BYTES`` (their copy costs more than they free).
- CUDA: the device-to-host copy runs on one side stream per device into pinned host memory
  after that stream waits on the compute stream (an event, never ``synchronize``);
  ``record_stream`` keeps the caching allocator from reusing the source before the copy is
  done. When backward reaches the region's output (a hook on its gradient), every packed
  tensor of the region starts its host-to-device copy on the side stream, so the copies run
  ahead of the region's backward ops; ``unpack`` makes the compute stream wait on the copy's
  event and hands the tensor over (``record_stream`` on the compute stream). A tensor
  unpacked before its prefetch started (a region whose output needs no gradient) is copied
  there and then.
- CPU: the device *is* host memory, so the mechanism is simulated exactly: the host copy is the
  tensor's bytes in a numpy array (a uint8 view copied out with every dispatch mode popped), an
  allocation neither the live-tensor tracker nor torch.profiler's allocator events see, so no
  instrument counts it as device memory (the profiler confirms CPU peaks at the edge of a
  budget: NOTE [peaks at the edge]); the :class:`HostPool` counts it instead (bytes held and
  their peak). ``unpack`` clones it back into a tensor under the tracker, so the device bytes of
  the backward are counted where the real device would hold them. Values are copied, never
  recomputed: the planned step is bitwise the unplanned one, which ``verify`` proves.
- Retained graphs: a packed tensor may be unpacked more than once (``retain_graph=True``);
  the host copy lives as long as autograd keeps the packed handle, so every unpack finds it.
- Host buffers come from a reused pool (NOTE [host buffer pool]), never one allocation per
  saved tensor per step.
Not under ``torch.compile``: a compiled graph saves what AOTAutograd partitions, which these
hooks never see; ``apply`` refuses an offload boundary in a compiled plan.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from .._lazy import LazyModule
from ..types import CheckpointMode
from .wrapper import CheckpointWrapper, SegmentWrapper, _tracing

np = LazyModule("numpy")

_MIN_PACK_BYTES = 1024   # smaller saved tensors stay on the device (bytes)


class HostBuffer:
    """One host buffer of the pool: ``nbytes`` bytes (CUDA: a pinned uint8 tensor; CPU: a numpy uint8
    array) and the CUDA event after which nothing reads it any more (None: never read on a stream)."""

    __slots__ = ("data", "nbytes", "pinned", "read_done")

    def __init__(self, data: Any, nbytes: int, pinned: bool) -> None:
        self.data, self.nbytes, self.pinned = data, nbytes, pinned
        self.read_done: Any = None


class HostPool:
    """Host memory of the offloaded activations: buffers reused across steps (NOTE [host buffer pool]),
    the bytes they hold now and at peak since the last reset (bytes).

    NOTE [host buffer pool]
    An offloaded step copies the same saved tensors to the host every step: the same sizes, in the
    same order. Allocating a host buffer per saved tensor per step costs, on CUDA, a pinned
    allocation (``cudaHostAlloc`` when torch's pinned cache misses, and that cache's own events and
    locks when it hits) and, on the CPU, fresh pages the kernel must fault in and zero on first
    touch. So buffers come from this pool, keyed by their exact size in bytes (one saved tensor's
    ``numel * element_size``; a dtype and shape are a view of it): ``take`` hands a free buffer of
    that size back when there is one and allocates otherwise; a buffer returns to the pool when
    autograd frees the packed handle that holds it (after its backward). From the second step of a
    loop with fixed shapes on, no host buffer is allocated at all (``allocations`` stops growing;
    ``reuses`` counts the hits).
    - Bounded: the bytes held plus the bytes kept free never exceed ``high_water_bytes``, the most
      ever held at once, so the pool costs no host memory beyond the unpooled offload's own peak
      (which the host budget bounds: NOTE [offload cost model] in remat/plan/offload.py). When a
      step needs a size the pool lacks (a new shape), free buffers of other sizes are dropped first.
    - CUDA: a buffer is pinned (page-locked) host memory; before its next device -> host copy
      the side stream waits on ``read_done``, the event recorded after the last host -> device copy
      that read it, so a reused buffer is never overwritten while a copy still reads it.
    - CPU-only torch (no pinned memory): the buffers are numpy arrays, reused the same way.
    ``clear()`` drops every free buffer (``ApplyHandle.remove`` calls it); ``reuse=False`` drops
    each buffer when it is given back: one allocation per saved tensor, the unpooled behaviour the
    benchmark compares against (``benchmarks/offload_pool.py``).
    """

    def __init__(self, *, reuse: bool = True) -> None:
        self.reuse = reuse
        self.held_bytes = 0          # in buffers that hold a packed activation now
        self.peak_bytes = 0          # the most held since reset_peak()
        self.high_water_bytes = 0    # the most ever held at once: held + free stays under it
        self.free_bytes = 0          # in free buffers kept for reuse
        self.copies_out = 0          # device -> host copies made (count)
        self.copies_in = 0           # host -> device copies made (count)
        self.allocations = 0         # host buffers allocated (count)
        self.reuses = 0              # buffers handed out again from the pool (count)
        self._free: dict[tuple[bool, int], list[HostBuffer]] = {}
        # a packed handle may be freed on autograd's device thread, or by the cycle collector inside a locked
        # section of this thread (re-entrant)
        self._lock = threading.RLock()

    def take(self, nbytes: int, *, pinned: bool) -> HostBuffer:
        """A buffer of exactly ``nbytes``: a free one of that size, else a new one; counted as held."""
        with self._lock:
            free = self._free.get((pinned, nbytes))
            buf = free.pop() if free else None
            if buf is not None:
                self.free_bytes -= nbytes
                self.reuses += 1
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self.high_water_bytes = max(self.high_water_bytes, self.held_bytes)
            self.copies_out += 1
            self._trim()
        if buf is None:
            buf = HostBuffer(_allocate(nbytes, pinned), nbytes, pinned)
            with self._lock:
                self.allocations += 1
        return buf

    def give_back(self, buf: HostBuffer) -> None:
        """``buf`` no longer holds an activation: kept for reuse (within the bound), else dropped."""
        with self._lock:
            self.held_bytes -= buf.nbytes
            if self.reuse:
                self._free.setdefault((buf.pinned, buf.nbytes), []).append(buf)
                self.free_bytes += buf.nbytes
                self._trim()

    def _trim(self) -> None:
        """Drop free buffers, the largest first, until held + free fits the high-water mark (lock held)."""
        while self.free_bytes > 0 and self.held_bytes + self.free_bytes > self.high_water_bytes:
            key = max((k for k, bufs in self._free.items() if bufs), key=lambda k: k[1])
            self._free[key].pop()
            self.free_bytes -= key[1]

    def clear(self) -> None:
        """Drop every free buffer (the held ones return, and are dropped, as autograd frees them)."""
        with self._lock:
            self._free.clear()
            self.free_bytes = 0
            self.high_water_bytes = self.held_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes

    # a copy of a planned model (NOTE [copies of a planned model] in wrap/wrapper.py) gets an empty pool of
    # its own: buffers, counters and the lock belong to this run (a lock cannot be copied at all)
    def __getstate__(self) -> dict[str, Any]:
        return {"reuse": self.reuse}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(reuse=state["reuse"])  # type: ignore[misc]


def _allocate(nbytes: int, pinned: bool) -> Any:
    """``nbytes`` of host memory outside torch's CPU allocator on CPU (NOTE [activation offload]), pinned on CUDA."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return np.empty(nbytes, dtype=np.uint8)


class _Packed:
    """One saved tensor in host memory: its pool buffer, where it came from, and a prefetched device copy."""

    __slots__ = ("buffer", "host", "device", "ready", "fetched", "fetch_ready", "dtype", "shape", "__weakref__")

    def __init__(self, buffer: HostBuffer, host: Any, device: torch.device, ready: Any, dtype: torch.dtype,
                 shape: torch.Size) -> None:
        self.buffer = buffer          # from the HostPool; given back when autograd frees this handle
        self.host = host              # CUDA: a pinned tensor viewing the buffer; CPU: the buffer's bytes (numpy)
        self.dtype, self.shape = dtype, shape
        self.device = device
        self.ready = ready            # CUDA event: the device -> host copy is done (None on CPU)
        self.fetched: torch.Tensor | None = None   # a prefetched device copy, not yet handed over
        self.fetch_ready: Any = None  # CUDA event: that copy is done


class _SideStreams:
    """One copy stream per CUDA device, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def of(self, device: torch.device) -> "torch.cuda.Stream":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]


_STREAMS = _SideStreams()


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _RegionOffload:
    """The pack/unpack pair of one run of one region, and its prefetch (NOTE [activation offload])."""

    def __init__(self, pool: HostPool, resident: set[int]) -> None:
        self.pool = pool
        self.resident = resident      # storage addresses of the region's parameters and buffers
        self.packed: list[weakref.ref] = []

    def pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if (t.device.type == "meta" or t.is_sparse or nbytes < _MIN_PACK_BYTES
                or _storage_ptr(t) in self.resident):
            return t
        cuda = t.device.type == "cuda"
        buf = self.pool.take(nbytes, pinned=cuda)   # NOTE [host buffer pool]
        with _disable_current_modes():   # the host copy is never device memory (CPU: NOTE above)
            if cuda:
                host = buf.data.view(t.dtype).view(t.shape)
                stream = _STREAMS.of(t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))
                if buf.read_done is not None:   # a reused buffer: its last host -> device copy is done
                    stream.wait_event(buf.read_done)
                with torch.cuda.stream(stream):
                    host.copy_(t, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(stream)
                t.record_stream(stream)
            else:   # the bytes, outside torch's allocator (CPU: NOTE above); no copy made but into the buffer
                host, ready = buf.data, None
                torch.from_numpy(host).view(t.dtype).view(t.shape).copy_(t.detach())
        packed = _Packed(buf, host, t.device, ready, t.dtype, t.shape)
        weakref.finalize(packed, self.pool.give_back, buf)
        self.packed.append(weakref.ref(packed))
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.pool.copies_in += 1
        if packed.fetched is not None:   # prefetched on the side stream
            out, packed.fetched = packed.fetched, None
            compute = torch.cuda.current_stream(out.device)
            compute.wait_event(packed.fetch_ready)
            out.record_stream(compute)
            return out
        if packed.device.type == "cuda":
            compute = torch.cuda.current_stream(packed.device)
            compute.wait_event(packed.ready)
            out = packed.host.to(packed.device, non_blocking=True)
            packed.buffer.read_done = compute.record_event()   # the buffer may be reused after this
            return out
        # under the tracker: device bytes again (CPU: NOTE above)
        return torch.from_numpy(packed.host).view(packed.dtype).view(packed.shape).clone()

    def prefetch(self) -> None:
        """Start every host -> device copy of this region on the side stream (CUDA only)."""
        for ref in self.packed:
            packed = ref()
            if packed is None or packed.device.type != "cuda" or packed.fetched is not None:
                continue
            stream = _STREAMS.of(packed.device)
            with torch.cuda.stream(stream):
                stream.wait_event(packed.ready)
                packed.fetched = packed.host.to(packed.device, non_blocking=True)
                packed.fetch_ready = torch.cuda.Event()
                packed.fetch_ready.record(stream)
                packed.buffer.read_done = packed.fetch_ready   # the buffer may be reused after this
        self.packed.clear()


def resident_storages(module: nn.Module) -> set[int]:
    """Storage addresses of ``module``'s parameters and buffers (never packed)."""
    tensors = [*module.parameters(), *module.buffers()]
    return {_storage_ptr(t) for t in tensors if t.device.type != "meta"}


@contextlib.contextmanager
def offloading(region: _RegionOffload) -> Iterator[None]:
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        yield


def _prefetch_on_grad(out: Any, region: _RegionOffload) -> None:
    """Prefetch when backward reaches the region's output (the first output that needs a gradient)."""
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.device.type == "cuda":
            leaf.register_hook(lambda grad: (region.prefetch(), grad)[1])
            return


class OffloadWrapper(CheckpointWrapper):
    """Runs one planned module's forward with its saved activations offloaded (NOTE [activation offload]).

    Installed like a :class:`~remat.wrap.wrapper.CheckpointWrapper` (NOTE [instance forward]);
    ``forward_calls`` counts forwards, ``replay_calls`` stays 0 (nothing is replayed).
    ``pool`` counts the host bytes (shared by every offload boundary of one ``apply``).
    """

    def __init__(self, module: nn.Module, path: str, pool: HostPool) -> None:
        super().__init__(module, path, CheckpointMode.OFFLOAD, preserve_rng_state=False)
        self.pool = pool
        self._resident: set[int] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            from ..errors import PlanError
            raise PlanError(f"{self.path}: an offload boundary cannot run under torch.compile (NOTE [activation offload])",
                            tip="plan without offload for a compiled run")
        self.forward_calls += 1
        if self._resident is None:   # parameters do not move between steps: found once
            self._resident = resident_storages(self.module)
        region = _RegionOffload(self.pool, self._resident)
        with contextlib.ExitStack() as stack:
            for obs in list(self.observers):
                stack.enter_context(obs.region(self, replay=False))
            stack.enter_context(offloading(region))
            out = self.original_forward(*args, **kwargs)
        _prefetch_on_grad(out, region)
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_resident=None)
        return state

    def __repr__(self) -> str:
        return f"OffloadWrapper({self.path!r})"


class HostInput:
    """The input of one call of a FULL_HOST_INPUT segment: on the device until the checkpointed forward
    returns, then in host memory until the replay loads it back (NOTE [segment input on the host])."""

    __slots__ = ("device", "packed", "requires_grad", "region")

    def __init__(self, x: torch.Tensor, region: _RegionOffload) -> None:
        self.device: torch.Tensor | None = x   # the device tensor while the forward runs; None once on the host
        self.packed: Any = None                 # its _Packed host copy (NOTE [activation offload])
        self.requires_grad = x.requires_grad
        self.region = region

    def load(self) -> torch.Tensor:
        """The input: the device tensor in the forward; in a replay a fresh device copy, with the forward's
        ``requires_grad``, so the replay's ops save the same tensors the forward's did."""
        if self.device is not None:
            return self.device
        out = self.region.unpack(self.packed)
        return out.requires_grad_(True) if self.requires_grad else out

    def offload(self) -> None:
        """Copy the input to a pooled host buffer and drop the device reference (NOTE [host buffer pool]).
        A tensor the pack rule keeps on the device (a parameter's storage, under ``_MIN_PACK_BYTES``)
        stays here."""
        assert self.device is not None
        with torch.no_grad():
            packed = self.region.pack(self.device.detach())
        if not isinstance(packed, torch.Tensor):
            self.packed, self.device = packed, None


class HostInputSegmentWrapper(SegmentWrapper):
    """A segment in mode FULL_HOST_INPUT: recomputed as in FULL, its input in host memory meanwhile.

    NOTE [segment input on the host]
    A FULL segment keeps one thing between its forward and its backward: its input, which torch's
    non-reentrant checkpoint holds in its frame (``_CheckpointFrame.save_inputs``) to replay from, not
    as a saved tensor, so the saved-tensor hooks of NOTE [activation offload] never see it. In
    non-reentrant checkpoint the input need not be a checkpoint argument at all: the forward runs
    under checkpoint's saved-tensor hooks with grad enabled, so the graph it records leads from the
    output back to the input's own ``grad_fn`` and the input's gradient flows there, never through
    checkpoint's arguments (torch/utils/checkpoint.py, ``_checkpoint_without_reentrant_generator``,
    torch 2.13). So the wrapper hands checkpoint a :class:`HostInput` box instead of the input, plus
    an empty tensor on the input's device (0 bytes) so that checkpoint infers the same device type
    and stashes the same device RNG states as a plain checkpoint of the input would
    (``_infer_device_type``, ``get_device_states``; CPU RNG is stashed either way): a replay draws
    the same random numbers. The region's forward reads the input from the box. When checkpoint
    returns, the box copies the input to a pooled host buffer (the pack of NOTE [activation
    offload]: the same side stream and events on CUDA, the same uncounted numpy bytes on CPU) and
    drops its device reference; the replay, run by backward, loads a fresh device copy of the same
    dtype, shape and ``requires_grad`` before the members run, so it saves the same tensors
    (checkpoint's determinism check compares their metadata). On CUDA the copy back is prefetched
    when backward reaches the segment's output, as for an offload boundary. The host buffer returns
    to the pool when autograd frees the checkpoint's frame, which holds the box.
    - The device bytes are freed only if nothing else holds the input: an op outside the segment
      that saved it (ReLU saves its output), the batch, a module attribute. Dropping the box's
      reference then frees nothing, and the copies are pure cost. The profile counts the input as
      freed only where the recorded step shows it (NOTE [segment input freed] in
      remat/profile/step.py), and the planner prices the mode only there (NOTE [offload cost
      model] in remat/plan/offload.py).
    - The input must be the first positional argument and a tensor (a segment passes one tensor
      along: NOTE [segment wrapper]); anything else is a PlanError at the call.
    - Eager only, like OFFLOAD: ``apply`` refuses it in a compiled plan.
    """

    MODE = CheckpointMode.FULL_HOST_INPUT

    def __init__(self, members: list[tuple[str, nn.Module]], name: str, pool: HostPool, *,
                 guarded: bool = False, preserve_rng_state: bool = True) -> None:
        super().__init__(members, name, CheckpointMode.FULL_HOST_INPUT, guarded=guarded,
                         preserve_rng_state=preserve_rng_state)
        self.pool = pool
        self._resident: set[int] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ..errors import PlanError
        if _tracing():
            raise PlanError(f"{self.path}: a segment with its input on the host cannot run under torch.compile "
                            "(NOTE [segment input on the host])", tip="plan without offload for a compiled run")
        if not args or not isinstance(args[0], torch.Tensor):
            raise PlanError(f"segment {self.path}: mode 'full-host-input' needs the segment's input as its first "
                            f"positional argument, a tensor; got {type(args[0]).__name__ if args else 'none'}",
                            tip="re-plan this model: remat plans the mode only where the profiled step shows it")
        if not torch.is_grad_enabled():   # no backward: checkpoint keeps nothing, so there is nothing to move
            return super().__call__(*args, **kwargs)
        if self._resident is None:   # parameters do not move between steps: found once
            self._resident = set().union(*(resident_storages(m) for m in self.members))
        region = _RegionOffload(self.pool, self._resident)
        box = HostInput(args[0], region)
        anchor = torch.empty(0, device=args[0].device)   # 0 bytes: checkpoint's device inference (NOTE above)
        out = super().__call__(box, anchor, *args[1:], **kwargs)
        box.offload()
        _prefetch_on_grad(out, region)
        return out

    def _region_forward(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], HostInput):   # (box, anchor, rest...) -> (input, rest...)
            args = (args[0].load(), *args[2:])
        return super()._region_forward(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_resident=None)
        return state

    def __repr__(self) -> str:
        guard = ", guarded" if self.guarded else ""
        return f"HostInputSegmentWrapper({self.path!r}, {len(self.members)} modules{guard})"
