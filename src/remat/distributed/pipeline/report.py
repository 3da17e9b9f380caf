"""What a pipeline rank measured, and its assembly into the one per-rank report (``pipeline.json``).

Sides (:class:`~remat.plan.pipeline.Side`): ``none`` (no plan), ``uniform`` (the same rule on every
stage, e.g. every block), ``remat`` (per-stage plans, NOTE [pipeline in-flight cost model]). Times in ms,
bytes in bytes. NOTE [pipeline instruments] (remat/distributed/pipeline/worker.py) says how each figure is read.

Each rank's :class:`PipelineRank.run <remat.distributed.pipeline.worker.PipelineRank>` returns a
:class:`RankOutcome` (one :class:`StageResult` per side, raw ns intervals); rank 0 gathers them and
:func:`assemble_pipeline` turns them into the :class:`~remat.distributed.report.DistributedReport` (NOTE [one
per-rank report]): per side a row per stage (its :class:`~remat.distributed.report.StageFigures`: medians,
bubble, the last timed step's timeline), and per planned side a ``PipelineEquivalence`` against the unplanned one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...plan.pipeline import PipelinePlan, Side, ideal_bubble
from ...types import MemorySource
from ...measure import p50, percentile
from ..config import Engine
from ..report import (GradComparison, Interval, PipelineEquivalence, PipelineFigures, RankFigures, SideReport,
                      StageFigures, TimelineSpan, DistributedReport, worst)

COMM_SOURCE = "p2p: the stage's thread blocked posting or waiting on isend/irecv (NOTE [pipeline instruments])"


# -- what one rank measured -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class TimelineEvent(Interval):
    """One interval on a rank, as recorded (``perf_counter_ns``)."""

    start_ns: int
    end_ns: int


@dataclasses.dataclass(kw_only=True)
class StageResult:
    """One stage (rank), one side, as measured on its rank (gathered by rank 0). With several stages per rank,
    ``stage`` is the rank's first."""

    stage: int
    rank: int
    host: str
    in_flight: int                       # microbatches held at the peak (NOTE [pipeline in-flight cost model])
    blocks: list[str]
    boundaries: list[str]                # the side's checkpoint boundaries on the stage
    side: Side
    step_ns: list[tuple[int, int]]       # (start, end) of every timed step, perf_counter_ns
    forward_ms: list[float]              # per timed step (forward chunks + loss)
    backward_ms: list[float]             # per timed step (backward chunks, replay included)
    replay_ms: list[float]               # per timed step (checkpoint replays, inside backward)
    optimizer_ms: list[float]
    p2p_ms: list[float]                  # blocked in p2p (posting + waiting)
    exposed_p2p_ms: list[float]          # union(p2p) - union(compute)
    compute_ms: list[float]              # union(forward, loss, backward, optimizer) per timed step
    peak_bytes: int
    held_at_backward_bytes: list[int]    # live bytes as each microbatch's backward starts
    timeline: list[TimelineEvent]        # the last timed step, ns from its start on this rank
    timeline_t0_ns: int
    grad_sq_sum: float | None = None     # sum of squares of the stage's first-step gradients (float64)

    def __post_init__(self) -> None:
        self.side = Side(self.side)


@dataclasses.dataclass(kw_only=True)
class RankOutcome:
    """What one rank's run of every side returns, gathered by rank 0 for :func:`assemble_pipeline`."""

    results: dict[Side, StageResult]
    comparisons: dict[Side, GradComparison]   # each planned side's first-step gradients against ``none``'s
    negative_rejected: bool | None            # the perturbed control was told apart (None: not run)
    losses: dict[Side, float | None]          # first-step loss (the last stage's only)
    missing_grads: dict[Side, list[str]]      # parameters of the stage left without a gradient
    notes: list[str]
    plans: dict[Side, PipelinePlan]           # uniform and remat, where planned (every rank plans the same)


# -- assembly (rank 0) ----------------------------------------------------------------------------------

def _med(xs: list[float]) -> float:
    """remat.measure's p50 (the one definition), 0.0 for no values."""
    return float(p50(xs)) if xs else 0.0


def _pipeline_step_ms(stages: list[StageResult]) -> list[float]:
    """Per timed step, the first stage's start to the last stage's end (ms; one clock per host)."""
    n = min(len(r.step_ns) for r in stages)
    return [(max(r.step_ns[i][1] for r in stages) - min(r.step_ns[i][0] for r in stages)) / 1e6 for i in range(n)]


