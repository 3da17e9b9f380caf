"""Device <-> host copy bandwidth, measured once per machine and cached (NOTE [link bandwidth]).

NOTE [link bandwidth]
Activation offload (NOTE [offload cost model] in remat/plan/offload.py) is priced from the
bandwidth of the copies it makes, so it is *measured*, never a constant: a 64 MiB tensor
copied device -> pinned host and back, ``_ROUNDS`` times each after one warm-up copy, median
(``remat.clock``; on CUDA the clock synchronizes, NOTE [device-correct timing]). On CPU the
copies are the ones the offload mechanism makes (memory bandwidth of this machine): to the host
into a buffer the pool reuses (NOTE [host buffer pool] in remat/wrap/offload.py: no fresh pages
to fault in), and back as the clone ``unpack`` makes (fresh pages, so slower).
The result is cached in ``<cache dir>/bandwidth/<key>.json`` (the cache folder of
``remat._io.default_cache_dir``), keyed by the device's name, the torch version, the host
name and what was timed (``_PROBE_KIND``), so a machine measures once; an unreadable or
foreign entry is measured again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
from pathlib import Path

import torch

from .._io import atomic_write_json, default_cache_dir
from ..clock import StepClock
from ..percentile import p50

_PROBE_BYTES = 64 * 2 ** 20   # bytes per timed copy
_ROUNDS = 5
_PROBE_KIND = "pooled-host-copy"   # CPU: the copy into a reused host buffer, and the clone back


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkBandwidth:
    """Measured copy bandwidth between a device and host memory (bytes per ms)."""

    device: str                 # e.g. "cuda:NVIDIA H200" or "cpu"
    d2h_bytes_per_ms: float
    h2d_bytes_per_ms: float
    cached: bool = False        # read from the cache rather than measured in this process


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _cache_path(name: str, cache_dir: Path) -> Path:
    # _PROBE_KIND names what is timed: an entry timed another way is another key
    key = hashlib.sha256(f"{name}|{torch.__version__}|{platform.node()}|{_PROBE_KIND}".encode()).hexdigest()[:16]
    return cache_dir / "bandwidth" / f"{key}.json"


def _time_copies(copy, clock: StepClock) -> float:  # noqa: ANN001
    """Median ms of ``copy()`` over ``_ROUNDS`` timed calls after one warm-up."""
    copy()
    times = [clock.time(copy)[1] for _ in range(_ROUNDS)]
    return max(p50(times), 1e-6)


def _measure(device: torch.device) -> tuple[float, float]:
    n = _PROBE_BYTES // 4
    clock = StepClock(device)
    src = torch.ones(n, device=device)
    if device.type == "cuda":
        host = torch.empty(n, pin_memory=True)
        d2h = _time_copies(lambda: host.copy_(src, non_blocking=True), clock)
        h2d = _time_copies(lambda: src.copy_(host, non_blocking=True), clock)
    else:   # the copies the CPU offload path makes (NOTE [activation offload]): into a pooled host
        # buffer, reused (NOTE [host buffer pool] in remat/wrap/offload.py), and back as a fresh clone
        host = torch.empty_like(src)
        d2h = _time_copies(lambda: host.copy_(src), clock)
        h2d = _time_copies(lambda: host.clone(), clock)
    return _PROBE_BYTES / d2h, _PROBE_BYTES / h2d


def _read_cached(path: Path, name: str) -> LinkBandwidth | None:
    try:
        d = json.loads(path.read_text())
        if d.get("device") != name:
            return None
        return LinkBandwidth(device=name, d2h_bytes_per_ms=float(d["d2h_bytes_per_ms"]),
                             h2d_bytes_per_ms=float(d["h2d_bytes_per_ms"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def link_bandwidth(device: torch.device | str, *, cache_dir: Path | str | None = None,
                   use_cache: bool = True) -> LinkBandwidth:
    """This machine's device <-> host bandwidth for ``device`` (NOTE [link bandwidth])."""
    device = torch.device(device)
    name = _device_name(device)
    path = _cache_path(name, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    if use_cache:
        hit = _read_cached(path, name)
        if hit is not None and hit.d2h_bytes_per_ms > 0 and hit.h2d_bytes_per_ms > 0:
            return hit
    d2h, h2d = _measure(device)
    found = LinkBandwidth(device=name, d2h_bytes_per_ms=d2h, h2d_bytes_per_ms=h2d)
    if use_cache:
        try:
            atomic_write_json(path, {"device": name, "d2h_bytes_per_ms": d2h, "h2d_bytes_per_ms": h2d})
        except Exception:  # noqa: BLE001  an unusable cache only costs a re-measure next time
            pass
    return found
