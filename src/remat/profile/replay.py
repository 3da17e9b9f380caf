"""Measured replay costs: each (candidate, mode) recomputed alone, warm, interleaved.

NOTE [measured replay costs]
What checkpointing candidate j in mode m adds to a step is the difference between j's
forward + backward *under that mode* and j's plain forward + backward: for FULL, the
replay of its forward in backward plus checkpoint's own bookkeeping; for SELECTIVE, the
replay of the ops SAC does not keep plus the Python dispatch mode SAC runs in forward and
in the replay. Modelling SELECTIVE from a no-op dispatch micro-benchmark underpriced it
about 2x on CPU, so it is measured here, like every other mode:

1. One forward of the step captures each candidate's arguments (detached copies, each
   tensor's ``requires_grad`` kept). The step's loss is dropped; buffers are restored.
2. Per candidate, the *arms* are KEEP (plain) and each mode still offered after the dry
   runs (NOTE [mode dry runs]); an arm runs ``module(*args)`` under its mode (the same
   wrapper as the dry run) and backward from all-ones output gradients. Inputs are fresh
   non-leaf copies each run (an in-place write into an input stays legal) and parameter
   gradients are cleared before each run, so every arm does the same bookkeeping.
3. Rounds: every arm once per round, in an order rotated by one each round (NOTE
   [interleaved timing] in remat.measure), clocks read device-correctly (StepClock), the
   Python garbage collector paused. No untimed warm-up round: the region already ran in the
   captured forward, and a slow first run is one more slow sample that the trim below drops
   (with 3 rounds it keeps the 2 fastest, so a first run slower than both later ones leaves
   exactly the samples a warm-up round would have; measured: benchmarks/RESULTS.md, "Figures moved
   from docstrings"). Noise on a shared machine is
   one-sided: a preempted run (or, with several intra-op threads, a run waiting for a
   descheduled thread) only ever takes *longer*, by 10-100 ms against regions of 0.1-2 ms
   (seen on this project's 2-core machines under load: more than half the samples of some
   arms). So each arm's samples are trimmed to their fastest ``1 - trim`` share and the
   arm's time is the median of what is left; the cost of mode m is
   ``time(m) - time(KEEP)``, and its spread the wider of the two arms' kept ranges
   (max - min). Rounds continue past ``min_rounds`` until every mode's spread is at most
   ``max_rel_spread`` of its cost (or ``spread_floor_ms``), up to ``max_rounds`` or until
   the candidate's measuring time passes ``time_budget_ms`` (past ``min_rounds``): the
   spread is recorded either way, so a plan can say how sure it is.
4. A cost below the clock's resolution (``StepClock.resolution_ms``: what timing an empty
   call reads, so a region too small to resolve, or a negative difference) is recorded as
   such (``ReplayEstimate.below_resolution``) and priced at that resolution, never at 0.0 ms:
   a boundary priced at zero looks free to every planner, which it is not.
5. Candidates that are the same region share one measurement (NOTE [shared replay
   measurements] in profile/shared.py): the first of each group is timed, the others take
   its figures, so a transformer's N identical blocks cost one block's rounds.
6. A segment (NOTE [segments]) whose members are all candidates timed in FULL is not timed
   itself: its FULL replay is the sum of its members' (NOTE [composed segment replays]).

NOTE [composed segment replays]
A segment ``blocks[a:b]`` checkpointed FULL recomputes, in backward, the forward of each of
its members once, in order: the same work as checkpointing each member FULL, less the
checkpoint bookkeeping of b - a - 1 regions. So its replay is priced as the sum of its
members' measured FULL costs (and spreads), recorded as ``ReplayEstimate.composed_from``
(the report's ``replay_composed``). Its extra bytes are still measured (NOTE [segment extra
bytes]), from one run of the segment with and without checkpointing (no timing rounds;
identical segments, by NOTE [shared replay measurements], share that run). The sum counts b - a - 1 regions' bookkeeping
too many, so in principle it errs high (towards members), and a time figure never moves a
peak, so no error here can miss a budget. Timed alone, segments took most of the replay stage, and
their figures agreed with their members' sums within the rounds' noise (benchmarks/RESULTS.md,
"Figures moved from docstrings"). A segment with a member that is not a candidate, is not offered FULL or could
not be measured is timed alone as before.

Profiling time: per round, about (1 + modes) forward + backward passes of each *timed*
region; with N identical blocks shared, that is one block and its children, not N. The
defaults (3 rounds for large regions, up to 6 for small ones, at most about
0.5 s per region past the 3rd) are few on purpose: what a plan's overhead finally is, and
whether two plans differ at all, is the frontier's interleaved measurement and its
resolved-difference rule (NOTE [resolved differences] in remat/frontier/pareto.py), not more
samples here; the spread recorded per mode says how sure each figure is. The round cap is where
a stage that cannot resolve a figure stops, so it sets the stage's time, not the figure's quality.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..clock import StepClock
from ..percentile import percentile
from ..memory.measure import model_device
from ..types import CheckpointMode, MemorySource
from ..workload.contract import TrainingStep
from .dryrun import _first_line, _wrap, held_grads, put_back, region_module
from .segments import is_segment, segment_members
from .model import CandidateCost
from .shared import group_by_signature, region_signature


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayEstimate:
    """One (candidate, mode)'s measured added time (NOTE [measured replay costs]), in ms."""

    ms: float          # time(mode) - time(KEEP), each the median of its fastest samples; at least the resolution
    spread_ms: float   # the wider of the two arms' kept ranges (max - min)
    rounds: int        # timed rounds it took
    below_resolution: bool = False   # the difference was below the clock's resolution: ``ms`` is that resolution
    shared_from: str | None = None   # the candidate whose measurement this is (NOTE [shared replay measurements])
    composed_from: tuple[str, ...] = ()   # a segment priced as its members' sum (NOTE [composed segment replays])
    # a composed segment's extra bytes taken from the shortest and longest segment of its family, which
    # measured the same (NOTE [extra bytes between equal ends]); () when measured on its own run
    extra_between: tuple[str, ...] = ()
    # peak live bytes of the region's forward + backward under the mode, less the same without
    # checkpointing, clamped at 0 (NOTE [measured replay bytes]); None when it could not be measured
    extra_bytes: int | None = None


