"""Measuring arms: solo peaks, interleaved round-robin step times, and capacity probes.

An *arm* is one way of running the workload's step (a remat plan, or in
``benchmarks/compare.py`` a torch baseline such as ``checkpoint_sequential``). Each arm
prepares its own fresh build of the workload, so no two arms share a model, optimizer
state or wrapper.

NOTE [interleaved timing]
Step times on a shared machine drift (other jobs, thermal state, page cache). Timing
arm A for ten steps and then arm B for ten would charge the drift to whichever arm ran
during it. ``time_round_robin`` builds every arm first, then runs rounds; each round
runs one step of every arm, in an order rotated by one each round (so no arm always runs
first, right after the Python loop's bookkeeping). Warm-up rounds are not timed. Every
arm runs the same step indices, hence the same batches. On CUDA the clock is read after
``torch.cuda.synchronize()`` on both sides of the step. A time is the *whole* step:
batch, forward, backward, optimizer step and ``zero_grad``.

NOTE [solo peaks]
Peaks are measured with one arm resident at a time (``measure_arm_peak``: fresh build,
warm-up, one measured step), not inside the round-robin: on CUDA the allocator's peak is
process-wide, so other arms' resident parameters and optimizer state would inflate it;
on CPU the live-tensor tracker counts only what it is shown, so it would not matter, but
one code path for both devices keeps the figures comparable with ``remat plan``'s.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import statistics
import time
from typing import Any, Callable

import torch

from ..apply import apply
from ..errors import PlanError, RematError, WorkloadError
from ..memory.cuda import read_cuda_stats
from ..memory.measure import PeakMeasurement, measure_step_peak, model_device, track_step_state
from ..memory.tracker import LiveTensorTracker
from ..plan.model import Plan
from ..types import MemorySource, ProgressFn, no_progress
from ..workload.contract import TrainingStep
from ..workload.loader import LoadedWorkload, ShapeValue, _resolve_factory
from .model import CapacityTry

Undo = Callable[[], None]


# -- arms --------------------------------------------------------------------------------

class Arm:
    """One way of running the step. Override :meth:`prepare`; optionally :meth:`measure_peak`.

    ``prepare(fresh)`` changes a fresh build of the workload in place (wrap modules, swap
    the model) before its optimizer is made, and may return an undo callable.
    """

    def __init__(self, label: str) -> None:
        self.label = label

    def prepare(self, fresh: LoadedWorkload) -> Undo | None:
        return None

    def measure_peak(self, step: TrainingStep, step_index: int) -> PeakMeasurement:
        """Whole-step peak of one warm step (CUDA allocator, or the CPU live-tensor tracker)."""
        return measure_step_peak(step, step_index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"


class PlanArm(Arm):
    """A remat plan applied to the fresh build (NOTE [plans at other shapes])."""

    def __init__(self, label: str, plan: Plan) -> None:
        super().__init__(label)
        self.plan = plan
        self._checked = False   # the full fingerprint (with class sources) was checked once

    def prepare(self, fresh: LoadedWorkload) -> Undo | None:
        if not self.plan.boundaries:
            return None
        handle = apply_at_shape(fresh.workload.model, self.plan, full_check=not self._checked)
        self._checked = True
        return handle.remove


# NOTE [plans at other shapes]
# The capacity search rebuilds the workload at other values of a shape keyword and
# applies the *same* plan (same boundaries, same modes) to each build: the question is
# "which batch does this plan unlock", not "what would a re-plan at that batch choose".
# A plan's fingerprint covers module paths and classes, parameter names, shapes and
# dtypes, and class sources, so it does not change with batch size. A keyword that
# changes parameter shapes (gpt's ``seq_len`` sizes the position embedding ``wpe``)
# changes the digest; then the plan is re-applied *by module path* with the digest check
# off, but only after checking that the module tree (every path and its class) is the
# plan's, so every boundary names the same kind of module. A keyword that changes the
# module tree (e.g. ``n_layer``) raises PlanError, which the capacity search records as a
# stopping note. The first application of a plan (``full_check``) compares the whole
# fingerprint, class sources included; later rebuilds of the same workload in the same
# process reuse the same classes, so they compare only the module tree (hashing every
# class's source costs ~0.4 s a build on this CPU). The first application is the solo
# peak at the base shape, so a plan made for another model is still refused there, with
# ``FingerprintMismatch``.

def apply_at_shape(model: torch.nn.Module, plan: Plan, *, full_check: bool = True):  # noqa: ANN201 - ApplyHandle
    """Apply ``plan`` to a build of its workload (NOTE [plans at other shapes]).

    ``full_check=True``: the whole fingerprint must match (use it at the plan's own shape);
    otherwise only the module tree must, and parameter shapes may differ.
    """
    if full_check:
        return apply(model, plan)  # FingerprintMismatch lists what differs
    modules = tuple((name, type(m).__qualname__) for name, m in model.named_modules())
    if modules != tuple(plan.fingerprint.modules):
        diffs = [f"{n} ({c})" for n, c in sorted(set(modules) ^ set(plan.fingerprint.modules))][:6]
        raise PlanError(f"the module tree differs from the one the plan was made for: {', '.join(diffs)}")
    return apply(model, plan, check_fingerprint=False)


@dataclasses.dataclass
class Prepared:
    """An arm's fresh build, wrapped, with its own optimizer: ready to run steps."""

    arm: Arm
    loaded: LoadedWorkload
    step: TrainingStep
    undo: Undo | None

    def close(self) -> None:
        if self.undo is not None:
            self.undo()
            self.undo = None


def prepare_arm(loaded: LoadedWorkload, arm: Arm, **shape: ShapeValue) -> Prepared:
    """Fresh build of ``loaded`` (at ``shape`` overrides), prepared by ``arm``, with a new optimizer."""
    fresh = loaded.rebuild(**shape)
    undo = arm.prepare(fresh)
    return Prepared(arm=arm, loaded=fresh, step=TrainingStep(fresh.workload), undo=undo)


def is_cuda(step: TrainingStep) -> bool:
    return model_device(step).type == "cuda"


def release_memory() -> None:
    """On CUDA, return a discarded build's blocks (collect cycles first) so the next peak starts clean.

    Not on CPU: the live-tensor tracker counts only what a step allocates and the state it
    is shown, so garbage does not change a CPU figure, and a full ``gc.collect()`` costs
    ~0.4 s with torch loaded.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


# -- peaks -------------------------------------------------------------------------------

def measure_arm_peak(loaded: LoadedWorkload, arm: Arm, *, warmup: int = 2) -> PeakMeasurement:
    """Peak of one warm step of ``arm`` alone on the device (NOTE [solo peaks])."""
    prepared = prepare_arm(loaded, arm)
    try:
        for i in range(warmup):
            prepared.step.run(i)
        return arm.measure_peak(prepared.step, warmup)
    finally:
        prepared.close()
        prepared = None  # type: ignore[assignment]
        release_memory()


class PeakLimitExceeded(RematError):
    """The CPU live-tensor tracker saw a step's live bytes cross the limit (an OOM data point)."""

    def __init__(self, live_bytes: int, limit_bytes: int) -> None:
        self.live_bytes = live_bytes
        self.limit_bytes = limit_bytes
        super().__init__(f"live tensor bytes reached {live_bytes}, over the limit of {limit_bytes}")


class _LimitTracker(LiveTensorTracker):
    """A tracker that raises :class:`PeakLimitExceeded` as soon as live bytes cross ``limit_bytes``.

    It raises from ``__torch_dispatch__`` (an allocation), never from a finaliser (a free):
    frees only lower the count. This bounds both the memory and the time a capacity probe
    that cannot fit spends before it is known not to.
    """

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(keep_timeline=False)
        self.limit_bytes = limit_bytes

    def _event(self, delta: int) -> None:
        super()._event(delta)
        if delta > 0 and self.live_bytes > self.limit_bytes:
            raise PeakLimitExceeded(self.live_bytes, self.limit_bytes)


def measure_step_peak_within(step: TrainingStep, step_index: int, limit_bytes: int) -> PeakMeasurement:
    """Like ``measure_step_peak``, but on CPU stop the step as soon as it crosses ``limit_bytes``.

    Raises :class:`PeakLimitExceeded` (CPU) or ``torch.OutOfMemoryError`` (CUDA). On CUDA the
    step runs to completion (the allocator has no such hook) and the caller compares.
    """
    if is_cuda(step):
        return measure_step_peak(step, step_index)
    return _tracked_step_within(step, step_index, limit_bytes)


def _tracked_step_within(step: TrainingStep, step_index: int, limit_bytes: int) -> PeakMeasurement:
    """One step under the live-tensor tracker, stopped as soon as live tensor bytes cross the limit (any device)."""
    with _LimitTracker(limit_bytes) as tracker:
        track_step_state(tracker, step)
        loss = step.run(step_index, marker=tracker.mark)
    return PeakMeasurement(tracker.peak_bytes, MemorySource.CPU_LIVE_TENSORS, tracker.peak_phase, 0, loss)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, PeakLimitExceeded)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def probe_capacity(loaded: LoadedWorkload, arm: Arm, key: str, value: int, limit_bytes: int, *,
                   warmup: int = 1) -> CapacityTry:
    """One capacity probe: ``arm`` on a fresh build at ``key=value``; an OOM is a data point, never raised.

    The warm-up steps run under the live-tensor tracker with the limit, on every device (a
    step that cannot fit cold will not fit warm: the warm step adds the optimizer state; and
    on CUDA the allocator's peak is never below the live tensor bytes), so no probe
    allocates much beyond the limit. The measured step then uses the device's own source.
    Any other failure is returned as ``error`` (the search stops there).
    """
    prepared: Prepared | None = None
    try:
        prepared = prepare_arm(loaded, arm, **{key: value})
        for i in range(warmup):
            _tracked_step_within(prepared.step, i, limit_bytes)
        peak = measure_step_peak_within(prepared.step, warmup, limit_bytes)
        return CapacityTry(value=value, peak_bytes=peak.peak_bytes)
    except PeakLimitExceeded as exc:
        return CapacityTry(value=value, peak_bytes=exc.live_bytes, oom=True)
    except Exception as exc:  # noqa: BLE001 - every failure at a new shape is a data point, never a crash
        if _is_oom(exc):
            return CapacityTry(value=value, peak_bytes=None, oom=True, error=None)
        msg = exc.message if isinstance(exc, RematError) else f"{type(exc).__name__}: {exc}"
        return CapacityTry(value=value, peak_bytes=None, error=msg.splitlines()[0][:300])
    finally:
        if prepared is not None:
            try:
                prepared.close()
            except Exception:  # noqa: BLE001 - the build is discarded anyway
                pass
        prepared = None
        release_memory()


