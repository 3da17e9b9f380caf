"""Running a step sample (NOTE [step sample] in profile/sample.py): one workload per point, and
the profile of every point merged into one."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

import torch

from ..types import ProgressFn, no_progress
from ..workload.loader import LoadedWorkload
from ..workload.contract import TrainingStep, Workload
from .measure import DRY_RUN_FAILED, apply_replay_measurements, profile_workload
from .replay import measure_replay_costs
from .model import ProfileReport
from .sample import SEED_STRIDE, SamplePoint, StepSample, merge_profiles


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


def profile_sample(loaded: LoadedWorkload, sample: StepSample, *, candidates: list[str] | None = None,
                   measure_replays: bool = True, segments: bool = True, variants: list[LoadedWorkload] | None = None,
                   progress: ProgressFn = no_progress) -> ProfileReport:
    """Profile every point of ``sample`` and merge them (NOTE [step sample]).

    The first point profiles as ``profile_workload`` always did; the others with 1 warm-up and 1
    timed step, measuring replays only of the candidates no earlier point offered (the merged
    replay time is the median of the measured ones)."""
    reports: list[ProfileReport] = []
    workloads = sample_workloads(loaded, sample, variants=variants)
    for i, point_loaded in enumerate(workloads):
        def tick(what: str, done: int, total: int, i: int = i) -> None:
            progress(what if len(workloads) == 1 else f"{what} (sampled step {i + 1}/{len(workloads)})", done, total)
        if i == 0:
            reports.append(profile_workload(point_loaded, candidates=candidates, measure_replays=measure_replays,
                                            segments=segments, progress=tick))
            continue
        if isinstance(point_loaded, PointWorkload):
            point_loaded = point_loaded.rebuild()   # a fresh build: not the model an earlier point trained
        report = profile_workload(point_loaded, candidates=candidates, measure_replays=False, segments=segments,
                                  warmup=1, repeats=1, dry_run_settled=_dry_run_settled(reports), progress=tick)
        if measure_replays:
            _measure_new_replays(point_loaded, report, {c.name for r in reports for c in r.candidates}, tick)
        reports.append(report)
    return merge_profiles(reports)


def _dry_run_settled(reports: list[ProfileReport]) -> frozenset[str]:
    """Candidates whose modes an earlier point's dry runs settled: every one it offered, and every one
    it excluded for a failing dry run. One that no earlier point called is dry-run where it first runs
    (dynamic control flow); a mode that failed on one point's batch only still fails loudly where the
    closed loop measures the plan at that point."""
    out = {c.name for r in reports for c in r.candidates if c.name not in r.excluded}
    out |= {n for r in reports for n, why in r.excluded.items() if why.startswith(DRY_RUN_FAILED)}
    return frozenset(out)


def _measure_new_replays(point_loaded: LoadedWorkload, report: ProfileReport, seen: set[str],
                         progress: Callable[[str, int, int], None]) -> None:
    """Measure the replays of ``report``'s candidates that no earlier point offered (dynamic ones)."""
    new = [c for c in report.candidates if c.name not in seen and c.name not in report.excluded]
    if not new:
        return
    step = TrainingStep(point_loaded.workload)
    apply_replay_measurements(report, *measure_replay_costs(
        step, new, _REPLAY_STEP_INDEX, progress=lambda done, total: progress("profile: replay costs", done, total)))


# the index profile_workload's replays use with 1 warm-up and 1 timed step (warmup + repeats + 4)
_REPLAY_STEP_INDEX = 6
