"""Running a step sample (NOTE [step sample] in profile/sample.py): one workload per point, and
the profile of every point merged into one."""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable

import torch

from ..measure import Stream
from ..types import ProgressFn, no_progress
from ..workload.loader import LoadedWorkload
from ..workload.contract import TrainingStep, Workload
from .measure import DRY_RUN_FAILED, apply_replay_measurements, profile_workload, replay_step_index
from .replay import measure_replay_costs
from .model import ProfileReport
from .sample import SEED_STRIDE, SamplePoint, StepSample, merge_profiles
from .twins import find_twins, warn_untwinned


class _PointBatch:
    """``batch(i)`` of a point: seeds (points k >= 1) then the workload's ``batch(offset + i)``."""

    def __init__(self, batch: Callable[[int], Any], point: SamplePoint) -> None:
        self.batch, self.point = batch, point

    def __call__(self, i: int) -> Any:
        if self.point.seed is not None:
            seed = SEED_STRIDE * self.point.seed + i
            torch.manual_seed(seed)   # every device's generator: layerdrop and dropout masks of this point
            random.seed(seed)
        return self.batch(self.point.offset + i)


def point_workload(workload: Workload, point: SamplePoint) -> Workload:
    """``workload`` running ``point``'s steps (the same model, loss and optimizer)."""
    return dataclasses.replace(workload, batch=_PointBatch(workload.batch, point))


@dataclasses.dataclass(kw_only=True)
class PointWorkload(LoadedWorkload):
    """A LoadedWorkload whose every build runs one sample point's steps (its shape, offset and seed)."""

    base: LoadedWorkload      # the build at the point's shape
    point: SamplePoint

    def rebuild(self, **shape_overrides: Any) -> "PointWorkload":
        return at_point(self.base.rebuild(**shape_overrides), self.point)   # type: ignore[return-value]


def at_point(built: LoadedWorkload, point: SamplePoint) -> LoadedWorkload:
    """``built`` (already at ``point``'s shape) running ``point``'s steps; the plain point is ``built`` itself."""
    if point.offset == 0 and point.seed is None:
        return built
    return PointWorkload(spec=built.spec, shape=built.shape, device=built.device, dtype=built.dtype,
                         workload=point_workload(built.workload, point), base=built, point=point)


