"""What a pipeline run measured (``pipeline.json``): per side, per stage, and the schedule's ideal bubble.

Sides (:class:`~remat.plan.pipeline.Side`): ``none`` (no plan), ``uniform`` (the same rule on every
stage, e.g. every block), ``remat`` (per-stage plans, NOTE [pipeline in-flight cost model]). Times in ms,
bytes in bytes. NOTE [pipeline instruments] (remat/distributed/pipeline/worker.py) says how each figure is read.

Each rank's :class:`PipelineRank.run <remat.distributed.pipeline.worker.PipelineRank>` returns a
:class:`RankOutcome` (one :class:`StageResult` per side, raw ns intervals); rank 0 gathers them and
:func:`assemble_pipeline` turns them into the :class:`PipelineReport`: per side a :class:`SideReport` of
:class:`StageReport` rows (medians, bubbles, the last timed step's :class:`TimelineSpan` list), and per
planned side a :class:`PipelineEquivalence` against the unplanned one.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from ..._codec import Bytes, JsonCodec, Len, Ms, from_json, json_field, schema
from ..._json import MODULE_PATH, Enum, Int, JsonValue, List, Map, Num, Str, Tuple, validate
from ...errors import DistributedError, PlanError
from ...plan.pipeline import PIPELINE_PLAN, PipelinePlan, Schedule, Side, ideal_bubble
from ...types import MemorySource
from ...measure import p50, percentile
from ..report import GradComparison

PIPELINE_REPORT_SCHEMA_VERSION = 1

# the bounds of the report's fields (NOTE [codecs from the types] in remat/_codec.py)
Index = Annotated[int, Int(0, 1 << 20)]
Share = Annotated[float, Num(0, 1)]
Paths = Annotated[list[str], List(MODULE_PATH, max_len=100_000)]
TIMELINE = List(Tuple(Str(max_len=100), Int(-1, 1 << 20), Num(-1e9, 1e9), Num(-1e9, 1e9)), max_len=1_000_000)
PLANNED = r"uniform|remat"   # the sides a plan, and so an equivalence, is recorded for


# -- what one rank measured -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Interval:
    """What one interval of a stage's step ran (NOTE [pipeline instruments])."""

    kind: str        # forward, loss, backward, replay, optimizer, p2p:<what>
    mb: int          # microbatch, -1 when none

    @property
    def category(self) -> str:
        """The kind with every p2p interval as one: ``p2p``."""
        return "p2p" if self.kind.startswith("p2p:") else self.kind


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimelineEvent(Interval):
    """One interval on a rank, as recorded (``perf_counter_ns``)."""

    start_ns: int
    end_ns: int


@dataclasses.dataclass(kw_only=True)
class StageInfo:
    """Which stage (with several stages per rank: which rank), where it ran, what it runs and holds."""

    stage: Index
    rank: Index
    host: Annotated[str, Str(max_len=300)]
    in_flight: Annotated[int, Int(1, 1 << 20)]   # microbatches held at the peak (NOTE [pipeline in-flight cost model])
    blocks: Paths
    boundaries: Paths       # the side's checkpoint boundaries on the stage

    def info(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(StageInfo)}


@dataclasses.dataclass(kw_only=True)
class StageResult(StageInfo):
    """One stage (rank), one side, as measured on its rank (gathered by rank 0)."""

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


# -- the report ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class TimelineSpan(Interval):
    """One interval of a side's last timed step: ms from the earliest stage's start (one host clock)."""

    start_ms: float
    end_ms: float

    def to_json(self) -> list[Any]:   # a timeline holds thousands: a row, not an object
        return [self.kind, self.mb, self.start_ms, self.end_ms]

    @classmethod
    def from_json(cls, e: list[Any]) -> "TimelineSpan":
        kind, mb, start_ms, end_ms = e
        return cls(kind=kind, mb=mb, start_ms=start_ms, end_ms=end_ms)