def robust_time(samples: list[float], *, trim: float = 0.5) -> tuple[float, float]:
    """(median, range) of the fastest ``1 - trim`` share of ``samples`` (at least one kept).

    Noise is one-sided (NOTE [measured replay costs]): the slowest samples are dropped, not
    both ends. Pure, so it is testable on scripted samples. ValueError for no samples.
    """
    if not samples:
        raise ValueError("no samples")
    if not 0.0 <= trim < 1.0:
        raise ValueError(f"trim must lie in [0, 1), got {trim}")
    s = sorted(samples)
    kept = s[:max(1, math.ceil(len(s) * (1.0 - trim)))]
    return percentile(kept, 50.0), kept[-1] - kept[0]


def robust_difference(mode_samples: list[float], keep_samples: list[float], *,
                      trim: float = 0.5) -> tuple[float, float]:
    """(cost, spread) of a mode against KEEP from each arm's samples (NOTE [measured replay costs])."""
    tm, sm = robust_time(mode_samples, trim=trim)
    tk, sk = robust_time(keep_samples, trim=trim)
    return tm - tk, max(sm, sk)


def _capture_inputs(step: TrainingStep, modules: dict[str, nn.Module], wanted: set[str],
                    step_index: int) -> dict[str, tuple[tuple, dict]]:
    """Each wanted module's (args, kwargs) from one forward (first call), detached copies."""
    names = {id(m): n for n, m in modules.items() if n in wanted}
    captured: dict[str, tuple[tuple, dict]] = {}

    def keep(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad and leaf.is_floating_point())
        return leaf

    def pre(m: nn.Module, args: Any, kwargs: Any) -> None:
        n = names.get(id(m))
        if n is not None and n not in captured:
            captured[n] = tree_map(keep, (tuple(args), dict(kwargs)))

    model = step.workload.model
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for n, m in modules.items() if n in wanted]
    try:
        batch = step.batch(step_index)
        step.workload.loss(model, batch)   # forward only: the graph is dropped with the loss
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for b, v in buffers:
                if not torch.equal(b, v):
                    b.copy_(v)
    return captured


