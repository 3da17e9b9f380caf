"""Pricing activation offload (NOTE [offload cost model]): what an OFFLOAD boundary saves and costs.

Pure (no torch): the bandwidths come from ``remat.measure.bandwidth`` (measured once per
machine and cached) or from a device model (``remat.simulate``).

NOTE [offload cost model]
An OFFLOAD boundary (NOTE [activation offload] in remat/wrap/offload.py) is priced from the
profiled FULL checkpoint of the same module, because both free the same activations between
the region's forward and its backward:
- device bytes saved: ``saved_bytes[FULL]`` (the activations; the region's input, which a
  checkpoint keeps, is also packed by offload but usually still referenced by the module
  before, so it is not counted as freed: an under-estimate the closed loop corrects);
- extra bytes while its backward runs: 0 (the activations are back, as in the unplanned
  step; no forward transients, nothing is recomputed);
- bytes copied each way, and held in host memory: ``saved_bytes[FULL] + input_bytes +
  saved_input_bytes``: everything an op inside the region saves, the region's own inputs that an
  op inside saves included (allocated before the region, so no checkpoint figure counts them;
  the profile records them so the host budget bounds what the pool really holds);
- added time: ``copy_ms = bytes / d2h + bytes / h2d`` (ms, from the measured bandwidths, in
  bytes per ms), less what overlaps compute. On CUDA the device-to-host copy runs on a side
  stream while the forward goes on, so up to the region's own forward time (``fwd_ms``, from
  the profile) of it is hidden; the host-to-device copy starts when backward reaches the
  region, so it is priced in full (exposed). On CPU nothing overlaps (the copy is a clone on
  the same cores): the whole ``copy_ms`` is added.
A *segment* is never OFFLOADed (that would be offloading each of its members, which the
planner can already do); it may instead keep its input on the host while it waits for its
replay (mode FULL_HOST_INPUT, NOTE [segment input on the host] in remat/wrap/offload.py). It is
priced from the segment's FULL checkpoint and the profiled freed input (``host_input_bytes``,
NOTE [segment input freed] in remat/profile/step.py), and offered only where that is > 0:
- device bytes saved: ``saved_bytes[FULL] + host_input_bytes`` (the segment's whole FULL saving,
  plus the input a FULL checkpoint keeps);
- extra bytes while it replays: FULL's (the replay loads the input back where FULL held it);
- bytes copied each way and held in host memory: ``host_input_bytes``;
- added time: FULL's replay plus ``copy_ms`` of those bytes, none of it counted as hidden (the
  copy to the host starts after the segment's forward, beside whatever runs next, which the
  profile does not price; the copy back is prefetched when backward reaches the segment).
A host budget (bytes) bounds the sum of host bytes over the offloaded boundaries (both modes);
the planner chooses keep / recompute / offload per boundary under the peak budget, and the
closed loop measures the result as for any plan.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from .._codec import Bytes, JsonCodec, Short, json_field
from .._json import Num
from ..errors import PlanError
from ..profile.model import CandidateCost, ProfileReport
from ..types import CheckpointMode


Bandwidth = Annotated[float, Num(1e-9, 1e15)]   # bytes per ms: a positive rate, bounded


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPricing(JsonCodec):
    """Link bandwidths and overlap, as measured on (or modelled for) one machine."""

    d2h_bytes_per_ms: Bandwidth    # device -> host copy bandwidth (bytes per ms)
    h2d_bytes_per_ms: Bandwidth    # host -> device (bytes per ms)
    overlaps_compute: bool         # copies run beside compute (CUDA side stream); False on CPU
    # host memory the offloaded activations may hold (None: no bound); in every file, as is the source
    host_budget_bytes: Bytes | None = json_field(default=None, required=True)
    # "measured" (remat.measure.bandwidth), "cached", or a device model's name
    source: Short = json_field(default="measured", required=True)

    def __post_init__(self) -> None:
        if not (self.d2h_bytes_per_ms > 0 and self.h2d_bytes_per_ms > 0):
            raise PlanError(f"offload bandwidths must be positive, got d2h {self.d2h_bytes_per_ms} and "
                            f"h2d {self.h2d_bytes_per_ms} bytes/ms")
        if self.host_budget_bytes is not None and self.host_budget_bytes < 0:
            raise PlanError(f"host budget must be >= 0 bytes, got {self.host_budget_bytes}")

    def added_ms(self, copied_bytes: int, fwd_ms: float) -> float:
        """Added step time of offloading ``copied_bytes`` around a region of forward time ``fwd_ms`` (ms)."""
        d2h = copied_bytes / self.d2h_bytes_per_ms
        h2d = copied_bytes / self.h2d_bytes_per_ms
        hidden = min(d2h, max(0.0, fwd_ms)) if self.overlaps_compute else 0.0
        return d2h - hidden + h2d


def offload_bytes(c: CandidateCost) -> int:
    """Bytes an OFFLOAD boundary copies each way and holds in host memory (NOTE [offload cost model])."""
    return int(c.saved_bytes[CheckpointMode.FULL]) + int(c.input_bytes) + int(c.saved_input_bytes)


def host_bytes(c: CandidateCost, mode: CheckpointMode) -> int:
    """Bytes ``c`` holds in host memory in ``mode`` (NOTE [offload cost model]): 0 but in a host mode."""
    if mode is CheckpointMode.OFFLOAD:
        return offload_bytes(c)
    if mode is CheckpointMode.FULL_HOST_INPUT:
        return int(c.host_input_bytes)
    return 0


def can_host_input(c: CandidateCost) -> bool:
    """A segment with a measured FULL checkpoint whose input the recorded step shows freed
    (NOTE [segment input freed] in remat/profile/step.py)."""
    return bool(c.members) and CheckpointMode.FULL in c.saved_bytes and CheckpointMode.FULL in c.replay_ms \
        and c.host_input_bytes > 0


def can_offload(c: CandidateCost) -> bool:
    """A module candidate with a measured FULL checkpoint; a segment is never OFFLOADed (its input may go
    to the host instead: ``can_host_input``)."""
    return not c.members and CheckpointMode.FULL in c.saved_bytes and c.saved_bytes[CheckpointMode.FULL] > 0


def with_offload(report: ProfileReport, pricing: OffloadPricing) -> ProfileReport:
    """``report`` with an OFFLOAD mode priced on every module candidate that can be offloaded, and a
    FULL_HOST_INPUT mode on every segment whose input it frees (NOTE [offload cost model])."""
    def priced(c: CandidateCost) -> CandidateCost:
        if can_host_input(c):   # nothing of the input's copy counted as hidden (fwd_ms 0): NOTE above
            full, mode = CheckpointMode.FULL, CheckpointMode.FULL_HOST_INPUT
            return dataclasses.replace(
                c, saved_bytes={**c.saved_bytes, mode: int(c.saved_bytes[full]) + c.host_input_bytes},
                replay_ms={**c.replay_ms, mode: float(c.replay_ms[full]) + pricing.added_ms(c.host_input_bytes, 0.0)},
                replay_extra_bytes={**c.replay_extra_bytes, mode: int(c.replay_extra_bytes.get(full, 0))})
        if not can_offload(c):
            return c
        moved = offload_bytes(c)
        return dataclasses.replace(
            c, saved_bytes={**c.saved_bytes, CheckpointMode.OFFLOAD: int(c.saved_bytes[CheckpointMode.FULL])},
            replay_ms={**c.replay_ms, CheckpointMode.OFFLOAD: pricing.added_ms(moved, c.fwd_ms)},
            replay_extra_bytes={**c.replay_extra_bytes, CheckpointMode.OFFLOAD: 0})
    return dataclasses.replace(report, candidates=[priced(c) for c in report.candidates])


def measured_pricing(device: str, *, host_budget_bytes: int | None = None,
                     cache_dir: str | None = None) -> OffloadPricing:
    """Offload priced from this machine's measured link bandwidth for ``device`` (NOTE [link bandwidth]
    in remat/measure/bandwidth.py; measured once, then cached). Loads torch on first use."""
    from ..measure.bandwidth import link_bandwidth
    bw = link_bandwidth(device, cache_dir=cache_dir)
    return OffloadPricing(d2h_bytes_per_ms=bw.d2h_bytes_per_ms, h2d_bytes_per_ms=bw.h2d_bytes_per_ms,
                          overlaps_compute=bw.device.startswith("cuda"), host_budget_bytes=host_budget_bytes,
                          source="cached" if bw.cached else "measured")


def modelled_pricing(target_device: str, *, host_budget_bytes: int | None = None) -> OffloadPricing:
    """Offload priced from a named device model's host link (``--simulate --target-device``)."""
    from ..simulate import get_device_model
    model = get_device_model(target_device)
    per_ms = model.host_link / 1e3   # bytes/s -> bytes per ms
    return OffloadPricing(d2h_bytes_per_ms=per_ms, h2d_bytes_per_ms=per_ms,
                          overlaps_compute=model.name != "cpu", host_budget_bytes=host_budget_bytes,
                          source=f"device model {model.name}")
