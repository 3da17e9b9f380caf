"""What ``remat.auto`` decided and measured: ``handle.report``."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from .._codec import JsonCodec
from ..plan.offload import OffloadPricing
from ..types import CheckpointMode, MemorySource
from ..wrap import ApplyHandle
from ..units import fmt_bytes
from ..plan.model import SmallBoundaries
from ..plan.spec import PlannerText
from ..plan.timing import TimeRace
from ..profile.blocked import BlockedStep
from .inplace import JobEngine
from .shapes import ShapeEnvelope, ShapeGuard


class CacheStatus(enum.Enum):
    HIT = "hit"              # the plan came from the cache: nothing was profiled
    STORED = "stored"        # planned now and written to the cache
    NOT_STORED = "not-stored"  # planned now; the cache directory could not be written (UnusableCacheDirWarning)
    DISABLED = "disabled"    # use_cache=False


class VerifyStatus(enum.Enum):
    NOT_VERIFIED = "not-verified"
    PASSED = "passed"        # verify="quick": one seed, one step, paired control on a copy, negative controls


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoReport(JsonCodec):
    """Predicted and measured figures of the plan ``remat.auto`` applied (bytes, ms).

    Peaks are whole training steps (batch, forward, backward, optimizer step with its state),
    measured on a copy by ``memory_source`` (``cuda-allocator`` or ``cpu-live-tensors``). In a job
    (``engine`` ddp or fsdp2, ``world_size`` > 1) they are per device, measured on the wrapped model
    itself on every rank and reduced over the ranks (the fullest rank's; NOTE [one plan per job]),
    and ``budget_bytes`` is the smallest rank's budget."""

    plan_digest: str                     # sha256 of the applied plan's JSON: equal on every rank of a job
    world_size: int                      # 1: one process
    engine: JobEngine                    # none, ddp, fsdp2

    planner: PlannerText                 # the spec the plan came from; its JSON is the text
    boundaries: tuple[str, ...]          # "module path (mode)"
    budget: str                          # as given: "8GiB", "70%"
    budget_bytes: int
    effective_budget_bytes: int          # budget less the reserve: what the peak must stay under
    baseline_peak_bytes: int             # the unplanned step, measured
    predicted_peak_bytes: int
    measured_peak_bytes: int | None      # the planned step on a fresh copy, measured
    memory_source: MemorySource
    baseline_step_ms: float              # warm p50 of the unplanned step (profile)
    measured_step_ms: float | None       # warm p50 of the planned step (closed loop; not interleaved: NOTE [auto overhead])
    predicted_overhead_ms: float
    optimizer: str                       # what the peak counted (OptimizerSpec.describe)
    optimizer_assumed: bool
    cache: CacheStatus
    cache_path: str | None
    verification: VerifyStatus
    verify_note: str
    seconds: float                       # wall time of the remat.auto call
    autocast: str | None = None          # "bfloat16"/"float16": planned (and verified) with the forward under autocast
    tolerances: dict[str, Any] = dataclasses.field(default_factory=dict)  # dtype -> Tolerance verify compares with
    accumulation_steps: int = 1          # micro-batches per optimizer step the peaks are of (NOTE [accumulated step])
    device_memory_bytes: int | None = None   # the device capacity planned for (NOTE [device capacity]); None: none known
    blocked: BlockedStep | None = None   # the unplanned step did not fit: its evidence and how it was planned
    # the plan timed against the fastest simple plan that fits, and which shipped (NOTE [time race] in
    # remat/closed_loop.py); None: not raced
    time_race: TimeRace | None = None
    # the candidates the plan was searched without as saving too little (NOTE [small boundaries] in
    # remat/plan/planners.py); None: none was small
    small_boundaries: SmallBoundaries | None = None
    # offload offered (NOTE [auto offload]): the measured link bandwidths and host budget the plan was priced with
    offload: OffloadPricing | None = None

    @property
    def predicted_overhead(self) -> float:
        """Predicted added step time over the unplanned step's (0.12 = 12% slower): the planned
        boundaries' replay costs, each measured alone (NOTE [measured replay costs] in
        remat/profile/replay.py), over the profiled step. NOTE [auto overhead]"""
        return self.predicted_overhead_ms / self.baseline_step_ms if self.baseline_step_ms > 0 else 0.0

    def summary(self) -> str:
        """A few lines for a log: the plan, the peaks against the budget, the overhead, verification, cache.

        NOTE [auto overhead]
        ``remat.auto`` times the planned step once on a fresh copy (the closed loop's check that
        it fits), not interleaved with the unplanned step: on a shared machine the two figures
        drift apart by more than a plan's overhead (+184% reported where the interleaved
        overhead was +14%). So the summary prints the overhead as *predicted*, and the planned
        step's time as what it is, one non-interleaved run, never divided by the baseline;
        ``remat frontier`` measures the overhead interleaved, with its interval.
        """
        measured = "not measured" if self.measured_peak_bytes is None else fmt_bytes(self.measured_peak_bytes)
        planned = ("" if self.measured_step_ms is None else
                   f"; planned step {self.measured_step_ms:.1f} ms on a fresh copy (one run, not interleaved: "
                   "not an overhead)")
        lines = [
            f"remat: {len(self.boundaries)} boundaries ({self.planner}): {', '.join(self.boundaries) or 'none'}",
            f"  peak: {fmt_bytes(self.baseline_peak_bytes)} unplanned -> predicted {fmt_bytes(self.predicted_peak_bytes)}, "
            f"measured {measured} ({self.memory_source}); budget {self.budget} = {fmt_bytes(self.budget_bytes)}",
            f"  step: {self.baseline_step_ms:.1f} ms unplanned, overhead {self.predicted_overhead * 100:+.1f}% predicted "
            f"(+{self.predicted_overhead_ms:.2f} ms of replays){planned}; optimizer counted: {self.optimizer}"
            + (f"; forward under autocast {self.autocast}" if self.autocast else "")
            + (f"; accumulated over {self.accumulation_steps} micro-batches (peaks with their gradients alive)"
               if self.accumulation_steps > 1 else ""),
            f"  {self.verify_note}; plan cache: {self.cache.value}" + (f" ({self.cache_path})" if self.cache_path else ""),
        ]
        if self.time_race is not None:
            lines.append(f"  time race: {self.time_race.describe()}")
        if self.small_boundaries is not None:
            lines.append(f"  small boundaries: {self.small_boundaries.describe()}")
        if self.device_memory_bytes is not None:
            lines.append(f"  device capacity {fmt_bytes(self.device_memory_bytes)}"
                         + (f"; blocked: {self.blocked.describe()}" if self.blocked is not None else ""))
        if self.offload is not None:
            o = self.offload
            offloaded = sum(b.endswith(f"({CheckpointMode.OFFLOAD.value})") for b in self.boundaries)
            inputs = sum(b.endswith(f"({CheckpointMode.FULL_HOST_INPUT.value})") for b in self.boundaries)
            budget = "no bound" if o.host_budget_bytes is None else fmt_bytes(o.host_budget_bytes)
            held = f", {inputs} segment inputs on the host" if inputs else ""
            lines.append(f"  offload: {offloaded} boundaries offloaded{held}; host budget {budget}; copies priced at "
                         f"{o.d2h_bytes_per_ms / 1e6:.2f} GB/s to the host, {o.h2d_bytes_per_ms / 1e6:.2f} GB/s back "
                         f"({o.source})")
        if self.engine is not JobEngine.NONE:
            lines.append(f"  job: {self.engine.value} x {self.world_size} ranks, one plan (digest {self.plan_digest[:12]}); "
                         "peaks per device, the fullest rank's")
        return "\n".join(lines)


class AutoHandle(ApplyHandle):
    """``remat.auto``'s handle: ``remat.apply``'s (``.plan``, ``.remove()``) with ``.report``, and the
    shape guard (NOTE [shape guard]): ``.planned_shapes``, ``.replans``; ``remove()`` takes the guard off too."""

    def __init__(self, handle: ApplyHandle, report: AutoReport) -> None:
        super().__init__(handle.model, handle.plan, handle.wrappers, host_pool=handle.host_pool)
        self.report = report
        self.guard: ShapeGuard | None = None   # set by remat.auto once the plan is applied
        self.replans = 0                        # plans applied since the first (on_new_shape='replan')

    @property
    def planned_shapes(self) -> ShapeEnvelope | None:
        """Per tensor rank, the largest size planned for in each dimension; None without a guard."""
        return None if self.guard is None else self.guard.envelope

    def unwrap(self) -> None:
        """Remove the plan's wrappers and keep the guard: a new plan is applied next (``replace``)."""
        ApplyHandle.remove(self)

    def replace(self, handle: ApplyHandle, report: AutoReport | None = None) -> None:
        """Take over ``handle``'s wrappers (a plan just applied to this model); ``report`` is the new plan's."""
        self.plan, self.wrappers, self._active = handle.plan, handle.wrappers, True
        self.host_pool = handle.host_pool   # its offload boundaries' (NOTE [host buffer pool] in remat/wrap/offload.py)
        if report is not None:
            self.report = report
            self.replans += 1

    def remove(self, *, force: bool = False) -> None:
        super().remove(force=force)
        if self.guard is not None:
            self.guard.remove()
            self.guard = None

    def __repr__(self) -> str:
        return f"Auto{super().__repr__()}"
