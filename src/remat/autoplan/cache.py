"""The plan cache of ``remat.auto``: one ``plan.json`` per key, in ``~/.cache/remat/plans``.

NOTE [plan cache key]
A cached plan is reused only for the same training step on the same machine: the model's
fingerprint (module tree, parameter shapes and dtypes, class sources or structure), which
parameters train (``requires_grad``: LoRA freezes most, which changes every peak), the
``training`` flag, the example batch's tensor shapes, dtypes and devices (other leaves by value),
the budget as given (``"70%"`` means 70% of this step's own peak), the reserve and planner, the
loss function's identity (qualified name and bytecode), the optimizer (class, defaults, groups:
its state is part of the peak), the device (with the CUDA device name), and the torch and remat
versions. The key is the sha256 of all of that as JSON; the file name is the key, and the file
is a plain ``plan.json`` read through the hardened loader, its fingerprint checked again by
``remat.apply`` before anything is wrapped. A key that differs in any part re-plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import PlanError, RematError
from ..plan import Plan

ENV_VAR = "REMAT_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$REMAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/remat``, else ``~/.cache/remat``."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "remat"


def code_identity(fn: Any) -> str:
    """Qualified name + bytecode digest of a loss function (a lambda's name says nothing)."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    if code is None:
        return name
    h = hashlib.sha256(code.co_code)
    h.update(repr((code.co_names, [c for c in code.co_consts if not hasattr(c, "co_code")])).encode())
    return f"{name}:{h.hexdigest()[:16]}"


def device_identity(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheKey:
    """Everything a cached plan depends on (NOTE [plan cache key])."""

    fingerprint: str
    trainable: str                 # sha256 of the requires_grad pattern over model.parameters()
    training: bool
    batch: list[Any]
    budget: str
    reserve: float
    planner: str
    segments: bool                 # segment candidates offered (NOTE [segments])
    loss: str
    optimizer: list[Any]
    device: str
    torch_version: str
    remat_version: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str).encode()).hexdigest()


class PlanCache:
    """``<dir>/plans/<key>.json``; a corrupt or foreign file is a miss (it is re-planned and replaced)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: CacheKey) -> Path:
        return self.root / "plans" / f"{key.digest}.json"

    def load(self, key: CacheKey) -> Plan | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return Plan.load(path)
        except (PlanError, RematError):
            return None

    def store(self, key: CacheKey, plan: Plan) -> Path:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return plan.save(path)
