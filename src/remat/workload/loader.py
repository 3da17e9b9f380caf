"""Loading a workload from ``file.py:fn``, ``package.module:fn`` or a built-in name."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
import typing
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ShapeError, WorkloadError
from ..types import RankReduce
from .contract import Workload, call_user, parse_autocast, with_autocast

BUILTINS: dict[str, str] = {
    "gpt": "remat.workload.builtins.gpt:build",
    "cnn": "remat.workload.builtins.cnn:build",
    "mlp": "remat.workload.builtins.mlp:build",
}

ShapeValue = int | float | str | bool


@dataclasses.dataclass(kw_only=True)
class LoadedWorkload:
    """A built workload with everything needed to build it again (the receipt stores this)."""

    spec: str
    shape: dict[str, ShapeValue]
    device: str
    dtype: str
    workload: Workload
    # the job's ranks when every build runs on all of them at once (remat.auto after FSDP2/DDP):
    # measured peaks and times are reduced over them (NOTE [one plan per job]); None: one process
    ranks: RankReduce | None = None
    autocast: str | None = None   # "bfloat16"/"float16": the forward runs under torch.autocast (NOTE [autocast steps])

    def rebuild(self, **shape_overrides: ShapeValue) -> "LoadedWorkload":
        """Build a fresh copy (new model, same spec), optionally at another shape."""
        return load_workload(self.spec, {**self.shape, **shape_overrides}, device=self.device, dtype=self.dtype,
                             autocast=self.autocast)


def shape_text(shape: dict[str, Any] | None, empty: str = "the default shape") -> str:
    """``{"batch_size": 16, "seq_len": 512}`` -> ``"batch_size=16, seq_len=512"`` (``empty`` for no keywords):
    the one way a shape is written in a message or a report."""
    return ", ".join(f"{k}={v}" for k, v in (shape or {}).items()) or empty


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
        if raw.lower() in ("true", "false"):
            out[key] = raw.lower() == "true"
            continue
        # int() and float() read every Unicode digit ("٣" is 3); a number on a command line is ASCII, so
        # anything else stays text, which a factory declaring an int refuses (NOTE [shape conformance])
        value = _number(raw) if raw.isascii() else raw
        out[key] = value
    return out


def _number(raw: str) -> ShapeValue:
    try:
        return int(raw)
    except ValueError:
        try:
            return float(raw)
        except ValueError:
            return raw


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
            call_user(f"importing {path}", module_spec.loader.exec_module, module)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
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


# NOTE [shape conformance]
# Shape keywords come from text (``--shape batch_size=abc``) or from a receipt (untrusted
# JSON), so each value is checked against the type the factory declares for that keyword
# *before* the factory is called: its annotation (a type, or under ``from __future__ import
# annotations`` a string, read without evaluating it: ``int``, ``float``, ``bool``, ``str``,
# ``X | None``, ``Optional[X]``), else the type of its default. Ints stay ints (``8.0`` is not
# an ``int``, ``true`` is not ``1``); an ``int`` is accepted where a ``float`` is declared. A
# keyword with no declared or default type is passed as it is.
_SCALARS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


def _declared_types(p: inspect.Parameter) -> tuple[type, ...] | None:
    """The scalar types parameter ``p`` declares (NOTE [shape conformance]); None: not declared or not scalar."""
    ann = p.annotation
    if ann is inspect.Parameter.empty:
        d = p.default
        return (type(d),) if type(d) in (bool, int, float, str) else None
    if isinstance(ann, str):
        text = ann.replace(" ", "").replace("typing.", "")
        if text.startswith("Optional[") and text.endswith("]"):
            text = text[len("Optional["):-1]
        names = [t for t in text.split("|") if t != "None"]
        if names and all(n in _SCALARS for n in names):
            return tuple(_SCALARS[n] for n in names)
        return None
    if ann in (bool, int, float, str):
        return (ann,)
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if args and all(a in (bool, int, float, str) for a in args):
        return tuple(args)
    return None


def _conforms(value: Any, types: tuple[type, ...]) -> bool:
    for t in types:
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is str and isinstance(value, str):
            return True
    return False


def conform_shape(factory: Callable[..., Any], spec: str, shape: dict[str, Any]) -> dict[str, ShapeValue]:
    """Check every shape value against the factory's declared type (NOTE [shape conformance]); ShapeError if off."""
    params = inspect.signature(factory).parameters
    out: dict[str, ShapeValue] = {}
    for key, value in shape.items():
        if not isinstance(value, (bool, int, float, str)):
            raise ShapeError(f"shape keyword {key}: {type(value).__name__} values are not shape values "
                             "(use numbers, true/false or text)")
        if isinstance(value, float) and not math.isfinite(value):
            raise ShapeError(f"shape keyword {key}={value}: not a finite number")
        p = params.get(key)
        types = _declared_types(p) if p is not None else None
        if types is not None and not _conforms(value, types):
            declared = " | ".join(t.__name__ for t in types)
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ShapeError(f"shape keyword {key}={shown}: workload {spec!r} declares {key}: {declared}, "
                             f"and {shown} is a {type(value).__name__}",
                             tip=f"pass {key} as {'an integer' if types == (int,) else 'a ' + declared} "
                                 f"(e.g. --shape {key}={_example(types)})")
        out[key] = value
    return out