def _stage_row(r: StageResult, pipeline_ms: list[float], t0_ns: int) -> RankFigures:
    """``pipeline_ms``: :func:`_pipeline_step_ms` (NOTE [pipeline instruments]); ``t0_ns``: the side's earliest
    stage start of the last timed step, where its timeline starts. The p2p figures are the row's communication."""
    steps = [(b - a) / 1e6 for a, b in r.step_ns]
    idle = [max(0.0, g - c) for g, c in zip(pipeline_ms, r.compute_ms)]
    bubble = [i / g if g > 0 else 0.0 for i, g in zip(idle, pipeline_ms)]
    shift = r.timeline_t0_ns - t0_ns
    stage = StageFigures(
        stage=r.stage, host=r.host, in_flight=r.in_flight, blocks=r.blocks, boundaries=r.boundaries,
        forward_ms=_med(r.forward_ms), backward_ms=_med(r.backward_ms), replay_ms=_med(r.replay_ms),
        optimizer_ms=_med(r.optimizer_ms), idle_ms=_med(idle), bubble_fraction=min(1.0, max(0.0, _med(bubble))),
        held_at_backward_bytes=r.held_at_backward_bytes, bubble_delta_vs_none=None, predicted_peak_bytes=None,
        grad_sq_sum=r.grad_sq_sum,
        timeline=[TimelineSpan(kind=e.kind, mb=e.mb, start_ms=(e.start_ns + shift) / 1e6,
                               end_ms=(e.end_ns + shift) / 1e6) for e in r.timeline])
    return RankFigures(rank=r.rank, peak_bytes=r.peak_bytes, p50_ms=percentile(steps, 50),
                       p95_ms=percentile(steps, 95), exposed_comm_ms=_med(r.exposed_p2p_ms), comm_ms=_med(r.p2p_ms),
                       ablation_step_ms=None, step_ms=steps, stage=stage)


def _side_report(stages: list[StageResult], batch_size: int) -> SideReport:
    pipeline_ms = _pipeline_step_ms(stages)
    t0 = min(r.timeline_t0_ns for r in stages)
    rows = [_stage_row(r, pipeline_ms, t0) for r in stages]
    step = percentile(pipeline_ms, 50)
    return SideReport(per_rank=rows, global_samples_per_s=batch_size / (step / 1000.0) if step > 0 else 0.0,
                      step_ms_p50=step, collectives={}, exposed_comm_ms=worst([r.exposed_comm_ms for r in rows]),
                      comm_ms=worst([r.comm_ms for r in rows]), ablation_step_ms=None,
                      step_ms_p95=percentile(pipeline_ms, 95))


def _compare_sides(sides: dict[Side, SideReport], plans: dict[Side, PipelinePlan]) -> None:
    """Fill each planned stage's bubble delta against the unplanned one (where replay stretched the bubbles)
    and its plan's predicted peak."""
    none = sides.get(Side.NONE)
    for name, side in sides.items():
        deltas: list[float | None] = [None] * len(side.per_rank)
        if name is not Side.NONE and none is not None:
            deltas = [max(-1.0, min(1.0, _stage(s).bubble_fraction - _stage(base).bubble_fraction))
                      for s, base in zip(side.per_rank, none.per_rank)]
        predicted: list[int | None] = [st.plan.predicted_peak_bytes for st in plans[name].stages] \
            if name in plans else [None] * len(side.per_rank)
        side.per_rank = [dataclasses.replace(r, stage=dataclasses.replace(_stage(r), bubble_delta_vs_none=d,
                                                                          predicted_peak_bytes=p))
                         for r, d, p in zip(side.per_rank, deltas, predicted)]


def _stage(row: RankFigures) -> StageFigures:
    assert row.stage is not None, "a pipeline row"
    return row.stage


