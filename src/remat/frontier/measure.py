"""The frontier's measuring parts: remat.measure's arms and scheduler, with capacity probes as
:class:`CapacityTry` (the frontier's JSON type). Running and timing steps lives in remat.measure
(NOTE [interleaved timing], NOTE [solo peaks]); plans become arms through remat.wrap.PlanArm."""

from __future__ import annotations

from ..wrap import PlanArm, apply_at_shape
from ..measure import (Arm, PeakLimitExceeded, Prepared, Timings, measure_arm_peak, measure_step_peak_within,
                       percentile, prepare_arm, release_memory, shape_value, time_round_robin)
from ..measure import probe_capacity as _probe
from ..workload.loader import LoadedWorkload
from .model import CapacityTry

__all__ = ["Arm", "PeakLimitExceeded", "PlanArm", "Prepared", "Timings", "apply_at_shape", "measure_arm_peak",
           "measure_step_peak_within", "percentile", "prepare_arm", "probe_capacity", "release_memory",
           "shape_value", "time_round_robin"]


def probe_capacity(loaded: LoadedWorkload, arm: Arm, key: str, value: int, limit_bytes: int, *,
                   warmup: int = 1) -> CapacityTry:
    """remat.measure.probe_capacity, as the frontier's record of one capacity try."""
    r = _probe(loaded, arm, key, value, limit_bytes, warmup=warmup)
    return CapacityTry(value=r.value, peak_bytes=r.peak_bytes, oom=r.oom, error=r.error)
