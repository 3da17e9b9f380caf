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
- CPU: the device *is* host memory, so the mechanism is simulated exactly: the host copy is a
  clone made with every dispatch mode popped (``_disable_current_modes``), so the live-tensor
  tracker never counts it as device memory; the :class:`HostPool` counts it instead (bytes
  held and their peak). ``unpack`` clones it back under the tracker, so the device bytes of
  the backward are counted where the real device would hold them. Values are copied, never
  recomputed: the planned step is bitwise the unplanned one, which ``verify`` proves.
- Retained graphs: a packed tensor may be unpacked more than once (``retain_graph=True``);
  the host copy lives as long as autograd keeps the packed handle, so every unpack finds it.
Not under ``torch.compile``: a compiled graph saves what AOTAutograd partitions, which these
hooks never see; ``apply`` refuses an offload boundary in a compiled plan.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from ..types import CheckpointMode
from .wrapper import CheckpointWrapper

_MIN_PACK_BYTES = 1024   # smaller saved tensors stay on the device (bytes)


class HostPool:
    """Host bytes held by offloaded activations: now, and the peak since the last reset (bytes)."""

    def __init__(self) -> None:
        self.held_bytes = 0
        self.peak_bytes = 0
        self.copies_out = 0   # device -> host copies made (count)
        self.copies_in = 0    # host -> device copies made (count)

    def hold(self, host: torch.Tensor) -> None:
        nbytes = host.untyped_storage().nbytes()
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.copies_out += 1
        weakref.finalize(host.untyped_storage(), self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes


class _Packed:
    """One saved tensor in host memory: the host copy, where it came from, and a prefetched device copy."""

    __slots__ = ("host", "device", "ready", "fetched", "fetch_ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, ready: Any) -> None:
        self.host = host
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
        if (t.device.type == "meta" or t.is_sparse or t.numel() * t.element_size() < _MIN_PACK_BYTES
                or _storage_ptr(t) in self.resident):
            return t
        with _disable_current_modes():   # the host copy is never device memory (CPU: NOTE above)
            if t.device.type == "cuda":
                host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
                stream = _STREAMS.of(t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(stream):
                    host.copy_(t, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(stream)
                t.record_stream(stream)
            else:
                host, ready = t.detach().clone(), None
        self.pool.hold(host)
        packed = _Packed(host, t.device, ready)
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
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
            return packed.host.to(packed.device, non_blocking=True)
        return packed.host.clone()   # under the tracker: device bytes again (CPU: NOTE above)

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
