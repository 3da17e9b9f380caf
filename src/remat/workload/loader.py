"""Loading a workload from ``file.py:fn``, ``package.module:fn`` or a built-in name."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ShapeError, WorkloadError
from .contract import Workload

BUILTINS: dict[str, str] = {
    "gpt": "remat.workload.builtins.gpt:build",
    "cnn": "remat.workload.builtins.cnn:build",
    "mlp": "remat.workload.builtins.mlp:build",
}

ShapeValue = int | float | str


@dataclasses.dataclass(kw_only=True)
class LoadedWorkload:
    """A built workload with everything needed to build it again (the receipt stores this)."""

    spec: str
    shape: dict[str, ShapeValue]
    device: str
    dtype: str
    workload: Workload

    def rebuild(self, **shape_overrides: ShapeValue) -> "LoadedWorkload":
        """Build a fresh copy (new model, same spec), optionally at another shape."""
        return load_workload(self.spec, {**self.shape, **shape_overrides}, device=self.device, dtype=self.dtype)


def parse_shape(text: str | None) -> dict[str, ShapeValue]:
    """``"batch_size=16,seq_len=512"`` -> ``{"batch_size": 16, "seq_len": 512}``."""
    out: dict[str, ShapeValue] = {}
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key.isidentifier() or not raw:
            raise ShapeError(f"bad shape item {part!r}: expected key=value, e.g. batch_size=16,seq_len=512")
        value: ShapeValue
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
        out[key] = value
    return out


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise WorkloadError(f"unknown dtype {name!r}; choose one of float32, bfloat16, float16")
    return table[name]


def _resolve_factory(spec: str) -> Callable[..., Any]:
    target = BUILTINS.get(spec, spec)
    if ":" not in target:
        raise WorkloadError(
            f"workload {spec!r} is not a built-in ({', '.join(sorted(BUILTINS))}) "
            "and not of the form path/to/file.py:fn or package.module:fn"
        )
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise WorkloadError(f"workload {spec!r}: both the module and the function name are needed (module:fn)")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise WorkloadError(f"workload file not found: {path}")
        # a stable name (not hash(): salted per process) so class qualnames, and with them
        # model fingerprints, are the same in every process that loads this file
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        mod_name = f"remat_user_workload_{digest}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise WorkloadError(f"cannot import {path} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise WorkloadError(f"importing {path} raised {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise WorkloadError(f"cannot import module {where!r}: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise WorkloadError(f"{where} has no attribute {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise WorkloadError(f"{where}:{attr} is not callable")
    return factory


def factory_keywords(factory: Callable[..., Any]) -> tuple[set[str], bool]:
    """(named keyword parameters, whether it also takes **kwargs)."""
    sig = inspect.signature(factory)
    names = {p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise WorkloadError(f"unknown device {device!r}: {exc}", tip="use cpu or cuda (cuda:N)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise WorkloadError(f"device {device!r} was asked for but torch.cuda.is_available() is False "
                            f"(torch {torch.__version__})",
                            tip="use --device cpu, or install a CUDA build of torch (README), "
                                "or plan for a GPU from here with --simulate --target-device h100")


def load_workload(
    spec: str,
    shape: dict[str, ShapeValue] | None = None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
) -> LoadedWorkload:
    """Build the workload ``spec`` at ``shape``; typed :class:`WorkloadError` on any misuse."""
    shape = dict(shape or {})
    _check_device(device)
    factory = _resolve_factory(spec)
    names, var_kw = factory_keywords(factory)
    unknown = sorted(k for k in shape if k not in names and not var_kw)
    if unknown:
        allowed = sorted(names - {"device", "dtype"})
        raise ShapeError(f"workload {spec!r} has no shape keyword {', '.join(unknown)}; it accepts: {', '.join(allowed) or 'none'}")
    kwargs: dict[str, Any] = dict(shape)
    torch_dtype = parse_dtype(dtype)
    if "device" in names:
        kwargs["device"] = device
    if "dtype" in names:
        kwargs["dtype"] = torch_dtype
    torch.manual_seed(0)  # model init is part of the workload: make it reproducible
    try:
        built = factory(**kwargs)
    except Exception as exc:
        raise WorkloadError(f"workload factory {spec!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(built, Workload):
        raise WorkloadError(f"workload factory {spec!r} returned {type(built).__name__}, not remat.Workload")
    return LoadedWorkload(spec=spec, shape=shape, device=device, dtype=dtype, workload=built)
