"""Model fingerprints: the identity a plan and a receipt are bound to."""

from __future__ import annotations

import hashlib
import inspect
import json

from torch import nn

from .model import ModelFingerprint, ParamSignature


def class_source_hash(cls: type) -> str:
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):  # built in C, or defined in a REPL
        src = f"{cls.__module__}.{cls.__qualname__}"
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def module_revision(module: nn.Module) -> str:
    """Revision hash of one boundary: its class source + its parameter shapes (receipt per boundary)."""
    h = hashlib.sha256()
    for sub in module.modules():
        h.update(f"{type(sub).__qualname__}:{class_source_hash(type(sub))}".encode())
    for name, p in module.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


def fingerprint(model: nn.Module) -> ModelFingerprint:
    modules = tuple((name, type(m).__qualname__) for name, m in model.named_modules())
    params = tuple(ParamSignature(name=n, shape=tuple(p.shape), dtype=str(p.dtype).replace("torch.", ""))
                   for n, p in model.named_parameters(remove_duplicate=False))
    # keyed by qualname, not module: a file workload's module name depends on where the
    # checkout lives, and a receipt must re-check from any clone
    hashes = tuple(sorted({(type(m).__qualname__, class_source_hash(type(m))) for m in model.modules()}))
    payload = json.dumps([modules, [(p.name, p.shape, p.dtype) for p in params], hashes])
    return ModelFingerprint(modules=modules, params=params, class_source_hashes=hashes,
                            digest=hashlib.sha256(payload.encode()).hexdigest())