def sample_workloads(loaded: LoadedWorkload, sample: StepSample, *,
                     variants: list[LoadedWorkload] | None = None) -> list[LoadedWorkload]:
    """One workload per point of ``sample``, in ``sample.points()`` order.

    ``variants``: the builds at each boundary shape, when the caller has them already (``remat.auto``'s
    further example batches); else ``loaded`` is rebuilt at each boundary shape."""
    if variants is None:
        variants = [loaded.rebuild(**dict(shape)) for shape in sample.boundary_shapes]
    builds = [loaded, *variants]
    points = sample.points()
    per_shape = sample.steps
    return [at_point(builds[i // per_shape], p) for i, p in enumerate(points)]


def on_point(workload: Workload, point: SamplePoint) -> Workload:
    """``point``'s steps on ``workload``'s model, loss and optimizer factory, whichever point's steps it
    ran before (NOTE [one build per shape])."""
    batch = workload.batch.batch if isinstance(workload.batch, _PointBatch) else workload.batch
    return dataclasses.replace(workload, batch=_PointBatch(batch, point))


def shape_streams(workloads: list[LoadedWorkload], sample: StepSample) -> list[tuple[LoadedWorkload, list[Stream]]]:
    """The sample by shape (``workloads`` from :func:`sample_workloads`): per shape, the workload of its
    first point (whose fresh build the shape's points run on) and one stream per point of that shape,
    in ``sample.points()`` order (NOTE [one build per shape])."""
    streams: list[Stream] = [functools.partial(on_point, point=p) for p in sample.points()]
    n = sample.steps
    return [(workloads[i], streams[i:i + n]) for i in range(0, len(workloads), n)]


def profile_sample(loaded: LoadedWorkload, sample: StepSample, *, candidates: list[str] | None = None,
                   measure_replays: bool = True, segments: bool = True, variants: list[LoadedWorkload] | None = None,
                   progress: ProgressFn = no_progress) -> ProfileReport:
    """Profile every point of ``sample`` and merge them (NOTE [step sample]).

    Blocks no point ran are costed as an identical block that ran (NOTE [unsampled blocks] in
    profile/twins.py). The first point profiles as ``profile_workload`` always did. The first point of each boundary
    shape profiles on its own build with 1 warm-up and 1 timed step; every later point of a shape
    continues on the step (model and optimizer) of the point before it with no warm-up and 1 timed
    step (NOTE [one build per shape]). Later points measure replays only of the candidates no earlier
    point offered (the merged replay time is the median of the measured ones).

    NOTE [one build per shape]
    A later point needs its own batches and random draws, not its own model: what a step holds at its
    peak is the model's state (parameters, gradients, the optimizer's moments) plus that step's
    activations, and the state exists from the first optimizer step on. So the points of one shape
    run one after another on one build and one optimizer: a point's step is the same batch and seed
    (NOTE [step sample]) on a model some steps further trained, as every step of a real run is. Each
    point used to rebuild and run a warm-up step first: a build and a warm-up step per later point
    and per measured plan; ``remat plan`` on gpt at n_layer 32 went from 88.5 s (37.7 step-
    equivalents, one run, which also built the allocator counter once) to 73.1 s (30.9) with this
    change alone (``benchmarks/plan_speed.py plan-gpt``). The closed loop measures a plan's later
    points of the first shape on the build that measured its first point, right after it
    (``measure_plan(..., then=...)``); the frontier's receipt and ``remat check``, whose first point
    is measured elsewhere, on one fresh build per shape after 1 warm-up step (``sample_peaks`` in
    remat/closed_loop.py); every further shape on a build of its own. What this gives up: the
    weights a point's step sees depend on the steps run before it on that build, so where control
    flow reads the weights (MoE routing) two of these paths can measure a point's step a little
    differently; ``remat check`` compares within its peak tolerance. A model whose steps differ by
    their random draws (layerdrop, dropout) or batches draws the same at each point on every path
    (``tests/test_sample.py``: each point's peak on one build equals a fresh build's).
    """
    reports: list[ProfileReport] = []
    workloads = sample_workloads(loaded, sample, variants=variants)
    points = sample.points()
    step: TrainingStep | None = None
    for i, (point_loaded, point) in enumerate(zip(workloads, points)):
        def tick(what: str, done: int, total: int, i: int = i) -> None:
            progress(what if len(workloads) == 1 else f"{what} (sampled step {i + 1}/{len(workloads)})", done, total)
        if i == 0:
            step = TrainingStep(point_loaded.workload)
            reports.append(profile_workload(point_loaded, candidates=candidates, measure_replays=measure_replays,
                                            segments=segments, step=step, progress=tick))
            continue
        first_of_shape = i % sample.steps == 0
        if first_of_shape:      # a boundary shape's own build (NOTE [step sample])
            step = TrainingStep(point_loaded.workload)
        else:                   # the shape's build as the point before left it (NOTE [one build per shape])
            assert step is not None
            step.workload = on_point(step.workload, point)
        warmup = 1 if first_of_shape else 0
        report = profile_workload(point_loaded, candidates=candidates, measure_replays=False, segments=segments,
                                  warmup=warmup, repeats=1, dry_run_settled=_dry_run_settled(reports), step=step,
                                  progress=tick)
        if measure_replays:
            _measure_new_replays(step, report, {c.name for r in reports for c in r.candidates},
                                 replay_step_index(warmup, 1), tick)
        reports.append(report)
    return merge_sample(loaded, reports)


def merge_sample(loaded: LoadedWorkload, reports: list[ProfileReport]) -> ProfileReport:
    """The points' profiles merged, every block no point ran costed as its identical twin, and
    ``UnsampledBlockWarning`` for one with none (NOTE [unsampled blocks] in profile/twins.py)."""
    unsampled = find_twins(loaded.workload.model, reports)
    warn_untwinned(unsampled)
    return merge_profiles(reports, unsampled.twins)


def _dry_run_settled(reports: list[ProfileReport]) -> frozenset[str]:
    """Candidates whose modes an earlier point's dry runs settled: every one it offered, and every one
    it excluded for a failing dry run. One that no earlier point called is dry-run where it first runs
    (dynamic control flow); a mode that failed on one point's batch only still fails loudly where the
    closed loop measures the plan at that point."""
    out = {c.name for r in reports for c in r.candidates if c.name not in r.excluded}
    out |= {n for r in reports for n, why in r.excluded.items() if why.startswith(DRY_RUN_FAILED)}
    return frozenset(out)


def _measure_new_replays(step: TrainingStep, report: ProfileReport, seen: set[str], index: int,
                         progress: Callable[[str, int, int], None]) -> None:
    """Measure the replays of ``report``'s candidates that no earlier point offered (dynamic ones), on
    step ``index`` (``replay_step_index``: where ``profile_workload``'s own replay stage would have)."""
    new = [c for c in report.candidates if c.name not in seen and c.name not in report.excluded]
    if not new:
        return
    apply_replay_measurements(report, *measure_replay_costs(
        step, new, index, progress=lambda done, total: progress("profile: replay costs", done, total)))
