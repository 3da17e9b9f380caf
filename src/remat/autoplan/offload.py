"""``remat.auto(offload=...)``: the host budget it plans activation offload under, and its pricing.

NOTE [auto offload]
``remat.auto`` plans keep / recompute / offload per boundary exactly as ``remat plan --offload``
does (NOTE [offload cost model] in remat/plan/offload.py; the closed loop then measures the plan
and ``verify="quick"`` proves it bitwise, as for any plan). ``offload`` takes:
- ``False`` (the default) or ``None``: recompute only, no OFFLOAD boundary.
- an amount, ``"16GiB"`` or bytes: the host budget, the most host memory the offloaded
  activations may hold at once (a share such as ``"50%"`` is refused: of what?).
- ``True``: a default host budget, half of this machine's physical memory
  (``os.sysconf``: ``SC_PHYS_PAGES x SC_PAGE_SIZE``). Half, because the host also holds the
  data loader's workers, the process itself and, on CUDA, the pinned pool torch keeps
  (NOTE [host buffer pool] in remat/wrap/offload.py never holds more than the offload's own
  peak); physical rather than free memory, because free memory moves from call to call and the
  host budget is part of the plan cache key (NOTE [plan cache key]): a key that moved would
  never hit. ``AutoReport.offload.host_budget_bytes`` says which figure was used.
The copies are priced from this machine's measured device <-> host bandwidth (NOTE [link
bandwidth], measured once and cached in the cache folder); in a job every rank prices with rank
0's measurement, so the ranks plan alike (NOTE [one plan per job]): a rank-local measurement
must never steer one rank's plan away from the others'. On the CPU the offload is simulated
exactly (NOTE [activation offload]): the copies are real, so their cost is; the host and the
device are the same memory there, so the bytes it saves are real only on an accelerator.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import AutoError, BudgetError
from ..plan import OffloadPricing, check_budget_syntax, parse_budget
from ..plan.offload import measured_pricing
from .ranks import JobRanks

_DEFAULT_HOST_SHARE = 0.5   # of physical memory, for offload=True (NOTE [auto offload])


def host_budget_of(offload: object) -> int | None:
    """The host budget (bytes) ``offload`` asks for; None: no offload (NOTE [auto offload]). AutoError when malformed."""
    if offload is None or offload is False:
        return None
    if offload is True:
        return default_host_budget()
    if not isinstance(offload, (str, int)) or isinstance(offload, bool):
        raise AutoError(f"offload={offload!r}: expected True, False, or a host budget (bytes, or \"16GiB\")",
                        tip="pass offload=True for the default host budget, or offload=\"16GiB\"")
    if isinstance(offload, str) and offload.strip().endswith("%"):
        raise AutoError(f"offload={offload!r}: a host budget is an amount (bytes, or \"16GiB\"), not a share",
                        tip="e.g. offload=\"16GiB\", or offload=True for half of this machine's memory")
    try:
        check_budget_syntax(offload)
        return parse_budget(offload, 1)
    except BudgetError as exc:
        raise AutoError(f"offload={offload!r}: {exc.message.replace('budget', 'host budget')}",
                        tip="bytes, or an amount with its unit: offload=\"16GiB\"") from None


def default_host_budget() -> int:
    """Half of this machine's physical memory (bytes): ``offload=True`` (NOTE [auto offload])."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        total = -1
    if total <= 0:
        raise AutoError("offload=True: this system does not report its physical memory, so there is no default "
                        "host budget", tip="state one: offload=\"16GiB\"")
    return int(total * _DEFAULT_HOST_SHARE)


def offload_pricing(device: torch.device, host_budget_bytes: int | None, *, cache_dir: str | Path | None,
                    ranks: JobRanks | None) -> OffloadPricing | None:
    """Offload priced from this machine's measured link (NOTE [link bandwidth]), rank 0's in a job; None without offload."""
    if host_budget_bytes is None:
        return None
    if ranks is None:
        return measured_pricing(str(device), host_budget_bytes=host_budget_bytes, cache_dir=cache_dir)
    # rank 0 measures; every rank prices with its figures (NOTE [auto offload])
    mine = measured_pricing(str(device), host_budget_bytes=host_budget_bytes, cache_dir=cache_dir) \
        if ranks.rank == 0 else None
    return OffloadPricing.from_json(ranks.from_rank0(None if mine is None else mine.to_json()))
