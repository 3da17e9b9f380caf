"""What a simulated step does differently from a real one, and why its bytes still match.

NOTE [simulated step]
The step runs under ``FakeTensorMode``: every tensor is a ``FakeTensor`` whose device reads
``cpu`` and whose storage is a meta storage with the real ``nbytes``, so the live-tensor
tracker counts it exactly as it counts a real CPU tensor, and nothing is allocated. What a
real step does that fake tensors cannot do, or do differently, and how two modes fix it:

1. ``.item()`` / ``float(t)`` (``aten._local_scalar_dense``) has no value to return. The
   optimizer's step counter is a fake *constant* and keeps its value; anything else (the
   step's ``float(loss)``) gets a placeholder: 1.0, 1, or False. A workload whose control
   flow depends on tensor values is simulated along the placeholder's branch.
2. Kernel choices that C++ makes from a tensor's device see ``cpu`` and choose as on a real
   CPU run: ``scaled_dot_product_attention`` asks its CPU dispatch stub (which reads only
   sizes, dtypes, strides and flags), ``dropout`` takes the CPU path. (Calling the op
   ``torch._fused_sdp_choice`` directly on fake tensors answers MATH from its meta kernel; the
   composite never does that.) So CPU semantics need nothing more; CUDA semantics reroute
   these calls (NOTE [CUDA semantics]).
3. Devices: a factory built on ``meta`` (see :mod:`remat.simulate.build`) has batch
   closures that move data ``.to("meta")``; a CUDA workload moves it ``.to("cuda")``.
   :class:`SimulationFunctions` maps those device arguments to the simulated device
   (``cpu``), so ``x[:, :-1].to(device)`` stays a view exactly as on a real CPU run.
   (Fake CUDA tensors cannot be used on a CPU-only build: the first op aborts the process.)
4. Three CPU loss kernels return their reduced 0-dim loss in a storage the size of the
   elementwise loss (they compute it into the result buffer, then reduce in place): real
   ``mse_loss``, ``smooth_l1_loss`` and ``binary_cross_entropy`` with reduction mean/sum hold
   N elements where the meta kernel holds 1. :class:`SimulationDispatch` gives the fake result
   the same oversized storage (CPU semantics only; found by comparing real and fake output
   storages over ~40 common ops, tests/test_simulate.py keeps the list honest).

NOTE [CUDA semantics]
Tensors stay fake-CPU, but the step follows the kernels eager CUDA would pick, where those
change what is allocated or saved for backward:
- attention: ``F.scaled_dot_product_attention`` is rerouted to the op CUDA would run: FLASH
  (``_scaled_dot_product_flash_attention``) for fp16/bf16, head_dim <= 256 and a multiple of 8,
  equal heads and no mask; else EFFICIENT (``_scaled_dot_product_efficient_attention``: fp32, or
  a mask); else MATH; honouring ``torch.backends.cuda.*_sdp_enabled()``. Their meta kernels
  give CUDA's outputs (logsumexp, philox seed/offset) on fake CPU tensors, and autograd saves
  what it saves on CUDA. Neither fused kernel materialises the (T, T) attention matrix, which
  CPU's MATH path (taken with dropout) does.
- dropout: CUDA's ``dropout`` is the fused ``native_dropout`` (bool mask, 1 byte/element saved);
  CPU's multiplies by a float noise tensor (4 bytes/element saved). ``F.dropout`` is rerouted.
- optimizers: CUDA defaults to ``foreach=True`` (one kernel per op over all parameters, with
  parameter-sized temporaries, e.g. AdamW's ``_foreach_sqrt(exp_avg_sq)``); CPU to the
  per-parameter loop. :func:`prepare_optimizer` sets ``foreach=True`` where left at None.
Not modelled (stated, not hidden): the caching allocator's 512-byte rounding and 2 MiB block
granularity, cuBLAS/cuDNN workspaces (tens of MiB, allocated inside kernels), cuDNN's
BatchNorm reserve space, and the host->device copy of the batch (the simulated batch is the
CPU batch). ``benchmarks/gpu_check.py`` (its ``simulate`` check) measures the resulting gap on a GPU.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# NOTE [simulated step] 4.: loss ops whose real CPU 0-dim output keeps an elementwise-sized storage
_OVERSIZED_CPU_LOSSES = {_aten.mse_loss.default, _aten.smooth_l1_loss.default, _aten.binary_cross_entropy.default}

# torch.nn.attention.SDPBackend values (a pybind enum: not iterable, so spelled out)
SDP_MATH, SDP_FLASH, SDP_EFFICIENT = 0, 1, 2


class KernelSemantics(str, enum.Enum):
    """Whose eager kernels the simulated step follows (NOTE [CUDA semantics])."""

    CPU = "cpu"    # exactly the real CPU step: bytes equal the CPU live-tensor trace
    CUDA = "cuda"  # CUDA's attention, dropout and optimizer kernels, on fake CPU tensors


def _placeholder(t: torch.Tensor) -> bool | int | float:
    if t.dtype is torch.bool:
        return False
    return 1.0 if (t.dtype.is_floating_point or t.dtype.is_complex) else 1


def cuda_sdp_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> int:
    """The backend eager CUDA (sm80+) picks, by its documented constraints (NOTE [CUDA semantics])."""
    same_heads = query.dim() == 4 and key.dim() == 4 and query.size(0) == key.size(0) and (
        query.size(1) == key.size(1) or enable_gqa)
    head_dim = query.size(-1)
    if (torch.backends.cuda.flash_sdp_enabled() and same_heads and attn_mask is None
            and query.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and head_dim % 8 == 0):
        return SDP_FLASH
    if torch.backends.cuda.mem_efficient_sdp_enabled() and query.dim() == 4 and query.dtype in (
            torch.float32, torch.float16, torch.bfloat16):
        return SDP_EFFICIENT
    return SDP_MATH


class SimulationDispatch(TorchDispatchMode):
    """Sits just above ``FakeTensorMode``: placeholder scalars, CPU loss storages (NOTE [simulated step])."""

    def __init__(self, semantics: KernelSemantics) -> None:
        super().__init__()
        self.semantics = semantics
        self.placeholders = 0  # how many .item() calls got a placeholder (reported by the simulation)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            t = args[0]
            if getattr(t, "constant", None) is None:  # no known value: NOTE [simulated step] 1.
                self.placeholders += 1
                return _placeholder(t)
        elif func in _OVERSIZED_CPU_LOSSES and self.semantics is KernelSemantics.CPU:
            return self._oversized_loss(func, args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _oversized_loss(func, args, kwargs):  # noqa: ANN001, ANN205
        out = func(*args, **kwargs)
        names = [a.name for a in func._schema.arguments]
        reduction = kwargs.get("reduction", args[names.index("reduction")] if len(args) > names.index("reduction") else 1)
        if reduction == 0 or out.dim() != 0:  # Reduction::None: an ordinary elementwise output
            return out
        n = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
        big = torch.empty(max(n, 1), dtype=out.dtype, device=out.device)
        return big.resize_(())  # resize_ never shrinks a storage: N elements, like the real kernel


def _is_remapped(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type in ("meta", "cuda")
    if isinstance(device, str):
        return device.split(":")[0] in ("meta", "cuda")
    return False


class SimulationFunctions(TorchFunctionMode):
    """Device arguments ``meta``/``cuda`` -> the simulated device; CUDA's attention and dropout (NOTE [CUDA semantics])."""

    def __init__(self, device: torch.device, semantics: KernelSemantics) -> None:
        super().__init__()
        self.device = device
        self.semantics = semantics

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if "device" in kwargs and _is_remapped(kwargs["device"]):
            kwargs = {**kwargs, "device": self.device}
        if func is torch.Tensor.to and len(args) > 1 and _is_remapped(args[1]):
            args = (args[0], self.device, *args[2:])
        elif func is torch.Tensor.cuda:
            return args[0].to(self.device)
        elif self.semantics is KernelSemantics.CUDA:
            if func is F.dropout:
                return self._cuda_dropout(*args, **kwargs)
            if func is F.scaled_dot_product_attention:
                return self._cuda_sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        choice = cuda_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if choice == SDP_FLASH:
            return _aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                             scale=scale)[0]
        if choice == SDP_EFFICIENT:
            bias = attn_mask
            if bias is not None and bias.dtype is torch.bool:  # as the CUDA composite converts it
                bias = torch.zeros(bias.shape, dtype=query.dtype).masked_fill_(bias.logical_not(), float("-inf"))
            logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return _aten._scaled_dot_product_efficient_attention(query, key, value, bias, logsumexp, dropout_p,
                                                                 is_causal, scale=scale)[0]
        return _aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                        None, scale=scale, enable_gqa=enable_gqa)[0]

    @staticmethod
    def _cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        # CUDA: at::dropout -> native_dropout when 0 < p < 1 (is_fused_kernel_acceptable)
        if training and 0.0 < p < 1.0 and input.numel() > 0:
            out = torch.native_dropout(input, p, True)[0]
            return input.copy_(out) if inplace else out
        return F.dropout(input, p, training, inplace)


def prepare_optimizer(optimizer: torch.optim.Optimizer, semantics: KernelSemantics) -> None:
    """Make the optimizer take the code path it would take on the simulated device."""
    if semantics is not KernelSemantics.CUDA or "foreach" not in optimizer.defaults:
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True  # torch.optim's default for CUDA parameters