# -- time --------------------------------------------------------------------------------

@dataclasses.dataclass
class Timings:
    """Warm whole-step times (ms) per arm label, in round order, and CUDA alloc retries in them."""

    step_ms: dict[str, list[float]]
    num_alloc_retries: dict[str, int]

    def p50(self, label: str) -> float:
        return statistics.median(self.step_ms[label])

    def p95(self, label: str) -> float:
        return percentile(self.step_ms[label], 95.0)


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default): q in [0, 100]."""
    if not xs:
        raise ValueError("percentile of no samples")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def time_round_robin(prepared: list[Prepared], *, warmup: int = 2, steps: int = 10,
                     progress: ProgressFn = no_progress, what: str = "frontier: timing") -> Timings:
    """Interleaved warm step times of every prepared arm (NOTE [interleaved timing])."""
    if steps < 1:
        raise RematError(f"timing needs at least 1 step, got {steps}")
    n = len(prepared)
    labels = [p.arm.label for p in prepared]
    if len(set(labels)) != n:
        raise RematError(f"arm labels must be unique, got {labels}")
    out: dict[str, list[float]] = {lab: [] for lab in labels}
    retries = {lab: 0 for lab in labels}
    cuda = {p.arm.label: is_cuda(p.step) for p in prepared}
    total = warmup + steps
    for r in range(total):
        progress(what, r, total)
        for k in range(n):
            p = prepared[(r + k) % n]
            lab = p.arm.label
            if cuda[lab]:
                before = read_cuda_stats().num_alloc_retries
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            p.step.run(r)
            if cuda[lab]:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) * 1e3
            if r >= warmup:
                out[lab].append(dt)
                if cuda[lab]:
                    retries[lab] += read_cuda_stats().num_alloc_retries - before
    progress(what, total, total)
    return Timings(step_ms=out, num_alloc_retries=retries)


# -- shape keywords ----------------------------------------------------------------------

def shape_value(loaded: LoadedWorkload, key: str) -> Any:
    """Current value of shape keyword ``key``: as given, else the factory's default; WorkloadError if none."""
    if key in loaded.shape:
        return loaded.shape[key]
    factory = _resolve_factory(loaded.spec)
    param = inspect.signature(factory).parameters.get(key)
    if param is None or param.default is inspect.Parameter.empty:
        raise WorkloadError(f"workload {loaded.spec!r} has no default for shape keyword {key!r}",
                            tip=f"give its current value, e.g. --shape {key}=8")
    return param.default