class _RegionArm:
    """One (candidate, mode): forward + backward of the module alone under that mode."""

    def __init__(self, module: nn.Module, mode: CheckpointMode, inputs: tuple[tuple, dict]) -> None:
        self.module = module
        self.mode = mode
        self.inputs = inputs
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.on_cpu = all(t.device.type == "cpu" for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor))

    def run(self, after_forward: Callable[[], None] | None = None) -> None:
        """Forward, then backward; ``after_forward`` runs between them (NOTE [measured replay bytes])."""
        args, kwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.inputs)
        for p in self.params:
            p.grad = None
        remove = _wrap(self.module, self.mode) if self.mode is not CheckpointMode.KEEP else None
        try:
            out = self.module(*args, **kwargs)
            if after_forward is not None:
                after_forward()
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if leaves:
                torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
        finally:
            if remove is not None:
                remove()


def _measure_one(module: nn.Module, modes: list[CheckpointMode], inputs: tuple[tuple, dict], clock: StepClock, *,
                 min_rounds: int, max_rounds: int, max_rel_spread: float, spread_floor_ms: float,
                 trim: float, time_budget_ms: float, resolution_ms: float) -> dict[CheckpointMode, ReplayEstimate]:
    arms = [_RegionArm(module, CheckpointMode.KEEP, inputs)] + [_RegionArm(module, m, inputs) for m in modes]
    samples: dict[CheckpointMode, list[float]] = {arm.mode: [] for arm in arms}
    rounds, spent = 0, 0.0
    while rounds < max_rounds:
        k = rounds % len(arms)
        for arm in arms[k:] + arms[:k]:
            ms = clock.time(arm.run)[1]
            samples[arm.mode].append(ms)
            spent += ms
        rounds += 1
        if rounds >= min_rounds:
            est = [robust_difference(samples[m], samples[CheckpointMode.KEEP], trim=trim) for m in modes]
            if spent > time_budget_ms or all(s <= max(spread_floor_ms, max_rel_spread * abs(c)) for c, s in est):
                break
    peaks = {arm.mode: _backward_peaks(arm) for arm in arms}   # untimed: the tracker slows every op
    out = {}
    for m in modes:
        c, s = robust_difference(samples[m], samples[CheckpointMode.KEEP], trim=trim)
        extra = replay_extra(peaks[CheckpointMode.KEEP], peaks[m])
        ms, below = price_at_resolution(c, resolution_ms)
        out[m] = ReplayEstimate(ms=ms, spread_ms=s, rounds=rounds, extra_bytes=extra, below_resolution=below)
    return out


def price_at_resolution(cost_ms: float, resolution_ms: float) -> tuple[float, bool]:
    """(price, below resolution) of a measured difference: below the clock's resolution (negative
    included) it is priced at the resolution, never at zero (NOTE [measured replay costs])."""
    if resolution_ms <= 0.0:
        raise ValueError(f"a clock resolution must be positive, got {resolution_ms} ms")
    return (resolution_ms, True) if cost_ms < resolution_ms else (cost_ms, False)


