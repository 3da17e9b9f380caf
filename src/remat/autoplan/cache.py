"""The plan cache of ``remat.auto``: one ``plan.json`` per key, in ``~/.cache/remat/plans``.

NOTE [plan cache key]
A cached plan is reused only for the same training step on the same machine: the model's
fingerprint (module tree, parameter shapes and dtypes, class sources or structure), the model's
*state* (every module's non-tensor attributes, ``training`` flags, buffer shapes and dtypes, a
Hugging Face config's ``to_dict()`` and ``_attn_implementation``: NOTE [stable value digest]),
which parameters train (``requires_grad``: LoRA freezes most, which changes every peak), the
``training`` flag, the example batch's tensor shapes, dtypes and devices (other leaves by stable
value), the budget as given (``"70%"`` means 70% of this step's own peak), the reserve and
planner, the loss function (qualified name, bytecode, defaults, closure values; a
``functools.partial`` by its function, arguments and keywords), the optimizer (class, defaults,
groups: its state is part of the peak), the autocast dtype the step runs under, the gradient
accumulation (NOTE [accumulated step]: above 1 the gradients are alive in the forward), the device (with the CUDA
device name), the torch and remat versions, and for a wrapped model the job's world size and engine
(DDP, FSDP2). The key is the sha256 of all of that as JSON; the file name is the key, and the
file is a plain ``plan.json`` read through the hardened loader. A key that differs in any part
re-plans. The cache never stops ``remat.auto``: an entry that fails to load, or to apply to this
model (a foreign plan, ``FingerprintMismatch``, ``CandidateError``), is a miss with a
:class:`BrokenCacheEntryWarning` naming the file, re-planned and replaced; a cache directory that
cannot be written (read-only, a file where the directory should be) is an
:class:`UnusableCacheDirWarning`, and the new plan is applied all the same (``cache: not-stored``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .._io import CACHE_ENV_VAR as ENV_VAR, default_cache_dir
from ..errors import RematError
from ..plan import Plan


class PlanCacheWarning(UserWarning):
    """The plan cache could not be used as it is; ``remat.auto`` planned and applied all the same."""


class BrokenCacheEntryWarning(PlanCacheWarning):
    """A cached plan failed to load or to apply to this model: a miss, re-planned and replaced."""


class UnusableCacheDirWarning(PlanCacheWarning):
    """The cache directory cannot be written: the new plan is applied but not stored."""


def device_identity(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheKey:
    """Everything a cached plan depends on (NOTE [plan cache key])."""

    fingerprint: str
    state: str                     # sha256 of the modules' non-tensor state (NOTE [stable value digest])
    trainable: str                 # sha256 of the requires_grad pattern over model.parameters()
    training: bool
    batch: list[Any]
    budget: str
    reserve: float
    planner: str
    segments: bool                 # segment candidates offered (NOTE [segments])
    loss: str                      # qualified name : sha256 of its stable digest (code, defaults, closure)
    optimizer: list[Any]
    device: str
    torch_version: str
    remat_version: str
    world_size: int = 1            # a job's plan is the job's (NOTE [one plan per job])
    engine: str = "none"           # JobEngine: how the model is wrapped (none, ddp, fsdp2)
    autocast: str | None = None    # the step's autocast dtype (NOTE [autocast steps]): it changes every peak
    accumulation_steps: int = 1    # above 1 the step runs with gradients alive (NOTE [accumulated step])

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str).encode()).hexdigest()


class PlanCache:
    """``<dir>/plans/<key>.json``. Never fatal (NOTE [plan cache key]): a broken entry is a miss
    (warned, then replaced), an unwritable directory a warning."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: CacheKey) -> Path:
        return self.root / "plans" / f"{key.digest}.json"

    def load(self, key: CacheKey) -> Plan | None:
        """The cached plan; None on a miss, and for an entry that cannot be read (warned: it is replaced)."""
        path = self.path(key)
        try:
            present = path.is_file()
        except OSError:                # a directory that cannot be searched: a miss, and ``store`` says why
            return None
        if not present:
            return None
        try:
            return Plan.load(path)
        except RematError as exc:      # the hardened loader raises PlanError for every unreadable file
            self.reject(key, exc)
            return None

    def reject(self, key: CacheKey, exc: Exception) -> None:
        """Warn that the entry for ``key`` cannot be used (``exc`` says why); the caller re-plans and replaces it."""
        warnings.warn(BrokenCacheEntryWarning(
            f"remat.auto: the cached plan {self.path(key)} cannot be used ({type(exc).__name__}: "
            f"{_first_line(exc)}); it is re-planned and replaced"), stacklevel=2)

    def store(self, key: CacheKey, plan: Plan) -> Path | None:
        """Write ``plan`` for ``key`` (atomically); None, with a warning, where the directory cannot take it."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return plan.save(path)
        except OSError as exc:
            warnings.warn(UnusableCacheDirWarning(
                f"remat.auto: cannot write the plan cache {self.root} ({type(exc).__name__}: "
                f"{exc.strerror or exc}); the plan is applied but not cached: pass cache_dir= a writable "
                f"directory, or use_cache=False"), stacklevel=2)
            return None


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
