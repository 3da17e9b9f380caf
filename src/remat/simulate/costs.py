"""Per-op cost records: FLOPs (``FlopCounterMode``'s formulas), bytes moved, module, phase.

NOTE [op costs]
``OpCostRecorder`` is a ``TorchDispatchMode`` that records every ATen op of a step, real or
fake. FLOPs come from ``FlopCounterMode``'s registry (matmul, convolution, attention, forward
and backward; every other op counts 0 FLOPs and is bandwidth-bound in the roofline), plus the
CPU flash-attention ops, which the registry lacks. Bytes moved = bytes of every tensor argument
+ bytes of every tensor output (numel x itemsize, views by their own extent), so an in-place op
counts a read and a write. Ops that launch no kernel move nothing and cost nothing: view/alias
ops (``OpOverload.is_view``), ``empty*`` allocations, ``detach``/``alias``/``_unsafe_view``,
``prim`` ops and metadata queries that return no tensor.
Unlike ``FlopCounterMode`` itself the recorder never decomposes an op, so stacking it on a
traced step changes nothing the live-tensor tracker sees.

Module attribution uses global forward pre/post hooks (restored on exit): each op records the
stack of module names running around it, so a module's forward cost is the sum over the ops
whose stack contains it (inclusive of its children).
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ..types import Phase

_aten = torch.ops.aten

# No kernel is launched for these (allocation or metadata only).
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten._unsafe_view.default,
    _aten.detach.default, _aten.alias.default, _aten.lift_fresh.default, _aten._fused_sdp_choice.default,
    _aten.resize_.default, _aten.set_.source_Storage_storage_offset,
}
_CONV = {_aten.convolution, _aten._convolution, _aten.cudnn_convolution, _aten.convolution_backward,
         _aten._slow_conv2d_forward, _aten.convolution_overrideable}


def _cpu_flash_flop(query, key, value, *args, out_val=None, **kwargs) -> int:  # noqa: ANN001
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:  # noqa: ANN001
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_cpu_flash_flop._get_raw = True           # type: ignore[attr-defined]  (FlopCounterMode: pass tensors as they are)
_cpu_flash_backward_flop._get_raw = True  # type: ignore[attr-defined]
EXTRA_FLOP_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flop,
}


@dataclasses.dataclass(slots=True)
class OpRecord:
    """One ATen op of a step."""

    op: str                          # overload name, e.g. "aten.mm.default"
    phase: Phase | None
    modules: tuple[str, ...]         # module stack, outermost first ("" is the root model)
    flops: int                       # FlopCounterMode formula (0: not a matmul-class op)
    nbytes: int                      # bytes read + written (0 when no kernel runs)
    dtype: torch.dtype | None        # dtype of the first tensor argument (picks the peak FLOP/s)
    kernel: bool                     # False: view/alias/allocation, costs nothing
    conv: bool = False               # a convolution (TF32 by default on CUDA)
    scores: int = 0                  # an attention op's query x key scores (batch x heads x q_len x k_len)


def _tensor_bytes(tree: Any) -> tuple[int, torch.dtype | None]:
    total, dtype = 0, None
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
            if dtype is None:
                dtype = t.dtype
    return total, dtype


def has_tensor(out: Any, func: Any) -> bool:
    """Metadata queries (sizes, strides, ``is_contiguous``) return no tensor and launch nothing;
    ``.item()`` returns none either but is a device-to-host copy and a sync."""
    if isinstance(out, torch.Tensor) or func is _aten._local_scalar_dense.default:
        return True
    return any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])


def flop_registry(custom_flops: dict[Any, Any] | None = None) -> dict[Any, Any]:
    """``FlopCounterMode``'s formulas by overload packet, with the CPU flash-attention ops added (NOTE [op costs])."""
    return FlopCounterMode(display=False, custom_mapping={**EXTRA_FLOP_FORMULAS, **(custom_flops or {})}).flop_registry


def op_record(func: Any, args: tuple, kwargs: dict[str, Any], out: Any, registry: dict[Any, Any],
              phase: Phase | None = None, modules: tuple[str, ...] = ()) -> OpRecord:
    """The :class:`OpRecord` of one ATen op that ran on ``args`` / ``kwargs`` and returned ``out`` (NOTE [op costs])."""
    if func in _NO_KERNEL or func.is_view or func.namespace == "prim" or not has_tensor(out, func):
        return OpRecord(str(func), phase, modules, 0, 0, None, False)
    packet = func._overloadpacket
    flops = 0
    formula = registry.get(packet)
    if formula is not None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001  a formula that cannot read these args: count no FLOPs
            flops = 0
    in_bytes, dtype = _tensor_bytes((args, kwargs))
    out_bytes, out_dtype = _tensor_bytes(out)
    return OpRecord(str(func), phase, modules, flops, in_bytes + out_bytes, dtype or out_dtype, True, packet in _CONV,
                    _attention_scores(packet.__name__, args))


def _attention_scores(name: str, args: tuple) -> int:
    """Query x key scores of a fused attention op (``q`` (..., L, E), ``k`` (..., S, E): prod(q.shape[:-1]) x S);
    0 for any other op. A backward op takes the output's gradient first (NOTE [attention scores] in devices.py)."""
    if "attention" not in name:
        return 0
    q, k = (args[1:3] if name.endswith("_backward") else args[:2]) if len(args) >= 3 else (None, None)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2 or k.dim() < 2:
        return 0
    return (q.numel() // max(1, q.shape[-1])) * k.shape[-2]


class OpCostRecorder(TorchDispatchMode):
    """Context manager recording an :class:`OpRecord` per op (NOTE [op costs]).

    ::

        with OpCostRecorder(model) as costs:
            step.run(i, marker=costs.marker)
        costs.ops  # -> predict_runtime(costs.ops, get_device_model("h100"))
    """

    def __init__(self, model: nn.Module | None = None, *, names: dict[int, str] | None = None,
                 custom_flops: dict[Any, Any] | None = None) -> None:
        super().__init__()
        if names is None:
            names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self.names = names
        self.flop_registry = flop_registry(custom_flops)
        self.ops: list[OpRecord] = []
        self.phase: Phase | None = None
        self._stack: list[str] = []
        self._stack_t: tuple[str, ...] = ()
        self._exit = ExitStack()

    def marker(self, phase: Phase) -> None:
        """A PhaseMarker: label the ops that follow with ``phase``."""
        self.phase = phase

    # -- module stack ---------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self._stack.append(name)
            self._stack_t = tuple(self._stack)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        while self._stack and self._stack.pop() != name:  # a module that raised leaves stale frames
            pass
        self._stack_t = tuple(self._stack)

    # -- ops ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(op_record(func, args, kwargs, out, self.flop_registry, self.phase, self._stack_t))
        return out

    def __enter__(self) -> "OpCostRecorder":
        self._exit.callback(register_module_forward_pre_hook(self._pre).remove)
        self._exit.callback(register_module_forward_hook(self._post).remove)
        try:
            super().__enter__()
        except BaseException:
            self._exit.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._exit.close()