def _backward_peaks(arm: "_RegionArm", *, tracker: bool = True) -> dict[MemorySource, int]:
    """Peak bytes of one run of ``arm`` during its backward, counted from before its forward, by each
    instrument that can watch it: the live-tensor tracker (tensor bytes; ``CPU_LIVE_TENSORS``, on any
    device) and on CPU, where it is installed, the allocator counter. An instrument under which the
    region cannot run (a second dispatch mode) is left out. ``tracker=False``: the counter alone where
    it can watch the region (a composed segment, NOTE [segment extra bytes]), else the tracker.

    NOTE [measured replay bytes]
    The cost model adds ``replay_extra_bytes`` to the rows where a checkpointed candidate
    replays: what its replay holds beyond what the same instants of the unplanned step hold.
    The first estimate (how far its forward rose above its entry level, less what it saves)
    counts every transient and the region's output, but a non-reentrant replay frees what
    nobody saved as it goes and stops early once the saved tensors are back (``early_stop``):
    on ``cnn`` that over-predicted the peak of ``all`` by 6 points of the control's peak. So
    the region runs once more per arm, and the replay's extra is the difference of the two
    arms' peaks *in backward* (the peak reset when the forward returns): a replaying row's
    base is the unplanned step's most during that backward, the checkpointed arm's is the
    replay's. Whole-run peaks were compared before, and the unplanned arm's peak was its
    forward's transients, which the step's backward rows never hold: on the tiny test cnn
    (batch 8, 16x16, width 8) ``blocks.1`` measured 5056 B of extra, and its plan then
    measured 51216 B (3.5%) over its prediction; in backward it is 67904 B, 15952 B (1.1%;
    at one thread, as the tests run, 7.0% and 2.7%).
    Rows count tensors (the tracker's, plus one allowance for what is not a tensor, NOTE
    [untracked bytes] in step.py), so both arms run under the tracker; on CPU the
    allocator counter runs them too, since it also sees what a checkpoint keeps that is no
    tensor (its RNG state, 5056 bytes on CPU); the extra is the larger of the two
    differences. The counter alone read 5056 B for ``blocks.1``: its unplanned backward, with
    what its convolutions allocate beside tensors, stood as high as the replay, which
    re-creates two transients the unplanned backward never holds (bn2's output and the
    residual sum, 64 KiB each there).
    """
    from ..memory.allocator import CpuAllocatorWindow, counter_status
    from ..memory.tracker import LiveTensorTracker
    peaks: dict[MemorySource, int] = {}
    counter = arm.on_cpu and counter_status().available
    if tracker or not counter:
        try:
            with LiveTensorTracker(keep_timeline=False) as t:
                arm.run(after_forward=t.reset_peak)
            peaks[MemorySource.CPU_LIVE_TENSORS] = int(t.peak_bytes)
        except Exception:  # noqa: BLE001  a mode that cannot run under a second dispatch mode keeps its estimate
            pass
    if counter:
        try:
            with CpuAllocatorWindow() as w:
                arm.run(after_forward=w.reset_peak)
            peaks[MemorySource.CPU_ALLOCATOR] = w.peak_bytes
        except Exception:  # noqa: BLE001  as above
            pass
    return peaks


def replay_extra(keep: dict[MemorySource, int], mode: dict[MemorySource, int]) -> int | None:
    """A replay's extra bytes from both arms' ``_backward_peaks``: the largest difference any one
    instrument saw in both, never below 0 (NOTE [measured replay bytes]); None when no instrument did."""
    both = keep.keys() & mode.keys()
    return max(0, *(mode[s] - keep[s] for s in both)) if both else None


def _offered_modes(c: CandidateCost) -> list[CheckpointMode]:
    return [m for m in CheckpointMode if m is not CheckpointMode.KEEP and m in c.replay_ms]


@dataclasses.dataclass(kw_only=True)
class _Rounds:
    """How the timing rounds of one candidate run and stop (NOTE [measured replay costs])."""

    min_rounds: int
    max_rounds: int
    max_rel_spread: float
    spread_floor_ms: float
    trim: float
    time_budget_ms: float
    resolution_ms: float


def _leaders(model: nn.Module, modules: dict[str, nn.Module], todo: list[CandidateCost],
             inputs: dict[str, tuple[tuple, dict]]) -> dict[str, str]:
    """Candidate name -> the candidate whose measurement it takes (itself when measured), for those
    with captured inputs (NOTE [shared replay measurements])."""
    signatures = {c.name: region_signature(region_module(model, modules, c.name), c, inputs[c.name],
                                           _offered_modes(c))
                  for c in todo if c.name in inputs}
    return group_by_signature(signatures, {c.name: c.fwd_ms for c in todo})