@dataclasses.dataclass(kw_only=True)
class StageReport(StageInfo, JsonCodec):
    """One stage of one side: medians over the timed steps (ms), peaks (bytes), bubble fraction."""

    p50_ms: Ms                           # the stage's own step (its start to its end)
    p95_ms: Ms
    forward_ms: Ms
    backward_ms: Ms
    replay_ms: Ms
    optimizer_ms: Ms
    p2p_ms: Ms
    exposed_p2p_ms: Ms
    idle_ms: Ms                          # the pipeline's step - the stage's compute
    bubble_fraction: Share               # idle / the pipeline's step
    peak_bytes: Bytes
    held_at_backward_bytes: list[Bytes]
    fits_budget: bool | None             # None: no budget
    bubble_delta_vs_none: Annotated[float, Num(-1, 1)] | None   # bubble_fraction less the unplanned side's
    predicted_peak_bytes: Annotated[int, Int(-(2 ** 53), 2 ** 53)] | None   # the stage plan's (None: unplanned)
    grad_sq_sum: Annotated[float, Num(0, 1e300)] | None
    timeline: Annotated[list[TimelineSpan], TIMELINE]


@dataclasses.dataclass(kw_only=True)
class SideReport(JsonCodec):
    """Every stage of one side; the step runs from the first stage's start to the last stage's end."""

    per_stage: list[StageReport]
    p50_ms: Ms
    p95_ms: Ms
    samples_per_s: Annotated[float, Num(0, 1e15)]   # batch_size / p50
    max_peak_bytes: Bytes
    max_bubble_fraction: Share

    @property
    def timeline_span_ms(self) -> float | None:
        """From the earliest to the latest recorded interval of the last timed step (None: none recorded)."""
        events = [e for s in self.per_stage for e in s.timeline]
        return max(e.end_ms for e in events) - min(e.start_ms for e in events) if events else None


@dataclasses.dataclass(kw_only=True)
class PipelineEquivalence(JsonCodec):
    """A planned side's first step against the unplanned one's, same schedule and microbatches: bitwise."""

    criterion: Annotated[str, Enum("bitwise")]   # the only one a pipeline uses
    bitwise_equal: bool                  # every stage's gradients, and none missing
    max_abs_diff: Annotated[float, Num(0, 1e300)]
    params_compared: Annotated[int, Int(0, 1 << 40)]   # over every stage
    mismatched: Annotated[list[str], List(Str(max_len=2_000), max_len=100_000)]   # "stage k: <param>"
    first_loss_equal: bool | None        # None: no loss recorded
    ok: bool                             # bitwise_equal and the first loss not different


SIDES_MAP = Map(schema(SideReport), key=r"none|uniform|remat", max_len=3)
EQUIVALENCE_MAP = Map(schema(PipelineEquivalence), key=PLANNED, max_len=2)
PLANS_MAP = Map(PIPELINE_PLAN, key=PLANNED, max_len=2)
SHAPE_MAP = Map(JsonValue(), key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100)
FIFTY = Annotated[str, Str(max_len=50)]


