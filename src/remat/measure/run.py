"""Running a step and measuring it: arms, fresh builds, warm-up, peaks, held bytes, timing.

An *arm* is one way of running the workload's step: the unmodified control, a remat plan
(``remat.wrap.PlanArm``), or in ``benchmarks/compare.py`` a torch baseline such as
``checkpoint_sequential``. The caller prepares the model (this stage never imports ``plan``
or ``apply``, docs/DESIGN.md); each arm prepares its own fresh build of the workload, so no two
arms share a model, optimizer state or wrapper.

NOTE [interleaved timing]
Step times on a shared machine drift (other jobs, thermal state, page cache). Timing
arm A for ten steps and then arm B for ten would charge the drift to whichever arm ran
during it. ``time_round_robin`` takes every runner built first, then runs rounds; each
round runs one step of every runner, in an order rotated by one each round (so no runner
always runs first, right after the Python loop's bookkeeping). Warm-up rounds are not
timed. Every runner runs the same step indices, hence the same batches, and the same random
draws: before each runner's step of round r (outside its clock) torch's, Python's and numpy's
global generators are seeded with ``STEP_SEED + r``, so a layerdrop or stochastic-depth model
skips the same blocks in every arm's step r (unseeded, a timed difference would partly be a
difference in work). The caller's generators are put back afterwards, so
``remat.auto`` inside a training script leaves the script's RNG where it was. Clocks are read
device-correctly (NOTE [device-correct timing] in remat/clock.py). A time is the *whole* step:
batch, forward, backward, optimizer step and ``zero_grad``.

NOTE [solo peaks]
Peaks are measured with one arm resident at a time (``measure_arm_peak``: fresh build,
warm-up, one measured step), not inside the round-robin: on CUDA the allocator's peak is
process-wide, so other arms' resident parameters and optimizer state would inflate it;
on CPU the live-tensor tracker counts only what it is shown, so it would not matter, but
one code path for both devices keeps the figures comparable with ``remat plan``'s.
Every arm's build runs the same random draws: ``prepare_arm`` sets its step to seed every
global generator with ``STEP_SEED + i`` before step i (``TrainingStep.seed``), as the
round-robin does, and the caller's generators are put back after each measurement (unseeded,
a layerdrop model's arms would run different layers: two peaks of different work compared as
if of the same step). A workload's own seeded steps (a step sample's later points seed in
``batch``, after this) keep their draws.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Protocol, Sequence

import torch

from .._codec import JsonCodec, json_field
from ..errors import RematError, WorkloadError
from ..host_rng import RngState, seed_everything
from ..memory.cuda import read_cuda_stats
from ..memory.measure import PeakMeasurement, measure_step_peak, model_device, peak_costs_nothing, track_step_state
from ..memory.reference import at_the_edge, profiler_step_peak
from ..memory.tracker import LiveTensorTracker
from ..types import MemorySource, Phase, ProgressFn, no_progress
from ..workload.contract import TrainingStep, Workload, is_allocation_failure
from ..workload.loader import LoadedWorkload, ShapeValue, factory_defaults
from ..clock import StepClock
from ..percentile import percentile
from .compile_spec import CompileSpec
from .compiled import CompiledFunction, compile_model, compiled_step_peak

Undo = Callable[[], None]


# -- arms --------------------------------------------------------------------------------

class Arm:
    """One way of running the step. Override :meth:`prepare`; optionally :meth:`measure_peak`.

    ``prepare(fresh)`` changes a fresh build of the workload in place (wrap modules, swap
    the model) before its optimizer is made, and may return an undo callable. The base
    class prepares nothing: the unmodified control.

    ``compile``: run the prepared model through ``torch.compile`` (NOTE [compiled arms] in
    remat/measure/compiled.py); its peak then comes from the CUDA allocator or, on CPU,
    from torch.profiler's allocator events, never from the live-tensor tracker.
    """

    def __init__(self, label: str, *, compile: CompileSpec | None = None) -> None:
        self.label = label
        self.compile = compile
        self._compiled: CompiledFunction | None = None   # shared by this arm's builds (NOTE [compiled arms])

    def compiled_function(self) -> CompiledFunction:
        """This arm's compiled entry: compiled at the first build's first step, reused by later builds."""
        assert self.compile is not None
        if self._compiled is None:
            self._compiled = CompiledFunction(self.compile)
        return self._compiled

    def prepare(self, fresh: LoadedWorkload) -> Undo | None:
        return None

    def measure_peak(self, step: TrainingStep, step_index: int) -> PeakMeasurement:
        """Whole-step peak of one warm step (CUDA allocator, or the CPU live-tensor tracker;
        compiled: the CUDA allocator or torch.profiler's CPU allocator events)."""
        if self.compile is not None:
            return compiled_step_peak(step, step_index)
        return measure_step_peak(step, step_index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"


class Runner(Protocol):
    """What the round-robin scheduler times: a label, a device, and one step by index."""

    label: str

    @property
    def device(self) -> torch.device: ...

    def run(self, index: int) -> Any: ...


STEP_SEED = 7_000_001   # step i of every measured arm seeds STEP_SEED + i (NOTE [interleaved timing], [solo peaks])


@dataclasses.dataclass
class Prepared:
    """An arm's fresh build, prepared, with its own optimizer: ready to run steps (a :class:`Runner`)."""

    arm: Arm
    loaded: LoadedWorkload
    step: TrainingStep
    undo: Undo | None
    callers_rng: RngState | None = None   # the generators before the build: put back by close()

    @property
    def label(self) -> str:
        return self.arm.label

    @property
    def device(self) -> torch.device:
        return model_device(self.step)

    def run(self, index: int) -> float:
        return self.step.run(index)

    def close(self) -> None:
        if self.undo is not None:
            self.undo()
            self.undo = None
        if self.callers_rng is not None:
            self.callers_rng.restore()
            self.callers_rng = None


def prepare_arm(loaded: LoadedWorkload, arm: Arm, **shape: ShapeValue) -> Prepared:
    """Fresh build of ``loaded`` (at ``shape`` overrides), prepared by ``arm``, with a new optimizer."""
    callers = RngState.capture()
    fresh = loaded.rebuild(**shape)
    undo = arm.prepare(fresh)
    if arm.compile is not None:
        undo = _Undos([compile_model(fresh.workload.model, arm.compiled_function()), undo])
    step = TrainingStep(fresh.workload)
    step.seed = STEP_SEED    # every arm's step i draws alike (NOTE [solo peaks])
    return Prepared(arm=arm, loaded=fresh, step=step, undo=undo, callers_rng=callers)


class _Undos:
    """Several undos, run in order (a compiled arm: un-compile, then the arm's own undo)."""

    def __init__(self, undos: list[Undo | None]) -> None:
        self.undos = [u for u in undos if u is not None]

    def __call__(self) -> None:
        for u in self.undos:
            u()


def is_cuda(step: TrainingStep) -> bool:
    return model_device(step).type == "cuda"


def warm_up(step: TrainingStep, steps: int, *, start: int = 0, progress: ProgressFn = no_progress,
            what: str = "warm-up") -> int:
    """Run ``steps`` untimed steps from index ``start``; returns the next step index."""
    for i in range(steps):
        progress(what, i + 1, steps)
        step.run(start + i)
    return start + steps


def time_steps(step: TrainingStep, indices: Sequence[int], *, clock: StepClock | None = None,
               run: Callable[[int], Any] | None = None) -> list[float]:
    """Device-correct wall time (ms) of each step in ``indices``, in order (NOTE [device-correct timing]).

    ``run(index)`` replaces ``step.run`` when a caller counts or instruments its steps."""
    clock = clock or StepClock(model_device(step))
    run = run or step.run
    return [clock.time(run, i)[1] for i in indices]


def release_memory() -> None:
    """On CUDA, return a discarded build's blocks (collect cycles first) so the next peak starts clean.

    Not on CPU: the live-tensor tracker counts only what a step allocates and the state it
    is shown, so garbage does not change a CPU figure, and a full ``gc.collect()`` costs
    ~0.4 s with torch loaded.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def discard(prepared: list[Prepared]) -> None:
    """Close every build in ``prepared``, drop them (the list is emptied) and release their memory."""
    for p in prepared:
        p.close()
    prepared.clear()
    release_memory()


# -- one arm alone: peak, times, held bytes ------------------------------------------------

def _rounded_ms(times: list[float]) -> list[float]:
    return [round(t, 4) for t in times]   # to 0.1 us


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepMeasurement(JsonCodec):
    """One arm alone on the device: the peak of one warm step, then warm step times. Its JSON (never read
    back) rounds the times, adds their p50/p95 and leaves the confirmation's figures out."""

    peak_bytes: int
    memory_source: MemorySource
    # warm whole steps (batch, forward, backward, optimizer), ms
    step_ms: list[float] = json_field(encode=_rounded_ms, then=(("p50_ms", "warm_p50_ms"), ("p95_ms", "warm_p95_ms")))
    num_alloc_retries: int = 0
    compile_s: float | None = None   # compiled arms: first step's wall time less a warm step's (s)
    # CPU, confirmed at the edge: the tracker's own figure (NOTE [peaks at the edge]); peak_bytes is the larger
    tracker_peak_bytes: int | None = json_field(default=None, skip=True)
    # one step's peak per stream ``measure_arm`` ran after (``then``)
    then_peak_bytes: tuple[int, ...] = json_field(default=(), skip=True)

    @property
    def p50_ms(self) -> float:
        return percentile(self.step_ms, 50.0)

    @property
    def warm_p50_ms(self) -> float | None:
        """p50 of the warm steps (ms); None: no step was timed."""
        return self.p50_ms if self.step_ms else None

    @property
    def warm_p95_ms(self) -> float | None:
        return percentile(self.step_ms, 95.0) if self.step_ms else None


# Another stream of steps on the same build: the workload running other batches (and random draws) on
# the same model, loss and optimizer factory (NOTE [one build per shape] in remat/profile/sample.py).
Stream = Callable[[Workload], Workload]


def measure_arm(loaded: LoadedWorkload, arm: Arm, *, warmup: int = 2, steps: int = 3,
                confirm_under: int | None = None, then: Sequence[Stream] = ()) -> StepMeasurement:
    """Peak and warm step times of ``arm`` on a fresh build (NOTE [solo peaks]): ``warmup``
    untimed steps, one peak step, then ``steps`` timed steps (0: the peak only). Where measuring
    the peak costs the step nothing (NOTE [peak in a timed step]) the peak step is also the first
    timed one, and ``steps`` steps run after the warm-up, not ``steps + 1``.

    ``confirm_under`` (bytes, the budget the peak must clear): a CPU live-tensor peak under it by
    less than the tracker's known error is confirmed by torch.profiler on the next step, and the
    larger figure is the peak (NOTE [peaks at the edge]).

    ``then``: after the timed steps, one step of each stream on the same build, its peak measured
    (``then_peak_bytes``, in order): step ``warmup`` of that stream, as every stream's first peak step."""
    prepared = prepare_arm(loaded, arm)
    compile_s = None
    try:
        if arm.compile is not None and warmup >= 1:
            first = time_steps(prepared.step, [0])[0]
            warm_up(prepared.step, warmup - 1, start=1)
            warm = min(time_steps(prepared.step, [warmup]))
            compile_s = max(0.0, first - warm) / 1e3
            warmup += 1
        else:
            warm_up(prepared.step, warmup)
        if steps >= 1 and arm.compile is None and peak_costs_nothing(prepared.step):
            held: list[PeakMeasurement] = []    # NOTE [peak in a timed step]: no confirmation either
            times = time_steps(prepared.step, [warmup], run=lambda i: held.append(arm.measure_peak(prepared.step, i)))
            peak, confirmed = held[0], None
            times += time_steps(prepared.step, range(warmup + 1, warmup + steps))
        else:
            peak = arm.measure_peak(prepared.step, warmup)
            # in a job every rank must run the same steps, so no rank confirms alone (NOTE [one plan per job])
            confirmed = None if loaded.ranks is not None else _confirmed_peak(prepared.step, warmup + 1, peak,
                                                                              confirm_under)
            start = warmup + (1 if confirmed is None else 2)
            times = time_steps(prepared.step, range(start, start + steps))
        then_peaks = _stream_peaks(prepared, arm, then, warmup)
    finally:
        prepared.close()
        prepared = None  # type: ignore[assignment]
        release_memory()
    peak_bytes, source, tracker = peak.peak_bytes, peak.source, None
    if confirmed is not None:   # NOTE [peaks at the edge]: the larger figure is the peak
        tracker = peak.peak_bytes
        if confirmed > peak.peak_bytes:
            peak_bytes, source = confirmed, MemorySource.CPU_PROFILER
    if loaded.ranks is not None:   # every rank ran this step: one figure for all (NOTE [one plan per job])
        peak_bytes, times = loaded.ranks.max_bytes(peak_bytes), loaded.ranks.median_ms(times)
        then_peaks = [loaded.ranks.max_bytes(p) for p in then_peaks]
    return StepMeasurement(peak_bytes=peak_bytes, step_ms=times, memory_source=source, tracker_peak_bytes=tracker,
                           num_alloc_retries=peak.num_alloc_retries, compile_s=compile_s,
                           then_peak_bytes=tuple(then_peaks))


def _stream_peaks(prepared: Prepared, arm: Arm, streams: Sequence[Stream], index: int) -> list[int]:
    """Step ``index`` of each stream on ``prepared``'s build, in order, and its peak (bytes)."""
    peaks = []
    for stream in streams:
        prepared.step.workload = stream(prepared.step.workload)   # same model and optimizer, other batches
        peaks.append(arm.measure_peak(prepared.step, index).peak_bytes)
    return peaks


def _confirmed_peak(step: TrainingStep, index: int, peak: PeakMeasurement, budget: int | None) -> int | None:
    """torch.profiler's whole-step peak of step ``index`` when the tracker's ``peak`` is at the edge of
    ``budget`` (NOTE [peaks at the edge]); None when no confirmation is needed."""
    if budget is None or not at_the_edge(peak.peak_bytes, budget, peak.source):
        return None
    return profiler_step_peak(step, index)


def measure_arm_peak(loaded: LoadedWorkload, arm: Arm, *, warmup: int = 2) -> PeakMeasurement:
    """Peak of one warm step of ``arm`` alone on the device (NOTE [solo peaks])."""
    prepared = prepare_arm(loaded, arm)
    try:
        warm_up(prepared.step, warmup)
        return arm.measure_peak(prepared.step, warmup)
    finally:
        prepared.close()
        prepared = None  # type: ignore[assignment]
        release_memory()


def measure_stream_peaks(loaded: LoadedWorkload, arm: Arm, streams: Sequence[Stream], *,
                         warmup: int = 1) -> list[int]:
    """On one fresh build of ``loaded`` prepared by ``arm``: ``warmup`` steps of the first stream, then
    step ``warmup`` of each stream in turn, its peak (bytes; NOTE [one build per shape])."""
    if not streams:
        return []
    prepared = prepare_arm(loaded, arm)
    try:
        prepared.step.workload = streams[0](prepared.step.workload)
        warm_up(prepared.step, warmup)
        peaks = _stream_peaks(prepared, arm, streams, warmup)
        return [loaded.ranks.max_bytes(p) for p in peaks] if loaded.ranks is not None else peaks
    finally:
        prepared.close()
        prepared = None  # type: ignore[assignment]
        release_memory()


def held_bytes_at_phase(loaded: LoadedWorkload, arm: Arm, phase: Phase, *, warmup: int = 1) -> int:
    """Live bytes as ``phase`` starts, on a fresh build prepared by ``arm`` (``warmup`` steps first).

    At ``Phase.BACKWARD`` every activation the step keeps is alive (NOTE [measured saving] in
    remat.workflow). CPU: the live-tensor tracker; CUDA: ``torch.cuda.memory_allocated``
    after a synchronise.
    """
    if arm.compile is not None:
        raise RematError(f"{arm.label}: the bytes held at a phase are read by the live-tensor tracker, which "
                         "would run a compiled model eagerly (NOTE [compiled arms])",
                         tip="measure held bytes on the eager arm")
    prepared = prepare_arm(loaded, arm)
    held: list[int] = []
    try:
        step = prepared.step
        warm_up(step, warmup)
        device = model_device(step)
        if device.type == "cuda":
            def cuda_marker(p: Phase) -> None:
                if p is phase:
                    torch.cuda.synchronize(device)
                    held.append(torch.cuda.memory_allocated(device))
            step.run(warmup, marker=cuda_marker)
        else:
            with LiveTensorTracker(keep_timeline=False) as tracker:
                track_step_state(tracker, step)

                def marker(p: Phase) -> None:
                    tracker.mark(p)
                    if p is phase:
                        held.append(tracker.live_bytes)
                step.run(warmup, marker=marker)
    finally:
        prepared.close()
    if not held:  # pragma: no cover - TrainingStep.run marks every phase
        raise WorkloadError(f"the step never reached {phase.value}: cannot measure the bytes held there")
    return held[0]


# -- capacity probes ---------------------------------------------------------------------

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One capacity probe: the peak (bytes) at ``value``, or that it ran out of memory, or why it failed."""

    value: int
    peak_bytes: int | None
    oom: bool = False
    error: str | None = None


def probe_capacity(loaded: LoadedWorkload, arm: Arm, key: str, value: int, limit_bytes: int, *,
                   warmup: int = 1) -> ProbeResult:
    """One capacity probe: ``arm`` on a fresh build at ``key=value``; an OOM is a data point, never raised.

    The warm-up steps run under the live-tensor tracker with the limit, on every device (a
    step that cannot fit cold will not fit warm: the warm step adds the optimizer state; and
    on CUDA the allocator's peak is never below the live tensor bytes), so no probe
    allocates much beyond the limit. The measured step then uses the device's own source.
    Any other failure is returned as ``error`` (the search stops there).
    """
    if arm.compile is not None:
        # the probes run under the live-tensor tracker (a dispatch mode: the compiled frame would
        # run eagerly), and every new value of the key recompiles: NOTE [compiled arms]
        return ProbeResult(value=value, peak_bytes=None,
                           error="capacity is not searched for compiled arms (the probes' tracker would run "
                                 "the model eagerly, and each value recompiles)")
    prepared: Prepared | None = None
    try:
        prepared = prepare_arm(loaded, arm, **{key: value})
        for i in range(warmup):
            _tracked_step_within(prepared.step, i, limit_bytes)
        peak = measure_step_peak_within(prepared.step, warmup, limit_bytes)
        return ProbeResult(value=value, peak_bytes=peak.peak_bytes)
    except PeakLimitExceeded as exc:
        return ProbeResult(value=value, peak_bytes=exc.live_bytes, oom=True)
    except Exception as exc:  # noqa: BLE001 - every failure at a new shape is a data point, never a crash
        if isinstance(exc, PeakLimitExceeded) or is_allocation_failure(exc):
            return ProbeResult(value=value, peak_bytes=None, oom=True, error=None)
        msg = exc.message if isinstance(exc, RematError) else f"{type(exc).__name__}: {exc}"
        return ProbeResult(value=value, peak_bytes=None, error=msg.splitlines()[0][:300])
    finally:
        if prepared is not None:
            try:
                prepared.close()
            except Exception:  # noqa: BLE001 - the build is discarded anyway
                pass
        prepared = None
        release_memory()


# -- interleaved time ----------------------------------------------------------------------

@dataclasses.dataclass
class Timings:
    """Warm whole-step times (ms) per runner label, in round order, and CUDA alloc retries in them."""

    step_ms: dict[str, list[float]]
    num_alloc_retries: dict[str, int]

    def p50(self, label: str) -> float:
        return percentile(self.step_ms[label], 50.0)

    def p95(self, label: str) -> float:
        return percentile(self.step_ms[label], 95.0)


def time_round_robin(runners: Sequence[Runner], *, warmup: int = 2, steps: int = 10,
                     progress: ProgressFn = no_progress, what: str = "timing") -> Timings:
    """Interleaved warm step times of every runner (NOTE [interleaved timing]): remat's one scheduler."""
    if steps < 1:
        raise RematError(f"timing needs at least 1 step, got {steps}")
    n = len(runners)
    labels = [r.label for r in runners]
    if len(set(labels)) != n:
        raise RematError(f"arm labels must be unique, got {labels}")
    out: dict[str, list[float]] = {lab: [] for lab in labels}
    retries = {lab: 0 for lab in labels}
    clocks = [StepClock(r.device) for r in runners]
    total = warmup + steps
    callers = RngState.capture()
    try:
        for r in range(total):
            progress(what, r, total)
            for k in range(n):
                runner, clock = runners[(r + k) % n], clocks[(r + k) % n]
                seed_everything(STEP_SEED + r)   # the same draws for every arm's step r
                before = read_cuda_stats(clock.device).num_alloc_retries if clock.cuda else 0
                _, ms = clock.time(runner.run, r)
                if r >= warmup:
                    out[runner.label].append(ms)
                    if clock.cuda:
                        retries[runner.label] += read_cuda_stats(clock.device).num_alloc_retries - before
    finally:
        callers.restore()
    progress(what, total, total)
    return Timings(step_ms=out, num_alloc_retries=retries)


# -- shape keywords ----------------------------------------------------------------------

def shape_value(loaded: LoadedWorkload, key: str) -> Any:
    """Current value of shape keyword ``key``: as given, else the factory's default; WorkloadError if none."""
    if key in loaded.shape:
        return loaded.shape[key]
    defaults = factory_defaults(loaded.spec)
    if key not in defaults:
        raise WorkloadError(f"workload {loaded.spec!r} has no default for shape keyword {key!r}",
                            tip=f"give its current value, e.g. --shape {key}=8")
    return defaults[key]