def _measure_leaders(model: nn.Module, modules: dict[str, nn.Module], todo: list[CandidateCost],
                     inputs: dict[str, tuple[tuple, dict]], clock: StepClock, rounds: _Rounds,
                     progress: Callable[[int, int], None],
                     ) -> tuple[dict[str, dict[CheckpointMode, ReplayEstimate]], dict[str, str]]:
    """Time each group's first candidate alone; the others take its estimates (``shared_from``)."""
    composable = _composable_segments(model, todo, inputs)
    leader = _leaders(model, modules, [c for c in todo if c.name not in composable], inputs)
    timed = [c for c in todo if leader.get(c.name) == c.name]
    results: dict[str, dict[CheckpointMode, ReplayEstimate]] = {}
    unmeasured = {c.name: "not called in the captured forward" for c in todo if c.name not in inputs}

    def measure(c: CandidateCost) -> None:
        _measure_alone(model, modules, c, inputs, clock, rounds, results, unmeasured)

    for i, c in enumerate(timed):
        progress(i, len(timed))
        measure(c)
    progress(len(timed), len(timed))
    _share_leaders(leader, results, unmeasured)
    _compose_segments(model, modules, todo, inputs, composable, leader, results, measure)
    return results, unmeasured


def _measure_alone(model: nn.Module, modules: dict[str, nn.Module], c: CandidateCost,
                   inputs: dict[str, tuple[tuple, dict]], clock: StepClock, rounds: _Rounds,
                   results: dict[str, dict[CheckpointMode, ReplayEstimate]], unmeasured: dict[str, str]) -> None:
    """Time ``c``'s region alone into ``results``; where it cannot run alone, say why in ``unmeasured``."""
    try:
        results[c.name] = _measure_one(region_module(model, modules, c.name), _offered_modes(c), inputs[c.name],
                                       clock, **dataclasses.asdict(rounds))
    except Exception as exc:  # noqa: BLE001  the region alone may not run; keep the model's figure
        unmeasured[c.name] = f"could not run alone: {_first_line(exc)}"


def _share_leaders(leader: dict[str, str], results: dict[str, dict[CheckpointMode, ReplayEstimate]],
                   unmeasured: dict[str, str]) -> None:
    """Each candidate not timed takes its leader's estimates (``shared_from``), or says why it has none
    (NOTE [shared replay measurements])."""
    for name, first in leader.items():
        if first == name:
            continue
        if first in results:
            results[name] = {m: dataclasses.replace(e, shared_from=first) for m, e in results[first].items()}
        else:
            unmeasured[name] = f"the same region as {first}, which was not measured: {unmeasured[first]}"


def _shared_extra_bytes(model: nn.Module, modules: dict[str, nn.Module], extra_from: dict[str, str],
                        inputs: dict[str, tuple[tuple, dict]]) -> Callable[[str], int | None]:
    """A segment name -> its FULL replay's extra bytes (NOTE [segment extra bytes]), run once per group of
    identical segments (``extra_from``: name -> the segment whose run it takes)."""
    extras: dict[str, int | None] = {}

    def extra_of(name: str) -> int | None:
        first = extra_from.get(name, name)
        if first not in extras:
            extras[first] = _extra_bytes(region_module(model, modules, first), CheckpointMode.FULL, inputs[first])
        return extras[first]

    return extra_of


def _compose_segments(model: nn.Module, modules: dict[str, nn.Module], todo: list[CandidateCost],
                      inputs: dict[str, tuple[tuple, dict]], composable: dict[str, list[str]], leader: dict[str, str],
                      results: dict[str, dict[CheckpointMode, ReplayEstimate]],
                      measure: Callable[[CandidateCost], None]) -> None:
    """Each composable segment's FULL estimate from its members' (NOTE [composed segment replays]); one with
    a member that could not be measured is timed alone after all (``measure``)."""
    by_name = {c.name: c for c in todo}
    # identical segments (h[0:2], h[2:4], ...) share one tracked run for their extra bytes, by the
    # signature rule of NOTE [shared replay measurements]
    extra_from = _leaders(model, modules, [by_name[n] for n in composable], inputs)
    extra_of = _shared_extra_bytes(model, modules, extra_from, inputs)
    full_of = {name: [results.get(m, {}).get(CheckpointMode.FULL) for m in members]
               for name, members in composable.items()}
    composable_now = {n: ms for n, ms in composable.items() if all(e is not None for e in full_of[n])}
    between = _extras_between_ends(composable_now, leader, extra_of)
    for name, members in composable.items():
        full = full_of[name]
        if name not in composable_now:   # a member could not be measured: time the segment alone after all
            measure(by_name[name])
        elif name in between:
            extra, ends = between[name]
            results[name] = {CheckpointMode.FULL: _composed(members, full, extra, ends)}  # type: ignore[arg-type]
        else:
            results[name] = {CheckpointMode.FULL: _composed(members, full, extra_of(name))}  # type: ignore[arg-type]