@dataclasses.dataclass(kw_only=True)
class PipelineReport(JsonCodec):
    """``pipeline.json``: the run's settings, per side the stages' figures, the equivalence and the plans."""

    spec: Annotated[str, Str(max_len=4096)]
    shape: Annotated[dict[str, Any], SHAPE_MAP]
    world_size: Annotated[int, Int(2, 1 << 16)]
    schedule: Schedule
    microbatches: Annotated[int, Int(1, 100_000)]
    batch_size: Annotated[int, Int(1, 1 << 40)]
    split_points: Paths
    split_source: Annotated[str, Str(max_len=2_000)]
    stages_per_rank: Annotated[int, Int(1, 1000)]
    ideal_bubble_fraction: Share
    backend: FIFTY
    device: FIFTY
    dtype: FIFTY
    memory_source: MemorySource
    torch_version: Annotated[str, Str(max_len=100)]
    steps: Annotated[int, Int(1, 1000)]
    warmup: Annotated[int, Int(1, 100)]
    timeout_s: Annotated[float, Num(0, 1e9)]
    budget_bytes: Bytes | None           # remat's per-device budget (None: no remat side)
    sides: Annotated[dict[Side, SideReport], SIDES_MAP]
    equivalence: Annotated[dict[Side, PipelineEquivalence], EQUIVALENCE_MAP]
    negative_control_rejected: bool | None
    plans: Annotated[dict[Side, PipelinePlan], PLANS_MAP]
    notes: Annotated[list[Annotated[str, Str(max_len=4_000)]], Len(100)]
    schema_version: Annotated[int, Enum(PIPELINE_REPORT_SCHEMA_VERSION)] = json_field(
        default=PIPELINE_REPORT_SCHEMA_VERSION, required=True)

    def side(self, name: Side) -> SideReport | None:
        return self.sides.get(name)

    @property
    def remat_plan(self) -> PipelinePlan | None:
        """remat's per-stage plans (None when the run had no ``remat`` side)."""
        return self.plans.get(Side.REMAT)

    @property
    def over_budget_stages(self) -> list[int]:
        """The stages of remat's side not measured within the per-device budget ([]: no budget or no side)."""
        side = self.side(Side.REMAT)
        if side is None or self.budget_bytes is None:
            return []
        return [s.stage for s in side.per_stage if not s.fits_budget]

    @property
    def remat_fits(self) -> bool | None:
        """Whether every stage of remat's side measured within the per-device budget (None: no budget/side)."""
        if self.side(Side.REMAT) is None or self.budget_bytes is None:
            return None
        return not self.over_budget_stages

    @property
    def ok(self) -> bool:
        """Every planned side bitwise equal to the unplanned run, and the negative control rejected."""
        return all(e.ok for e in self.equivalence.values()) and self.negative_control_rejected is not False

    @property
    def timeline_span_ms(self) -> float | None:
        """The longest side's last timed step (ms): one time axis for every side's timeline."""
        spans = [s for side in self.sides.values() if (s := side.timeline_span_ms) is not None]
        return max(spans) if spans else None

    @classmethod
    def from_json(cls, d: Any) -> "PipelineReport":
        """Checked against :data:`PIPELINE_REPORT` first (NOTE [hostile JSON]); DistributedError if off."""
        if not isinstance(d, dict):
            raise DistributedError("pipeline report JSON must be an object")
        validate(d, PIPELINE_REPORT, error=DistributedError, what="pipeline report")
        try:
            return from_json(cls, d)
        except PlanError as exc:
            raise DistributedError(exc.message, tip=exc.tip) from exc


PIPELINE_REPORT = schema(PipelineReport)


# -- assembly (rank 0) ----------------------------------------------------------------------------------

def _med(xs: list[float]) -> float:
    """remat.measure's p50 (the one definition), 0.0 for no values."""
    return float(p50(xs)) if xs else 0.0


def _pipeline_step_ms(stages: list[StageResult]) -> list[float]:
    """Per timed step, the first stage's start to the last stage's end (ms; one clock per host)."""
    n = min(len(r.step_ns) for r in stages)
    return [(max(r.step_ns[i][1] for r in stages) - min(r.step_ns[i][0] for r in stages)) / 1e6 for i in range(n)]


def _stage_report(r: StageResult, budget: int | None, pipeline_ms: list[float], t0_ns: int) -> StageReport:
    """``pipeline_ms``: :func:`_pipeline_step_ms` (NOTE [pipeline instruments]); ``t0_ns``: the side's earliest
    stage start of the last timed step, where its timeline starts."""
    steps = [(b - a) / 1e6 for a, b in r.step_ns]
    idle = [max(0.0, g - c) for g, c in zip(pipeline_ms, r.compute_ms)]
    bubble = [i / g if g > 0 else 0.0 for i, g in zip(idle, pipeline_ms)]
    shift = r.timeline_t0_ns - t0_ns
    return StageReport(
        **r.info(), p50_ms=percentile(steps, 50), p95_ms=percentile(steps, 95), forward_ms=_med(r.forward_ms),
        backward_ms=_med(r.backward_ms), replay_ms=_med(r.replay_ms), optimizer_ms=_med(r.optimizer_ms),
        p2p_ms=_med(r.p2p_ms), exposed_p2p_ms=_med(r.exposed_p2p_ms), idle_ms=_med(idle),
        bubble_fraction=min(1.0, max(0.0, _med(bubble))), peak_bytes=r.peak_bytes,
        held_at_backward_bytes=r.held_at_backward_bytes,
        fits_budget=None if budget is None else r.peak_bytes <= budget,
        bubble_delta_vs_none=None, predicted_peak_bytes=None, grad_sq_sum=r.grad_sq_sum,
        timeline=[TimelineSpan(kind=e.kind, mb=e.mb, start_ms=(e.start_ns + shift) / 1e6,
                               end_ms=(e.end_ns + shift) / 1e6) for e in r.timeline])


