"""Comparing tensors and module state between the control and the planned run."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch
from torch import nn

from .model import TOLERANCES, Tolerance


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorDiff:
    name: str
    max_abs: float      # max |planned - control| (inf: shape/dtype/presence differs, or NaN)
    max_rel: float      # max_abs / max |control|
    ref_max_abs: float  # max |control|
    bitwise: bool
    ok: bool            # within the dtype's tolerance (NOTE [tolerances])
    tensor: str = ""    # the tensor's own name ("h.0.mlp.c_fc.weight"); ``name`` adds its kind ("grad ...")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tolerance_for(dtype: torch.dtype, table: dict[str, Tolerance] = TOLERANCES) -> Tolerance | None:
    """The tolerance of a floating dtype in ``table`` (eager, or NOTE [compiled tolerances]); None for
    dtypes that must match exactly."""
    return table.get(dtype_name(dtype))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex() or a.dtype == torch.bool:
        return torch.equal(a, b)
    # Compare the bytes: NaN == NaN with the same payload, and -0.0 != 0.0, like a bit-exact check should.
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


def diff_tensor(name: str, control: torch.Tensor | None, planned: torch.Tensor | None,
                table: dict[str, Tolerance] = TOLERANCES, scale: float | None = None) -> TensorDiff:
    """``scale``: the largest magnitude among the tensors compared with this one (the model's
    largest gradient); a tensor wholly within ``rtol x scale`` is compared at that scale (NOTE
    [cancelled gradients] in remat/verify/model.py). None: each tensor against its own magnitude."""
    if control is None and planned is None:
        return TensorDiff(name=name, max_abs=0.0, max_rel=0.0, ref_max_abs=0.0, bitwise=True, ok=True)
    if control is None or planned is None or control.shape != planned.shape or control.dtype != planned.dtype:
        return TensorDiff(name=name, max_abs=math.inf, max_rel=math.inf, ref_max_abs=0.0, bitwise=False, ok=False)
    if control.numel() == 0 or _bitwise_equal(control, planned):
        ref = 0.0 if control.numel() == 0 else float(control.detach().double().abs().max())
        return TensorDiff(name=name, max_abs=0.0, max_rel=0.0, ref_max_abs=ref, bitwise=True, ok=True)
    c, p = control.detach().double(), planned.detach().double()
    max_abs = float((p - c).abs().max())
    ref = float(c.abs().max())
    if math.isnan(max_abs):
        max_abs = math.inf
    max_rel = max_abs / ref if ref > 0 else (0.0 if max_abs == 0 else math.inf)
    tol = tolerance_for(control.dtype, table)
    ref_tol = scale if (scale is not None and tol is not None and ref <= tol.rtol * scale) else ref
    ok = tol is not None and math.isfinite(max_abs) and tol.allows(max_abs, ref_tol)
    return TensorDiff(name=name, max_abs=max_abs, max_rel=max_rel, ref_max_abs=ref, bitwise=False, ok=ok)


def diff_tensors(prefix: str, control: dict[str, torch.Tensor | None],
                 planned: dict[str, torch.Tensor | None], table: dict[str, Tolerance] = TOLERANCES,
                 scale: float | None = None) -> list[TensorDiff]:
    names = list(control) + [n for n in planned if n not in control]
    return [dataclasses.replace(diff_tensor(f"{prefix} {n}" if prefix else n, control.get(n), planned.get(n), table,
                                            scale), tensor=n)
            for n in names]


def largest_magnitude(named: dict[str, torch.Tensor | None]) -> float:
    """max |x| over every tensor in ``named`` (0.0 when there is none)."""
    return max((float(t.detach().double().abs().max()) for t in named.values() if t is not None and t.numel()),
               default=0.0)


def clone_tensors(named: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named}


# -- Python attributes of modules ------------------------------------------------------------------

# Attributes every nn.Module has (hook dicts, _parameters...), plus remat's instance ``forward``.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"forward", "training"}


class TensorValue:
    """A tensor kept as a plain module attribute (a cache), compared by value."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t.detach().clone()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorValue) and _bitwise_equal(self.t, other.t)

    def __hash__(self) -> int:
        return hash((tuple(self.t.shape), self.t.dtype))

    def __repr__(self) -> str:
        return f"tensor(shape={list(self.t.shape)}, {dtype_name(self.t.dtype)}, sum={float(self.t.double().sum()):.6g})"


def freeze(value: Any, depth: int = 0) -> Any:
    """A comparable snapshot of an attribute value (containers summarised, opaque objects by type)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum)):
        return value
    if isinstance(value, torch.Tensor):
        return TensorValue(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, nn.Module):
        return ("module", type(value).__qualname__)
    if depth >= 3:
        return ("...", type(value).__qualname__)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, len(value), tuple(freeze(v, depth + 1) for v in list(value)[:64]))
    if isinstance(value, dict):
        items = list(value.items())[:64]
        return ("dict", len(value), tuple((repr(k), freeze(v, depth + 1)) for k, v in items))
    if isinstance(value, (set, frozenset)):
        return ("set", len(value), tuple(sorted(repr(v) for v in list(value)[:64])))
    if callable(value):
        return ("callable", getattr(value, "__qualname__", type(value).__qualname__))
    return ("object", type(value).__qualname__)


def python_state(model: nn.Module, prefix: str = "") -> dict[str, Any]:
    """``"blocks.2.calls" -> frozen value`` for every user attribute of every module."""
    out: dict[str, Any] = {}
    for path, module in model.named_modules(prefix=prefix):
        for attr, value in vars(module).items():
            if attr in _MODULE_INTERNALS:
                continue
            out[f"{path}.{attr}" if path else attr] = freeze(value)
    return out


def short_repr(value: Any, limit: int = 60) -> str:
    if isinstance(value, tuple) and len(value) == 3 and value[0] in ("list", "tuple", "dict", "set"):
        text = f"{value[0]} of {value[1]}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def changed_attributes(control: dict[str, Any], planned: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``[("blocks.2.calls", 1, 2), ...]``: attributes whose values differ (control value, planned value)."""
    keys = list(control) + [k for k in planned if k not in control]
    return [(k, control.get(k, "<absent>"), planned.get(k, "<absent>")) for k in keys
            if control.get(k, "<absent>") != planned.get(k, "<absent>")]


def owner_module(name: str) -> str:
    """``"h.1.mlp.c_fc.weight"`` -> ``"h.1.mlp.c_fc"`` (``""`` for an attribute of the root)."""
    return name.rpartition(".")[0]


def boundary_of(path: str, boundaries: list[str]) -> str | None:
    """The boundary (module path) that contains ``path``, if any."""
    best: str | None = None
    for b in boundaries:
        if b == "" or path == b or path.startswith(b + "."):
            if best is None or len(b) > len(best):
                best = b
    return best