def _extras_between_ends(composable: dict[str, list[str]], leader: dict[str, str],
                         extra_of: Callable[[str], int | None]) -> dict[str, tuple[int, tuple[str, str]]]:
    """Segment name -> (extra bytes, (shortest, longest)) for the segments whose family's ends measured
    the same extra bytes (NOTE [extra bytes between equal ends]); the others are measured each.

    NOTE [extra bytes between equal ends]
    A FULL segment's replay recomputes its members in order, each member's saved tensors kept for its
    backward and its other intermediates freed before the next member runs; so beyond the activations
    it recreates (which its KEEP run holds too) the replay holds what one member's forward holds at a
    time, and a checkpoint's RNG state: the same for a chain of 2 identical blocks as for one of 16.
    Measured on gpt at n_layer 32 (every length a tracked run): 4032 bytes at each of the 8 lengths
    (2 to 16 blocks), the blocks' own FULL extra; the 8 runs took 8.6 s (timed one by one), where a
    warm step of the model takes 2.2-2.4 s and the whole replay stage read 11.8 s. So of a *family*
    (segments whose members all take one block's measurement, NOTE [shared replay measurements])
    only the shortest and the longest length are run: where the two agree to the byte, every length
    between takes that figure (``extra_between``, the report's ``replay_extra_between``); where they
    differ, every length is run as before. It is interpolation
    between measured ends, never extrapolation past the longest; the closed loop measures every plan
    it ships."""
    families: dict[str, list[str]] = {}
    for name, members in composable.items():
        leaders = {leader.get(m) for m in members}
        if len(leaders) == 1 and None not in leaders:
            families.setdefault(next(iter(leaders)), []).append(name)   # type: ignore[arg-type]
    out: dict[str, tuple[int, tuple[str, str]]] = {}
    for names in families.values():
        lengths = sorted({len(composable[n]) for n in names})
        if len(lengths) < 3:
            continue    # nothing between the ends: each is run anyway
        shortest = next(n for n in names if len(composable[n]) == lengths[0])
        longest = next(n for n in names if len(composable[n]) == lengths[-1])
        low, high = extra_of(shortest), extra_of(longest)
        if low is None or low != high:
            continue
        out.update({n: (low, (shortest, longest)) for n in names
                    if lengths[0] < len(composable[n]) < lengths[-1]})
    return out


def _composable_segments(model: nn.Module, todo: list[CandidateCost],
                         inputs: dict[str, tuple[tuple, dict]]) -> dict[str, list[str]]:
    """Segment name -> member names, for the segments offered FULL only whose members are all
    candidates here offered FULL with captured inputs (NOTE [composed segment replays])."""
    offers_full = {c.name for c in todo if CheckpointMode.FULL in _offered_modes(c) and c.name in inputs}
    out: dict[str, list[str]] = {}
    for c in todo:
        if not is_segment(c.name) or _offered_modes(c) != [CheckpointMode.FULL] or c.name not in inputs:
            continue
        members = [m for m, _ in segment_members(model, c.name)]
        if members and all(m in offers_full and not is_segment(m) for m in members):
            out[c.name] = members
    return out