def _side_report(stages: list[StageResult], budget: int | None, batch_size: int) -> SideReport:
    pipeline_ms = _pipeline_step_ms(stages)
    t0 = min(r.timeline_t0_ns for r in stages)
    per_stage = [_stage_report(r, budget, pipeline_ms, t0) for r in stages]
    step = percentile(pipeline_ms, 50)
    return SideReport(per_stage=per_stage, p50_ms=step, p95_ms=percentile(pipeline_ms, 95),
                      samples_per_s=batch_size / (step / 1000.0) if step > 0 else 0.0,
                      max_peak_bytes=max(s.peak_bytes for s in per_stage),
                      max_bubble_fraction=max(s.bubble_fraction for s in per_stage))


def _compare_sides(sides: dict[Side, SideReport], plans: dict[Side, PipelinePlan]) -> None:
    """Fill each planned stage's bubble delta against the unplanned one (where replay stretched the bubbles)
    and its plan's predicted peak."""
    none = sides.get(Side.NONE)
    for name, side in sides.items():
        if name is not Side.NONE and none is not None:
            for s, base in zip(side.per_stage, none.per_stage):
                s.bubble_delta_vs_none = max(-1.0, min(1.0, s.bubble_fraction - base.bubble_fraction))
        if name in plans:
            for s, st in zip(side.per_stage, plans[name].stages):
                s.predicted_peak_bytes = st.plan.predicted_peak_bytes


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
        "p2p_ms is the time the stage's thread is blocked posting or waiting on isend/irecv (it includes waiting "
        "for a peer still computing); exposed_p2p_ms = union(p2p) - union(compute)",
        "replay_ms is inside backward_ms; peak_bytes and held_at_backward_bytes come from one extra step under the "
        f"live-tensor tracker ({memory_source})",
        "step p50/p95: per step, the first stage's start to the last stage's end; samples/s = batch_size / p50",
        *rank_notes,
    ]


def assemble_pipeline(cfg: Any, gathered: list[RankOutcome], *, torch_version: str,
                      memory_source: MemorySource) -> PipelineReport:
    """Rank 0: the report from every rank's :class:`RankOutcome` (ordered by rank); ``cfg``: the run's DistributedConfig (engine pipeline)."""
    p, pp = cfg.world_size, cfg.pipeline
    batch_size = cfg.batch_size
    plans = gathered[0].plans
    budget = plans[Side.REMAT].budget_bytes if Side.REMAT in plans else None
    sides = {name: _side_report([g.results[name] for g in gathered], budget, batch_size) for name in pp.sides}
    _compare_sides(sides, plans)
    equivalence = {name: eq for name in sides if name is not Side.NONE
                   if (eq := _equivalence(name, gathered)) is not None}
    negs = [g.negative_rejected for g in gathered]
    report = PipelineReport(
        spec=cfg.spec, shape=dict(cfg.shape), world_size=p, schedule=pp.schedule, microbatches=pp.microbatches,
        batch_size=batch_size, split_points=list(pp.split_points), split_source=pp.split_source,
        stages_per_rank=pp.stages_per_rank,
        ideal_bubble_fraction=ideal_bubble(p, pp.microbatches, pp.stages_per_rank), backend=cfg.backend,
        device=cfg.device, dtype=cfg.dtype, memory_source=memory_source, torch_version=torch_version,
        steps=cfg.steps, warmup=cfg.warmup, timeout_s=cfg.timeout_s, budget_bytes=budget, sides=sides,
        equivalence=equivalence, negative_control_rejected=None if any(x is None for x in negs) else all(negs),
        plans=dict(plans), notes=_notes(memory_source, gathered[0].notes))
    # never write a pipeline.json that the launcher (PipelineReport.from_json) would refuse
    validate(report.to_json(), PIPELINE_REPORT, error=DistributedError, what="pipeline report")
    return report
