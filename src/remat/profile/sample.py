"""Profiling a sample of training steps: one workload per sampled point, each point profiled, and
their profiles merged into one. The sample itself (``StepSample``, ``SamplePoint``, ``SampleRecord``)
is in profile/model.py, which the plan stage reads without torch.

NOTE [step sample]
A training run is thousands of steps, and many models change from step to step: layerdrop
and stochastic depth skip blocks when ``torch.rand`` says so, MoE routing changes what each
expert holds, padded batches change the sequence length. One profiled step says nothing about
the others (a Wav2Vec2 encoder profiled on a step that skipped a layer planned a 3-layer step
and measured 28% over budget on later ones). So remat profiles and measures a *sample*:
``StepSample.steps`` steps at the workload's shape and as many at each boundary shape
(``--boundary-shape``, or every further example batch of ``remat.auto``).

Point k of a shape runs the workload's ``batch(1000 * k + i)`` at its step i and, for k >= 1,
seeds torch and Python's ``random`` with ``1_000_003 * k + i`` before it (so each point draws
its own dropout and layerdrop masks, the same ones every time it is run: ``remat check``
re-measures the same steps). Point 0 is the unseeded single step remat always ran, so
``--sample-steps 1`` is exactly the single-step behaviour.

The default is 3 steps (``DEFAULT_SAMPLE_STEPS``): with a layer skipped with probability p
independently, a block absent from all 3 profiled steps has probability p**3 (0.1% at
Wav2Vec2's default p = 0.1, 2.7% at p = 0.3). The cost is small because the points after the
first continue on the build of the point before them with 1 timed step and no warm-up (NOTE
[one build per shape]), dry-run only the candidates no earlier point's dry runs settled, and
measure replays only of candidates no earlier point offered (its cost measured: benchmarks/RESULTS.md,
"Figures moved from docstrings"). The
closed loop adds 1 peak step per further point for each plan it measures, on the first point's
build (a fresh build and a warm-up step per further shape). Merging (``merge_profiles``):

- a candidate offered at any point is offered (one absent from some points is *dynamic*, and
  stays a candidate); excluded at a point for any reason but "not called", it stays excluded;
  a segment (NOTE [segments]) is offered only when every point offered it and no point skipped a
  child of its container: its wrapper runs every member, so a skipped member would run anyway;
- bytes per candidate (saved, inputs) are the max over the points that ran it, times (forward,
  replay) the median; a replay's time and extra bytes come from the points that measured that
  replay alone (NOTE [measured replay costs]) where any did, not from first estimates;
- the peak rows are the union of every point's rows, so the predicted peak is the max over the
  sampled steps; and each point's rows come again with the dynamic candidates it skipped added
  (their FULL saved bytes and inputs) where they would be held, by forward order: from the end
  of the forward of the block that ran before them (so a block skipped last is held at the end
  of the forward) until their backward; and a like block's backward rows come again moved to
  where each skipped block's own backward would be (every block from the like one up to it still
  held). So the model also covers the step in which every sampled dynamic block runs, which no
  sampled step need have shown (before the last two rules, ``remat.auto`` under-predicted that
  step of an 8-block stochastic-depth model by 26%, measured: predicted 4.15 MiB, 5.22 MiB ran);
- the closed loop measures each plan at every point and takes the max (NOTE [closed loop]).

A block that ran in none of the sampled steps is costed as an identical block that ran and
held in every point's grown rows (NOTE [unsampled blocks] in profile/twins.py); one with no such
twin is not a candidate, and ``UnsampledBlockWarning`` says so with the spread of the sampled
steps' peaks. A shape beyond the boundary shapes is not covered. The max saved bytes
of a candidate come from its largest shape; the rows of a smaller shape then under-predict
their own step, which the measured max over the sample catches.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable

import torch

from ..errors import ShapeError, WorkloadError
from ..measure import Stream
from ..percentile import p50
from ..types import CheckpointMode, ProgressFn, no_progress
from ..workload.contract import TrainingStep, Workload
from ..workload.loader import LoadedWorkload
from .model import (NOT_CALLED, SEED_STRIDE, CandidateCost, HazardRecord, PeakRow, ProfileReport, SamplePoint,
                    StepSample)
from .replay import measure_replay_costs
from .step import DRY_RUN_FAILED, apply_replay_measurements, profile_workload, replay_step_index
from .twins import Twin, find_twins, warn_unsampled


# -- running the sample's points -------------------------------------------------------------------

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
    point running on its own build would pay a build and a warm-up step per later point and per
    measured plan (what that cost: benchmarks/RESULTS.md, "Figures moved from docstrings"). The closed loop measures a plan's later
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
    """The points' profiles merged, every block no point ran costed as its identical twin, and an
    ``UnsampledBlockWarning`` naming each such block (NOTE [unsampled blocks] in profile/twins.py)."""
    unsampled = find_twins(loaded.workload.model, reports)
    merged = merge_profiles(reports, unsampled.twins)
    warn_unsampled(unsampled, merged.costed_as_twin)
    return merged


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


# -- merging the points' profiles ------------------------------------------------------------------

def merge_orders(orders: list[list[str]]) -> list[str]:
    """One forward order from several: the first list, then each later name after its predecessor."""
    out: list[str] = []
    for names in orders:
        for i, n in enumerate(names):
            if n in out:
                continue
            before = next((names[j] for j in range(i - 1, -1, -1) if names[j] in out), None)
            out.insert(0 if before is None else out.index(before) + 1, n)
    return out


def _median(values: list[float]) -> float:
    return float(p50(values))


def _hazards(costs: list[CandidateCost]) -> list[HazardRecord]:
    """Every hazard any point found, each (kind, detail) once."""
    out: dict[tuple, HazardRecord] = {}
    for h in (h for c in costs for h in c.hazards):
        out.setdefault((h.kind, h.detail), h)
    return list(out.values())


def _common_modes(costs: list[CandidateCost]) -> list[CheckpointMode]:
    """The modes every point measured (saved bytes and replay time)."""
    return [m for m in costs[0].saved_bytes if all(m in c.saved_bytes and m in c.replay_ms for c in costs)]


def _merge_cost(costs: list[CandidateCost]) -> CandidateCost:
    """One candidate from its costs at the points that ran it: bytes max, times median, modes every point has."""
    modes = _common_modes(costs)
    # per mode, the points that measured its replay alone (NOTE [measured replay costs]), else all
    replays = {m: [c for c in costs if m in c.replay_spread_ms] for m in modes}
    timed = {m: replays[m] or costs for m in modes}
    return dataclasses.replace(
        costs[0], fwd_ms=_median([c.fwd_ms for c in costs]), input_bytes=max(c.input_bytes for c in costs),
        saved_input_bytes=max(c.saved_input_bytes for c in costs),
        host_input_bytes=min(c.host_input_bytes for c in costs),   # freed at every point, or not counted
        saved_bytes={m: max(c.saved_bytes[m] for c in costs) for m in modes},
        replay_ms={m: _median([c.replay_ms[m] for c in timed[m]]) for m in modes},
        replay_extra_bytes={m: max(c.replay_extra_bytes.get(m, 0) for c in timed[m]) for m in modes},
        replay_spread_ms={m: _median([c.replay_spread_ms[m] for c in cs]) for m, cs in replays.items() if cs},
        replay_work=_common_median([c.replay_work for c in costs], modes),
        hazards=_hazards(costs))


def _common_median(tables: list[dict[CheckpointMode, float]], modes: list[CheckpointMode]) -> dict[CheckpointMode, float]:
    """Per mode of ``modes`` that every point's table holds, the points' median."""
    return {m: _median([t[m] for t in tables]) for m in modes if all(m in t for t in tables)}


def _renamed(cost: CandidateCost, name: str) -> CandidateCost:
    """``cost`` under ``name``, sharing no mutable field with it (order and parent: set by the merge)."""
    return dataclasses.replace(cost, name=name, hazards=list(cost.hazards), saved_bytes=dict(cost.saved_bytes),
                               replay_ms=dict(cost.replay_ms), replay_extra_bytes=dict(cost.replay_extra_bytes),
                               replay_spread_ms=dict(cost.replay_spread_ms), replay_work=dict(cost.replay_work))


def _placed(order: list[str], twins: tuple[Twin, ...]) -> list[str]:
    """``order`` with each twinned never-run module inserted after the name registered before it."""
    out = list(order)
    for t in twins:   # in registration order: a child after its twinned parent
        out.insert(out.index(t.after) + 1 if t.after in out else 0, t.name)
    return out


def _parent_of(name: str, names: set[str]) -> str | None:
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in names), None)


def _container_of(name: str) -> str:
    """The container of a module path (``blocks.2`` -> ``blocks``) or of a segment (``blocks[1:3]``)."""
    return name.split("[", 1)[0] if "[" in name else name.rpartition(".")[0]


def _dynamic(reports: list[ProfileReport]) -> set[str]:
    """Module candidates offered at some points and not called at others."""
    offered = {c.name for r in reports for c in r.candidates if not c.members}
    return {n for n in offered if any(r.excluded.get(n) == NOT_CALLED for r in reports)}


def _excluded(reports: list[ProfileReport], kept_segments: set[str], twinned: set[str]) -> dict[str, str]:
    """Every name excluded at some point for a reason other than NOT_CALLED (the first reason), the
    names no point called and no twin stands for, and the segments not kept, each with why."""
    out: dict[str, str] = {}
    for r in reports:
        for n, why in r.excluded.items():
            if why != NOT_CALLED:
                out.setdefault(n, why)
    offered = {c.name for r in reports for c in r.candidates} | twinned
    for n in sorted({n for r in reports for n, why in r.excluded.items() if why == NOT_CALLED} - offered):
        out.setdefault(n, "not called during any sampled step (NOTE [step sample])")
    for r in reports:
        for c in r.candidates:
            if c.members and c.name not in kept_segments:
                out.setdefault(c.name, "not a chain in every sampled step, or a member runs in some steps only "
                                       "(NOTE [step sample]): its wrapper would run a skipped member")
    return out


def _kept_segments(reports: list[ProfileReport], dynamic: set[str]) -> set[str]:
    """The segments every point offered, in containers none of whose children some point skipped."""
    offered = [{c.name for c in r.candidates if c.members} for r in reports]
    every = set.intersection(*offered) if offered else set()
    skipped = {n for r in reports for n, why in r.excluded.items() if why == NOT_CALLED}
    shaky = {_container_of(n) for n in dynamic | skipped}
    return {s for s in every if _container_of(s) not in shaky}


def _held_at(row: PeakRow, absent: CandidateCost, order: dict[str, int], ran: list[int]) -> bool:
    """Whether ``absent`` would hold its activations at ``row``'s instants, had it run too: its forward
    has begun (the candidate that ran last before it is held: ``ran``, the orders of the candidates the
    row's step ran; so a block skipped last is held from the end of the forward on) and its backward
    has not begun (it runs before every one replaying)."""
    o = order[absent.name]
    if row.replaying:
        return o < min(order.get(n, -1) for n in row.replaying)
    before = max((i for i in ran if i < o), default=-1)
    return bool(row.live) and max(order.get(n, -1) for n in row.live) >= before


def _held_bytes(held: list[CandidateCost]) -> int:
    """Bytes ``held`` KEEP holds (saved and inputs); a held child's are in its held parent's already."""
    names = {c.name for c in held}
    return sum(c.saved_bytes[CheckpointMode.FULL] + c.input_bytes for c in held if _parent_of(c.name, names) is None)


def _with_absent(report: ProfileReport, absent: list[CandidateCost], order: dict[str, int]) -> list[PeakRow]:
    """``report``'s rows, each again with the dynamic candidates it lacks held where they would be, and
    the backward of each of those (NOTE [step sample]): the same step with those blocks running too."""
    grown = []
    ran = [order[c.name] for c in report.candidates if c.name in order]
    for r in report.rows:
        held = [c for c in absent if _held_at(r, c, order, ran)]
        if held:
            names = [c.name for c in held]
            grown.append(PeakRow(base_bytes=r.base_bytes + _held_bytes(held), live=(*r.live, *names),
                                 replaying=r.replaying, label=f"{r.label}, if {', '.join(names)} ran too"))
    return [*report.rows, *grown, *_absent_backwards(report, absent, order)]


def _alike(a: CandidateCost, b: CandidateCost) -> bool:
    """Two candidates with the same class and bytes: one's backward stands for the other's."""
    return (a.class_name, a.input_bytes, a.saved_bytes.get(CheckpointMode.FULL)) == \
        (b.class_name, b.input_bytes, b.saved_bytes.get(CheckpointMode.FULL))


def _replays_only(row: PeakRow, name: str) -> bool:
    """``row`` is in the backward of ``name`` and of nothing else but a segment or a module holding it."""
    return name in row.replaying and all(n == name or "[" in n or name.startswith(n + ".") for n in row.replaying)


def _absent_backwards(report: ProfileReport, absent: list[CandidateCost], order: dict[str, int]) -> list[PeakRow]:
    """For each absent candidate with a like one this step ran (its stand-in), the stand-in's backward
    rows moved to where the absent one's backward would be: every candidate from the stand-in up to it
    in forward order is still held there, and the candidates before the stand-in that this step skipped
    are held too. No sampled step shows that backward (the step ran no such block then)."""
    everyone = [*report.candidates, *absent]
    out = []
    for a in absent:
        stand_in = max((c for c in report.candidates if c.name in order and order[c.name] < order[a.name]
                        and _alike(c, a)), key=lambda c: order[c.name], default=None)
        if stand_in is None:
            continue
        lo, hi = order[stand_in.name], order[a.name]
        between = [c for c in everyone if c.name in order and lo <= order[c.name] < hi]
        earlier = [c for c in absent if order[c.name] < lo]
        for r in (r for r in report.rows if _replays_only(r, stand_in.name)):
            held = [*between, *earlier]
            out.append(PeakRow(base_bytes=r.base_bytes + _held_bytes(held), live=(*r.live, *(c.name for c in held)),
                               replaying=(a.name,), label=f"backward of {a.name} (as {stand_in.name}'s), if it ran"))
    return out


def _check_same_model(reports: list[ProfileReport]) -> None:
    # a shape keyword may size a parameter (gpt's seq_len sizes wpe): the plan applies by module
    # path there (NOTE [plans at other shapes]), so only the module tree must agree
    if len({r.fingerprint.modules for r in reports}) > 1:
        raise ShapeError("the sampled steps profiled different module trees: a boundary shape changes the model's "
                         "modules", tip="give --boundary-shape only keywords that change the data (seq_len, "
                                        "batch_size), not the model's structure")


def _merged_candidates(reports: list[ProfileReport], excluded: dict[str, str], order: list[str],
                       twins: tuple[Twin, ...]) -> list[CandidateCost]:
    """The candidates not ``excluded``, each merged over the points that offered it, and each twinned
    never-run module costed as its twin (NOTE [unsampled blocks]), in ``order``, renumbered and
    re-parented among themselves."""
    by_name: dict[str, list[CandidateCost]] = {}
    for c in (c for r in reports for c in r.candidates if c.name not in excluded):
        by_name.setdefault(c.name, []).append(c)
    costs = {n: _merge_cost(cs) for n, cs in by_name.items()}
    for t in twins:   # each twin is a candidate no point excluded (merge_profiles)
        costs[t.name] = _renamed(costs[t.twin], t.name)
    merged = [costs[n] for n in order if n in costs]
    modules = {c.name for c in merged if not c.members}
    for i, c in enumerate(merged):
        c.order = i
        c.parent = _parent_of(c.covers[0], modules - {c.name})
    return merged


def _merged_rows(reports: list[ProfileReport], merged: list[CandidateCost], dynamic: set[str],
                 order: list[str]) -> list[PeakRow]:
    """Every point's rows, and again with the dynamic candidates it skipped; only merged names kept."""
    final = {c.name: c for c in merged}
    order_of = {n: i for i, n in enumerate(order)}
    rows = []
    for r in reports:
        ran = {c.name for c in r.candidates}
        rows += _with_absent(r, [final[n] for n in sorted(dynamic & final.keys()) if n not in ran], order_of)
    return [dataclasses.replace(row, live=tuple(n for n in row.live if n in final),
                                replaying=tuple(n for n in row.replaying if n in final)) for row in rows]


def merge_profiles(reports: list[ProfileReport], twins: tuple[Twin, ...] = ()) -> ProfileReport:
    """One profile from the profiles of a sample's points (NOTE [step sample]); ``twins``: the modules no
    point ran, each costed as an identical one that ran (NOTE [unsampled blocks] in profile/twins.py)."""
    if not reports:
        raise WorkloadError("no sampled step to merge")
    if len(reports) == 1 and not twins:
        return reports[0]
    _check_same_model(reports)
    twinned = {t.name for t in twins}
    dynamic = _dynamic(reports) | twinned    # absent from every point: held in every point's grown rows
    excluded = _excluded(reports, _kept_segments(reports, dynamic), twinned)
    for t in (t for t in twins if t.twin in excluded):   # a twin that cannot be planned stands for nothing
        excluded[t.name] = f"ran in no sampled step, and its twin {t.twin} is excluded: {excluded[t.twin]}"
    twins = tuple(t for t in twins if t.twin not in excluded)
    order = _placed(merge_orders([[c.name for c in sorted(r.candidates, key=lambda c: c.order)] for r in reports]),
                    twins)
    merged = _merged_candidates(reports, excluded, order, twins)
    return _merged_report(reports, merged, _merged_rows(reports, merged, dynamic, order), excluded, twins)


def _refuted(reports: list[ProfileReport], merged: list[CandidateCost]) -> dict[str, list[str]]:
    """Suspicions some point refuted and no point confirmed (NOTE [confirmed hazards])."""
    kept = {(c.name, f"{h.kind.value}: {h.detail}") for c in merged for h in c.hazards}
    out: dict[str, list[str]] = {}
    for n, h in ((n, h) for r in reports for n, hs in r.refuted_hazards.items() for h in hs):
        if (n, h) not in kept and h not in out.get(n, []):
            out.setdefault(n, []).append(h)
    return out


def _phase_peaks(reports: list[ProfileReport]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p, b in ((p, b) for r in reports for p, b in r.phase_peak_bytes.items()):
        out[p] = max(out.get(p, 0), b)
    return out


def _unmeasured(reports: list[ProfileReport], merged: list[CandidateCost]) -> dict[str, str]:
    """Candidates whose replay no point measured alone, with a point's reason."""
    todo = {c.name for c in merged if not c.replay_spread_ms}
    return {n: why for r in reports for n, why in r.replay_unmeasured.items() if n in todo}


def _mode_excluded(reports: list[ProfileReport]) -> dict[str, dict[str, str]]:
    """Each candidate's modes excluded, with why, as the last point that excluded any says."""
    return {n: m for r in reports for n, m in r.mode_excluded.items()}


def _idle(reports: list[ProfileReport], excluded: dict[str, str]) -> list[str]:
    """The excluded candidates some point found idle (sorted)."""
    return sorted({n for r in reports for n in r.idle if n in excluded})


def _replay_shared(reports: list[ProfileReport], names: set[str]) -> dict[str, str]:
    """Who shared whose replay measurement at any point, for the merged ``names``."""
    return {n: src for r in reports for n, src in r.replay_shared.items() if n in names}


def _lists_at_any_point(maps: list[dict[str, list[str]]], names: set[str]) -> dict[str, list[str]]:
    """Per merged name in ``names``, a copy of its list at the last point whose map has one."""
    return {n: list(m) for d in maps for n, m in d.items() if n in names}


def _below_resolution(reports: list[ProfileReport], names: set[str]) -> dict[str, list[str]]:
    """Per merged name, the modes whose replay cost was below the clock's resolution at any point (sorted)."""
    return {n: sorted({m for r in reports for m in r.replay_below_resolution.get(n, [])})
            for n in sorted({n for r in reports for n in r.replay_below_resolution}) if n in names}


def _merged_report(reports: list[ProfileReport], merged: list[CandidateCost], rows: list[PeakRow],
                   excluded: dict[str, str], twins: tuple[Twin, ...]) -> ProfileReport:
    """The merged profile: ``merged`` and ``rows``, the baseline's max peak and median time over the
    points, each point's records of its candidates joined (NOTE [step sample]), and which modules were
    costed as a twin (NOTE [unsampled blocks] in profile/twins.py)."""
    first = reports[0]
    names = {c.name for c in merged}
    return ProfileReport(
        candidates=merged, rows=rows, excluded=excluded,
        baseline_peak_bytes=max(r.baseline_peak_bytes for r in reports),
        baseline_step_ms=_median([r.baseline_step_ms for r in reports]),
        memory_source=first.memory_source, fingerprint=first.fingerprint, simulated=first.simulated,
        device_model=first.device_model, refuted_hazards=_refuted(reports, merged),
        mode_excluded=_mode_excluded(reports), phase_peak_bytes=_phase_peaks(reports), idle=_idle(reports, excluded),
        replay_unmeasured=_unmeasured(reports, merged),
        # who shared whose replay measurement, and the costs below the clock's resolution, at any point
        replay_shared=_replay_shared(reports, names),
        replay_composed=_lists_at_any_point([r.replay_composed for r in reports], names),
        replay_extra_between=_lists_at_any_point([r.replay_extra_between for r in reports], names),
        replay_below_resolution=_below_resolution(reports, names),
        untracked_bytes=max(r.untracked_bytes for r in reports),   # each point's rows carry their own
        costed_as_twin={t.name: t.twin for t in twins})