def _composed(members: list[str], full: list[ReplayEstimate], extra_bytes: int | None,
              extra_between: tuple[str, ...] = ()) -> ReplayEstimate:
    """A segment's FULL replay as its members' sum (NOTE [composed segment replays]); ``extra_between``:
    the two segments its extra bytes came from (NOTE [extra bytes between equal ends]). Its extra bytes
    are never below a member's (NOTE [segment extra bytes])."""
    if extra_bytes is not None:
        extra_bytes = max([extra_bytes] + [e.extra_bytes for e in full if e.extra_bytes is not None])
    return ReplayEstimate(ms=sum(e.ms for e in full), spread_ms=sum(e.spread_ms for e in full),
                          rounds=min(e.rounds for e in full), composed_from=tuple(members), extra_bytes=extra_bytes,
                          extra_between=extra_between)


def _extra_bytes(module: nn.Module, mode: CheckpointMode, inputs: tuple[tuple, dict]) -> int | None:
    """A composed segment's own replay extra bytes (NOTE [segment extra bytes]) from one run of each arm
    under the allocator counter (the tracker where the counter cannot watch it), with no timing rounds;
    None when either arm cannot run so.

    NOTE [segment extra bytes]
    A composed segment (NOTE [composed segment replays]) replays its members in order, and beyond the
    activations it recreates holds what one member's replay holds at a time (NOTE [extra bytes between
    equal ends]). So its extra is the larger of its own run's, under the counter alone, and its
    members' (each measured by both instruments, NOTE [measured replay bytes]); the tracker never runs
    a whole segment. Under the tracker too, the segments' runs took 19.6 s of a 51.9 s profile of gpt at
    n_layer 32 (18 runs of 2 to 16 blocks, one thread), and the replay stage of `remat plan` went from
    12-14 s to 26.0 s (32.4 step-equivalents for the whole plan, over the goal of 30); on the tiny cnn the
    members' figure is what the segment's counter run hides, as for ``blocks.1`` alone.
    """
    keep, mode_peaks = (_backward_peaks(_RegionArm(module, m, inputs), tracker=False)
                        for m in (CheckpointMode.KEEP, mode))
    return replay_extra(keep, mode_peaks)


def measure_replay_costs(step: TrainingStep, candidates: list[CandidateCost], step_index: int, *,
                         min_rounds: int = 3, max_rounds: int = 6, max_rel_spread: float = 0.1,
                         spread_floor_ms: float = 0.05, trim: float = 0.5, time_budget_ms: float = 500.0,
                         progress: Callable[[int, int], None] = lambda done, total: None,
                         ) -> tuple[dict[str, dict[CheckpointMode, ReplayEstimate]], dict[str, str]]:
    """Measure every offered (candidate, mode), once per group of identical regions
    (NOTE [measured replay costs], NOTE [shared replay measurements] in profile/shared.py).

    Returns (name -> mode -> estimate, name -> why it could not be measured). A candidate
    whose region cannot run alone (it reads state its parent sets up) keeps its modelled
    figures; the second map says why. ``progress(done, total)`` counts the regions timed.
    Gradients and buffers are restored afterwards.
    """
    model = step.workload.model
    modules = dict(model.named_modules())
    wanted = {c.name for c in candidates if any(m is not CheckpointMode.KEEP for m in c.replay_ms)}
    # a segment's inputs are its first member's (NOTE [segments])
    first_member = {n: segment_members(model, n)[0][0] for n in wanted if is_segment(n)}
    grads = held_grads(model)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    clock = StepClock(model_device(step))
    gc_was_on = gc.isenabled()
    try:
        inputs = _capture_inputs(step, modules, (wanted - set(first_member)) | set(first_member.values()), step_index)
        inputs.update({n: inputs[f] for n, f in first_member.items() if f in inputs})
        rounds = _Rounds(min_rounds=min_rounds, max_rounds=max_rounds, max_rel_spread=max_rel_spread,
                         spread_floor_ms=spread_floor_ms, trim=trim, time_budget_ms=time_budget_ms,
                         resolution_ms=clock.resolution_ms())
        gc.collect(1)   # the young generations: a full collection takes 0.2 s with torch loaded
        gc.disable()    # a collection inside a timed run is noise, not replay cost
        return _measure_leaders(model, modules, [c for c in candidates if c.name in wanted], inputs, clock, rounds,
                                progress)
    finally:
        if gc_was_on:
            gc.enable()
        put_back(grads, buffers)
