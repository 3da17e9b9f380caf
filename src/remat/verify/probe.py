"""Instrumentation for paired runs: region probes, forward digests, gradient order, RNG states.

Every recorder here is a context manager that removes what it installs (hooks, observers).

NOTE [first divergent module]
When a step disagrees, the report names where the planned run first left the control:
(1) in forward order, the first module whose output digest (float64 sum and absolute
sum of its tensor outputs) differs beyond tolerance; else (2) in backward order (the
order in which parameter gradients finished accumulating in the control), the first
parameter whose gradient differs, named by its module (e.g. a replay with different
dropout masks shows first in the *last* checkpointed block, where backward starts);
else (3) the first buffer, then Python attribute, then parameter after the optimizer
step that differs. Forward hooks skip replays (they run during backward).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..host_rng import RngState
from ..wrap import ApplyHandle, CheckpointWrapper
from .compare import changed_attributes, python_state

aten = torch.ops.aten


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# -- device moves inside a region -----------------------------------------------------------------

_COPY_OPS = frozenset(getattr(aten, n) for n in ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize")
                      if hasattr(aten, n))


class DeviceMoveDetector(TorchDispatchMode):
    """Records copy ops whose tensors live on more than one device (``x.to("cuda")`` inside a region)."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in _COPY_OPS:
            ins = [t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t.device for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            devices = list(dict.fromkeys(ins + outs))
            if len(devices) > 1:
                src = ins[-1] if func.overloadpacket is aten.copy_ and len(ins) > 1 else ins[0]
                dst = ins[0] if func.overloadpacket is aten.copy_ else (outs[0] if outs else devices[-1])
                self.moves.append(f"{func.overloadpacket.__name__}: {src} -> {dst}")
        return out


# -- what each boundary does when it runs ----------------------------------------------------------

@dataclasses.dataclass
class RegionStats:
    rng_draws_forward: int = 0                                  # forwards across which an RNG advanced
    rng_draws_replay: int = 0
    replay_mutations: set[str] = dataclasses.field(default_factory=set)
    device_moves: list[str] = dataclasses.field(default_factory=list)


class RegionProbe:
    """A :class:`~remat.wrap.RegionObserver` on every wrapper of a handle (installed while entered)."""

    def __init__(self, handle: ApplyHandle, *, detect_device_moves: bool = True) -> None:
        self.handle = handle
        self.detect_device_moves = detect_device_moves
        self.stats: dict[str, RegionStats] = defaultdict(RegionStats)

    def __enter__(self) -> "RegionProbe":
        for w in self.handle.wrappers:
            w.observers.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.handle.wrappers:
            if self in w.observers:
                w.observers.remove(self)

    @contextlib.contextmanager
    def region(self, wrapper: CheckpointWrapper, *, replay: bool) -> Iterator[None]:
        st = self.stats[wrapper.path]
        # Snapshots run with every dispatch mode popped: inside a SELECTIVE replay, SAC's
        # recompute mode must not see our clones as ops of the region.
        with _disable_current_modes():
            rng_before = RngState.capture()
            # Replays must leave the module as the forward left it: snapshot what they could change.
            state_before = _module_state(wrapper.module, wrapper.path) if replay else None
        detector = DeviceMoveDetector() if self.detect_device_moves else None
        try:
            with detector if detector is not None else contextlib.nullcontext():
                yield
        finally:
            with _disable_current_modes():
                rng_drawn = bool(RngState.capture().differences(rng_before))
                changed = (_diff_module_state(state_before, _module_state(wrapper.module, wrapper.path))
                           if state_before is not None else [])
            if rng_drawn:
                if replay:
                    st.rng_draws_replay += 1
                else:
                    st.rng_draws_forward += 1
            st.replay_mutations.update(changed)
            if detector is not None:
                phase = "replay" if replay else "forward"
                st.device_moves.extend(f"{m} ({phase})" for m in detector.moves if f"{m} ({phase})" not in st.device_moves)


def _module_state(module: nn.Module, path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    bufs = {(f"{path}.{n}" if path else n): b.detach().clone() for n, b in module.named_buffers()}
    return bufs, python_state(module, prefix=path)


def _diff_module_state(before: tuple[dict[str, torch.Tensor], dict[str, Any]],
                       after: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> list[str]:
    out = [n for n, b in before[0].items() if n in after[0] and not torch.equal(b, after[0][n])]
    out += [k for k, _, _ in changed_attributes(before[1], after[1])]
    return out


# -- forward digests and gradient order ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Digest:
    """Float64 (sum, abs sum) of a module's tensor outputs, on their device; ``numel`` elements."""

    sums: torch.Tensor  # (2,) float64
    numel: int

    def close_to(self, other: "Digest", rtol: float, atol: float) -> bool:
        if self.numel != other.numel:
            return False
        a, b = self.sums.cpu(), other.sums.cpu()
        if torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True):  # equal, NaN/inf included
            return True
        slack = atol * self.numel + rtol * float(a[1])
        return bool(((a - b).abs() <= slack).all())


def _digest(out: Any) -> Digest | None:
    # Same-device ops only: inside a region a cross-device copy would look like a device move.
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and not t.is_complex()]
    if not leaves:
        return None
    with torch.no_grad():
        sums = sum(torch.stack([t.detach().double().sum(), t.detach().double().abs().sum()]) for t in leaves)
    return Digest(sums=sums, numel=sum(t.numel() for t in leaves))


class StepRecorder:
    """Per step: root outputs, per-module output digests in forward order, gradient order."""

    def __init__(self, model: nn.Module, *, record_grad_order: bool) -> None:
        self.model = model
        self.record_grad_order = record_grad_order
        self.outputs: list[torch.Tensor] = []                    # tensor leaves of the root's outputs
        self.digests: list[tuple[str, Digest]] = []              # (module path, digest) in forward order
        self.grad_order: list[str] = []                          # parameter names, backward order
        self._grad_seen: set[str] = set()
        self._handles: list[Any] = []

    def reset(self) -> None:
        self.outputs, self.digests, self.grad_order, self._grad_seen = [], [], [], set()

    def __enter__(self) -> "StepRecorder":
        for path, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(path)))
        if self.record_grad_order:
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if in_backward():  # a replay inside backward: not part of the forward order
                return
            d = _digest(out)
            if d is not None:
                self.digests.append((path, d))
            if path == "":
                self.outputs.extend(t.detach().clone() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return hook

    def _grad_hook(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            if name not in self._grad_seen:  # tied weights accumulate twice: keep the first
                self._grad_seen.add(name)
                self.grad_order.append(name)
        return hook
