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
accumulation (NOTE [accumulated step]: above 1 the gradients are alive in the forward), whether offload is
offered and under which host budget (NOTE [auto offload]: it changes which boundaries a plan may use), the device (with the CUDA
device name), the torch and remat versions, and for a wrapped model the job's world size and engine
(DDP, FSDP2). The key is the sha256 of all of that as JSON; the file name is the key, and the
file is a plain ``plan.json`` read through the hardened loader. A key that differs in any part
re-plans. The cache never stops ``remat.auto``: an entry that fails to load, or to apply to this
model (a foreign plan, ``FingerprintMismatch``, ``CandidateError``), is a miss with a
:class:`BrokenCacheEntryWarning` naming the file, re-planned and replaced; a cache directory that
cannot be written (read-only, a file where the directory should be, a full disk) is an
:class:`UnusableCacheDirWarning`, any other error while storing a :class:`PlanCacheWarning`, and the new
plan is applied all the same (``cache: not-stored``): storing is a convenience for the next call, so
nothing it meets may cost the user the plan this call already made.

NOTE [cache hit re-validated]
The file name binds an entry to its key, but the file is data anyone with write access to the
directory can replace (an old remat, a copy from another machine, a hand edit, a poisoned entry).
A hit is therefore checked against what the key says before it is applied (``stale_entry``): the
entry's fingerprint is the key's (not only one ``apply`` would tolerate), its reserve is the key's,
its offload is the key's (none for a recompute-only call, the key's host budget otherwise), its budget in bytes is what the key's budget gives (``"70%"`` of the entry's own unplanned peak, an
amount exactly, the stated capacity, or the free memory to the key's 256 MiB), its figures are a
measured run on this kind of device (not simulated; a CUDA plan's from the CUDA allocator), they fit
that budget (the measured peak, else the predicted one), and an entry with no boundary records an
unplanned step that fits it. Any failure is a miss with a :class:`StaleCacheEntryWarning` naming the file and the
figure that disagrees; the entry is re-planned and replaced, never applied with its old figures. What
this cannot catch is an entry forged consistent in every figure: only re-measuring would, and a hit
exists to skip that.
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
from ..errors import BudgetError, OutputError
from ..plan import Plan, PlannerSpec, parse_budget
from ..types import CheckpointMode, MemorySource
from .inplace import JobEngine


class PlanCacheWarning(UserWarning):
    """The plan cache could not be used as it is; ``remat.auto`` planned and applied all the same."""


class BrokenCacheEntryWarning(PlanCacheWarning):
    """A cached plan failed to load or to apply to this model: a miss, re-planned and replaced."""


class StaleCacheEntryWarning(BrokenCacheEntryWarning):
    """A cached plan loads, but its figures disagree with its key (another budget's plan, no boundary for
    a step that needs some, another model's fingerprint): a miss (NOTE [cache hit re-validated])."""


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
    planner: PlannerSpec           # in the digest as its text
    segments: bool                 # segment candidates offered (NOTE [segments])
    loss: str                      # qualified name : sha256 of its stable digest (code, defaults, closure)
    optimizer: list[Any]
    device: str
    torch_version: str
    remat_version: str
    world_size: int = 1            # a job's plan is the job's (NOTE [one plan per job])
    engine: JobEngine = JobEngine.NONE   # how the model is wrapped (its value in the digest)
    autocast: str | None = None    # the step's autocast dtype (NOTE [autocast steps]): it changes every peak
    accumulation_steps: int = 1    # above 1 the step runs with gradients alive (NOTE [accumulated step])
    offload_host_budget_bytes: int | None = None   # offload offered under this host budget; None: recompute only

    @property
    def digest(self) -> str:
        fields = dataclasses.asdict(self) | {"planner": str(self.planner)}   # its text, as when it was held
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


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
        # the hardened loader raises PlanError for every unreadable file; anything else it met is still
        # only a miss (the cache never stops a run), named in the warning
        except Exception as exc:
            self.reject(key, exc)
            return None

    def reject(self, key: CacheKey, exc: Exception) -> None:
        """Warn that the entry for ``key`` cannot be used (``exc`` says why); the caller re-plans and replaces it."""
        warnings.warn(BrokenCacheEntryWarning(
            f"remat.auto: the cached plan {self.path(key)} cannot be used ({type(exc).__name__}: "
            f"{_first_line(exc)}); it is re-planned and replaced"), stacklevel=2)

    def reject_stale(self, key: CacheKey, why: str) -> None:
        """Warn that the entry for ``key`` disagrees with its key (``why``: the figure); it is re-planned and replaced."""
        warnings.warn(StaleCacheEntryWarning(
            f"remat.auto: the cached plan {self.path(key)} is not a plan for this call ({why}); it is a miss, "
            "re-planned and replaced (NOTE [cache hit re-validated])"), stacklevel=2)

    def store(self, key: CacheKey, plan: Plan) -> Path | None:
        """Write ``plan`` for ``key`` (atomically); None, with a warning, where it cannot be stored.

        Never raises an Exception (NOTE [plan cache key]): the atomic write turns an OSError into an
        OutputError (a full disk: ENOSPC), and the directory's own errors are OSErrors; both are an
        :class:`UnusableCacheDirWarning`. Anything else is a :class:`PlanCacheWarning` naming it."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return plan.save(path)
        except (OSError, OutputError) as exc:
            why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else _first_line(exc)
            warnings.warn(UnusableCacheDirWarning(
                f"remat.auto: cannot write the plan cache {self.root} ({type(exc).__name__}: "
                f"{why}); the plan is applied but not cached: free some space, pass cache_dir= a writable "
                f"directory, or use_cache=False"), stacklevel=2)
        except Exception as exc:   # the plan this call made is worth more than the cache: never lose it
            warnings.warn(PlanCacheWarning(
                f"remat.auto: storing the plan in the cache {self.root} failed ({type(exc).__name__}: "
                f"{_first_line(exc)}); the plan is applied but not cached"), stacklevel=2)
        return None


_CPU_SOURCES = (MemorySource.CPU_ALLOCATOR, MemorySource.CPU_LIVE_TENSORS, MemorySource.CPU_PROFILER)


def stale_entry(plan: Plan, key: CacheKey, *, budget: str | int | None, capacity_bytes: int | None,
                capacity_stated: bool, device_type: str, job: bool) -> str | None:
    """Why the cached ``plan`` is not a plan for ``key`` (NOTE [cache hit re-validated]); None when it is.

    ``budget``: the call's, as given; ``capacity_bytes``: the device's (stated with ``device_memory=``
    when ``capacity_stated``, else its free memory), None without one; ``job``: the ranks of a job
    planned together, whose budget is the smallest rank's (at most this rank's)."""
    if plan.fingerprint.digest != key.fingerprint:
        return (f"its model fingerprint {plan.fingerprint.digest[:12]}... is not this model's "
                f"{key.fingerprint[:12]}...")
    if plan.reserve != key.reserve:
        return f"its reserve {plan.reserve:g} is not the call's {key.reserve:g}"
    if plan.simulated or plan.memory_source is MemorySource.SIMULATED:
        return "its figures are simulated, and remat.auto plans from a measured step"
    expected_sources = (MemorySource.CUDA_ALLOCATOR,) if device_type == "cuda" else _CPU_SOURCES
    if plan.memory_source not in expected_sources:
        return f"its figures come from {plan.memory_source}, not an instrument of a {device_type} device"
    if plan.budget_bytes is None:
        return "it has no budget"
    why = _offload_mismatch(plan, key.offload_host_budget_bytes)
    if why is not None:
        return why
    expected = _expected_budget(plan, budget, capacity_bytes, capacity_stated)
    if expected is not None:
        low, high = expected
        if job:     # the job plans for its smallest rank's budget (NOTE [one plan per job])
            low = 1
        if not low <= plan.budget_bytes <= high:
            want = f"{low} bytes" if low == high else f"{low} to {high} bytes"
            return (f"its budget is {plan.budget_bytes} bytes, and the call's budget "
                    f"{'the device' if budget is None else repr(budget)} is {want} for it")
    # the peak it claims: measured where the closed loop measured it (a fallback family ships on its
    # measured peak alone: NOTE [closed loop fallbacks]), else predicted
    claimed = plan.measured_peak_bytes if plan.measured_peak_bytes is not None else plan.predicted_peak_bytes
    if claimed > plan.budget_bytes:
        return f"the peak it records, {claimed} bytes, is over its budget of {plan.budget_bytes} bytes"
    if not plan.boundaries and plan.baseline_peak_bytes > plan.budget_bytes:
        return (f"it checkpoints nothing, and the unplanned step it records peaks at {plan.baseline_peak_bytes} "
                f"bytes, over its budget of {plan.budget_bytes} bytes")
    return None


def _offload_mismatch(plan: Plan, host_budget_bytes: int | None) -> str | None:
    """Why ``plan``'s offload is not what the key offers (NOTE [auto offload]); None when it is."""
    offloads = sum(b.mode.holds_host for b in plan.boundaries)
    if host_budget_bytes is None:
        if offloads or plan.offload is not None:
            return f"it offloads ({offloads} boundaries), and the call plans recompute only (offload=False)"
        return None
    if plan.offload is None:
        return "it was planned without offload, and the call offers offload"
    if plan.offload.host_budget_bytes != host_budget_bytes:
        return (f"its host budget is {plan.offload.host_budget_bytes} bytes, and the call's is "
                f"{host_budget_bytes} bytes")
    return None


def _expected_budget(plan: Plan, budget: str | int | None, capacity_bytes: int | None,
                     capacity_stated: bool) -> tuple[int, int] | None:
    """The budget in bytes (low, high) the key's budget gives for ``plan``; None where it cannot be told
    (a malformed budget never reaches the cache: the call refuses it first)."""
    if budget is None:
        if capacity_bytes is None:
            return None
        if capacity_stated:
            return capacity_bytes, capacity_bytes
        bucket = capacity_bytes >> 28 << 28   # the key holds the free memory to 256 MiB (_capacity_key)
        return bucket, bucket + (1 << 28) - 1
    try:
        exact = parse_budget(budget, plan.baseline_peak_bytes)
    except BudgetError:
        return None
    return exact, exact


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