def _equivalence(name: Side, gathered: list[RankOutcome]) -> PipelineEquivalence | None:
    """Side ``name``'s first step against ``none``'s on every stage (None: a stage did not compare them)."""
    comps = [g.comparisons.get(name) for g in gathered]
    if any(c is None for c in comps):
        return None
    last = gathered[-1].losses   # the last stage computes the loss
    first_loss = last.get(Side.NONE)
    missing = [f"stage {k}: {n}: no gradient" for k, g in enumerate(gathered)
               for side in (Side.NONE, name) for n in g.missing_grads.get(side, [])]
    bitwise = all(c.bitwise_equal and not c.mismatched for c in comps) and not missing
    first_loss_equal = None if first_loss is None else first_loss == last.get(name)
    return PipelineEquivalence(
        criterion="bitwise", bitwise_equal=bitwise, max_abs_diff=max(c.max_abs_diff for c in comps),
        params_compared=sum(c.params_compared for c in comps),
        mismatched=[f"stage {k}: {m}" for k, c in enumerate(comps) for m in c.mismatched] + missing,
        first_loss_equal=first_loss_equal, ok=bitwise and first_loss_equal is not False)


def _notes(memory_source: MemorySource, rank_notes: list[str]) -> list[str]:
    return [
        "bubble_fraction = idle / step per stage, idle = the pipeline's step (first stage's start to last stage's "
        "end, one host clock) - union(forward, loss, backward, optimizer) of the stage; "
        "ideal_bubble_fraction = (p - 1) / (v m + p - 1) (v stages per rank, 1 but for interleaved schedules) for "
        "equal stage times and free communication; with v > 1 a 'stage' row is a rank and its v stages",
        "a stage row's comm_ms is the time the stage's thread is blocked posting or waiting on isend/irecv (it "
        "includes waiting for a peer still computing); its exposed_comm_ms = union(p2p) - union(compute)",
        "replay_ms is inside backward_ms; peak_bytes and held_at_backward_bytes come from one extra step under the "
        f"live-tensor tracker ({memory_source})",
        "step p50/p95: per step, the first stage's start to the last stage's end; samples/s = batch_size / p50",
        *rank_notes,
    ]


def assemble_pipeline(cfg: Any, gathered: list[RankOutcome], *, torch_version: str,
                      memory_source: MemorySource) -> DistributedReport:
    """Rank 0: the report from every rank's :class:`RankOutcome` (ordered by rank); ``cfg``: the run's
    DistributedConfig (engine pipeline). Each rank's stages see the whole batch: ``samples_per_step`` is the
    batch on every rank."""
    p, pp = cfg.world_size, cfg.pipeline
    batch_size = cfg.batch_size
    plans = gathered[0].plans
    budget = plans[Side.REMAT].budget_bytes if Side.REMAT in plans else None
    sides = {name: _side_report([g.results[name] for g in gathered], batch_size) for name in pp.sides}
    _compare_sides(sides, plans)
    equivalence = {name: eq for name in sides if name is not Side.NONE
                   if (eq := _equivalence(name, gathered)) is not None}
    negs = [g.negative_rejected for g in gathered]
    remat = plans.get(Side.REMAT)
    figures = PipelineFigures(
        schedule=pp.schedule, microbatches=pp.microbatches, batch_size=batch_size,
        split_points=list(pp.split_points), split_source=pp.split_source, stages_per_rank=pp.stages_per_rank,
        ideal_bubble_fraction=ideal_bubble(p, pp.microbatches, pp.stages_per_rank), timeout_s=cfg.timeout_s,
        step_ms_p95={name: side.step_ms_p95 for name, side in sides.items()}, equivalence=equivalence,
        negative_control_rejected=None if any(x is None for x in negs) else all(negs), plans=dict(plans))
    report = DistributedReport.of(
        {name.value: side for name, side in sides.items()}, spec=cfg.spec, shape=dict(cfg.shape), world_size=p,
        engine=Engine.PIPELINE, backend=cfg.backend, device=cfg.device, dtype=cfg.dtype, torch_version=torch_version,
        steps=cfg.steps, warmup=cfg.warmup, comm_steps=0, samples_per_step=[batch_size] * p,
        memory_source=memory_source, comm_source=COMM_SOURCE,
        plan_boundaries=[] if remat is None else [b.module for st in remat.stages for b in st.plan.boundaries],
        equivalence=None, budget_bytes=budget, notes=_notes(memory_source, gathered[0].notes), pipeline=figures)
    # never write a pipeline.json that the launcher (DistributedReport.from_json) would refuse
    DistributedReport.from_json(report.to_json())
    return report