def _example(types: tuple[type, ...]) -> str:
    return {int: "8", float: "0.5", bool: "true", str: "text"}[types[0]]


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise WorkloadError(f"unknown device {device!r}: {exc}", tip="use cpu or cuda (cuda:N)") from exc
    if dev.type not in ("cpu", "cuda"):
        # remat measures bytes with the CUDA allocator or its CPU counters (remat.memory), nothing else; and
        # a meta tensor has no storage, so no step runs on it at all (torch fails at the first .item())
        why = "meta tensors have a shape and no storage, so no training step runs on them" if dev.type == "meta" \
            else f"remat measures memory on cpu and cuda only, not {dev.type}"
        raise WorkloadError(f"--device {device}: {why}",
                            tip="use --device cpu or cuda (cuda:N); to plan without allocating, --simulate "
                                "(it runs the step on meta tensors under FakeTensorMode)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise WorkloadError(f"device {device!r} was asked for but torch.cuda.is_available() is False "
                            f"(torch {torch.__version__})",
                            tip="use --device cpu, or install a CUDA build of torch (README), "
                                "or plan for a GPU from here with --simulate --target-device h100")


def factory_defaults(spec: str) -> dict[str, Any]:
    """The default of every shape keyword the factory of ``spec`` declares one for (``device``,
    ``dtype`` and ``*args``/``**kwargs`` left out); WorkloadError when ``spec`` names no factory.

    The one public way other stages read a factory's signature (it imports the factory's
    module, as loading does)."""
    factory = _resolve_factory(spec)
    return {p.name: p.default for p in inspect.signature(factory).parameters.values()
            if p.name not in ("device", "dtype") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is not p.empty}


def load_workload(
    spec: str,
    shape: dict[str, ShapeValue] | None = None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    autocast: str | None = None,
) -> LoadedWorkload:
    """Build the workload ``spec`` at ``shape``; typed :class:`WorkloadError` on any misuse (a device remat
    cannot measure on, ``meta`` included). ``autocast`` (``"bf16"``, ``"fp16"``): its forward runs under
    ``torch.autocast`` (NOTE [autocast steps])."""
    _check_device(device)
    return _load(spec, shape, device=device, dtype=dtype, autocast=autocast)


def load_workload_on_meta(spec: str, shape: dict[str, ShapeValue] | None = None, *,
                          dtype: str = "float32") -> LoadedWorkload:
    """Build ``spec`` at ``shape`` on the meta device: only for simulation (remat.simulate), which runs its
    step under FakeTensorMode; :func:`load_workload` refuses ``meta``, on which no real step runs."""
    return _load(spec, shape, device="meta", dtype=dtype, autocast=None)


def _load(spec: str, shape: dict[str, ShapeValue] | None, *, device: str, dtype: str,
          autocast: str | None) -> LoadedWorkload:
    shape = dict(shape or {})
    autocast = parse_autocast(autocast)
    factory = _resolve_factory(spec)
    names, var_kw = factory_keywords(factory)
    unknown = sorted(k for k in shape if k not in names and not var_kw)
    if unknown:
        allowed = sorted(names - {"device", "dtype"})
        raise ShapeError(f"workload {spec!r} has no shape keyword {', '.join(unknown)}; it accepts: {', '.join(allowed) or 'none'}")
    shape = conform_shape(factory, spec, shape)
    kwargs: dict[str, Any] = dict(shape)
    torch_dtype = parse_dtype(dtype)
    if "device" in names:
        kwargs["device"] = device
    if "dtype" in names:
        kwargs["dtype"] = torch_dtype
    torch.manual_seed(0)  # model init is part of the workload: make it reproducible
    built = call_user(f"workload factory {spec!r}", factory, **kwargs)
    if not isinstance(built, Workload):
        raise WorkloadError(f"workload factory {spec!r} returned {type(built).__name__}, not remat.Workload")
    return LoadedWorkload(spec=spec, shape=shape, device=device, dtype=dtype,
                          workload=with_autocast(built, device, autocast), autocast=autocast)
