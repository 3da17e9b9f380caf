"""Results of a distributed run: what each rank measured, and the one per-rank report (``distributed.json``;
a pipeline run's is ``pipeline.json``).

Each rank produces a :class:`RankResult` (a pipeline rank, its ``RankOutcome``: remat/distributed/pipeline/
report.py); rank 0 gathers them and assembles the :class:`DistributedReport`, which lays its sides (the control
and the plan; a pipeline's ``none``, ``uniform`` and ``remat``) side by side under every figure (``per_rank``,
``collectives``, ``exposed_comm_ms``...). NOTE [one per-rank report] says what a pipeline run adds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any

from .._codec import AS_WRITTEN, ROW, Bytes, JsonCodec, Len, Ms, Reading, json_field, schema
from .._json import MEMORY_SOURCE, MODULE_PATH, MS, Enum, Int, JsonValue, List, Map, Num, Opt, Str, Tuple, validate
from ..errors import DistributedError, RematError, StaleReportFormat
from ..plan.pipeline import PIPELINE_PLAN, PipelinePlan, Schedule, Side
from ..types import MemorySource
from ..percentile import percentile
from .config import DistributedConfig, Engine

REPORT_SCHEMA_VERSION = 1
CONTROL, PLAN = "control", "plan"
SIDES = (CONTROL, PLAN)   # DDP and FSDP2; a pipeline's sides are remat.plan.pipeline.Side's values


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# -- what one rank measured -----------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class RankSide:
    """One rank, one side (control or plan). Times in ms, bytes in bytes."""

    step_ms: list[float]                          # every timed warm step
    peak_bytes: int                               # one whole step
    peak_phase: str | None
    exposed_comm_ms: list[float] | None           # per comm step; None where not measured (CUDA)
    comm_ms: list[float] | None                   # per comm step: union of collective intervals
    collectives: dict[str, CollectiveCount]       # per step (every timed step had the same)
    collectives_stable: bool                      # all timed steps issued the same collectives
    ablation_step_ms: list[float] | None          # no-op comm hook, same compute
    loss0: float                                  # loss of the first step (same data, same weights)


@dataclasses.dataclass(kw_only=True)
class GradComparison:
    """First-step gradients of the plan against the control, on one rank (local shards on FSDP2)."""

    params_compared: int
    bitwise_equal: bool
    within_tolerance: bool
    max_abs_diff: float
    worst_param: str | None
    mismatched: list[str]      # params whose gradient is missing on one side or has another shape


@dataclasses.dataclass(kw_only=True)
class RankResult:
    rank: int
    host: str
    samples_per_step: int
    memory_source: MemorySource
    control: RankSide
    plan: RankSide | None = None
    grads: GradComparison | None = None


# -- the report ------------------------------------------------------------------------------------

# NOTE [one per-rank report]
# Every engine's run is one DistributedReport: per side, one row per rank (RankFigures: step p50/p95, peak,
# communication), the side's figures beside it, the equivalence, the per-device budget and the verdict
# (``passed``). A pipeline run (engine pipeline) has the sides ``none``, ``uniform`` and ``remat`` (the
# planned one) in place of ``control`` and ``plan``; each row gains its ``stage`` (StageFigures: which
# stage, what it ran and held, its bubble and the last timed step's timeline), and the report gains
# ``pipeline`` (PipelineFigures: schedule, split, ideal bubble, each side's step p95, the equivalence of
# each planned side against ``none`` and the negative control, the per-stage plans). A pipeline row's
# ``comm_ms`` and ``exposed_comm_ms`` are its p2p figures (NOTE [pipeline instruments]). The file of a
# pipeline run is checked against the schema derived from these fields before it is read, as pipeline.json
# always was (NOTE [hostile JSON]); a DDP or FSDP2 file only for its version, as distributed.json always was.
# pipeline.json of the layout before this report (its own ``sides`` object) is refused with the command
# that makes it again (StaleReportFormat).

Index = Annotated[int, Int(0, 1 << 20)]
Share = Annotated[float, Num(0, 1)]
Paths = Annotated[list[str], List(MODULE_PATH, max_len=100_000)]
MsAsWritten = Annotated[float, AS_WRITTEN, MS]   # read as the file holds it: a figure read and written keeps its bytes
SIDE_KEY = "|".join([*SIDES, *(s.value for s in Side)])
PLANNED = r"uniform|remat"   # the pipeline sides a plan, and so an equivalence, is recorded for
TIMELINE = List(Tuple(Str(max_len=100), Int(-1, 1 << 20), Num(-1e9, 1e9), Num(-1e9, 1e9)), max_len=1_000_000)


def _by_side(value: Any) -> Map:
    """The spec of one figure laid side by side: ``{side: value}``."""
    return Map(value, key=SIDE_KEY, max_len=3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Interval:
    """What one interval of a pipeline stage's step ran (NOTE [pipeline instruments])."""

    kind: str        # forward, loss, backward, replay, optimizer, p2p:<what>
    mb: int          # microbatch, -1 when none

    @property
    def category(self) -> str:
        """The kind with every p2p interval as one: ``p2p``."""
        return "p2p" if self.kind.startswith("p2p:") else self.kind


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimelineSpan(Interval):
    """One interval of a side's last timed step: ms from the earliest stage's start (one host clock). Written as a
    row ``[kind, mb, start_ms, end_ms]`` (ROW): a timeline holds thousands."""

    start_ms: float
    end_ms: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageFigures(JsonCodec):
    """A pipeline row's stage (with several stages per rank: the rank's): which one, what it ran and held. Medians
    over the timed steps (ms), bytes in bytes."""

    stage: Index
    host: Annotated[str, Str(max_len=300)]
    in_flight: Annotated[int, Int(1, 1 << 20)]   # microbatches held at the peak (NOTE [pipeline in-flight cost model])
    blocks: Paths
    boundaries: Paths                    # the side's checkpoint boundaries on the stage
    forward_ms: Ms
    backward_ms: Ms
    replay_ms: Ms
    optimizer_ms: Ms
    idle_ms: Ms                          # the pipeline's step - the stage's compute
    bubble_fraction: Share               # idle / the pipeline's step
    held_at_backward_bytes: list[Bytes]
    bubble_delta_vs_none: Annotated[float, Num(-1, 1)] | None   # bubble_fraction less the unplanned side's
    predicted_peak_bytes: Annotated[int, Int(-(2 ** 53), 2 ** 53)] | None   # the stage plan's (None: unplanned)
    grad_sq_sum: Annotated[float, Num(0, 1e300)] | None
    timeline: Annotated[list[Annotated[TimelineSpan, ROW]], TIMELINE]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFigures(JsonCodec):
    """One rank's figures for one side, as ``per_rank`` lists them (a pipeline's: one stage's, ``stage``). The
    optional figures read as None (``step_ms`` as no steps) when the key is missing."""

    rank: Index
    peak_bytes: Bytes
    p50_ms: Ms
    p95_ms: Ms
    exposed_comm_ms: MsAsWritten | None = json_field(absent=None)   # p50 over the comm steps
    comm_ms: MsAsWritten | None = json_field(absent=None)           # p50 over the comm steps
    ablation_step_ms: MsAsWritten | None = json_field(absent=None)  # p50
    step_ms: list[Ms] = json_field(default_factory=list)
    stage: StageFigures | None = json_field(default=None, omit=None)   # a pipeline's row


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveCount(JsonCodec):
    """Collectives of one op in one training step: how many calls, how many payload bytes."""

    count: Annotated[int, Int(0, 1 << 40)]
    bytes: Bytes


@dataclasses.dataclass(kw_only=True)
class SideReport:
    """All ranks, one side, as :meth:`DistributedReport.side` reads them. Global figures follow the slowest rank
    (it sets the step time); a pipeline's, its step from the first stage's start to the last stage's end."""

    per_rank: list[RankFigures]
    global_samples_per_s: float          # samples per step over ranks / the step p50
    step_ms_p50: float
    collectives: dict[str, CollectiveCount]
    exposed_comm_ms: float | None        # slowest (largest) per-rank p50
    comm_ms: float | None
    ablation_step_ms: float | None       # slowest per-rank p50 with the no-op comm hook
    step_ms_p95: float | None = None     # a pipeline's step p95

    @property
    def max_peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.per_rank)

    @property
    def max_bubble_fraction(self) -> float | None:
        """The largest stage bubble (None: not a pipeline)."""
        bubbles = [r.stage.bubble_fraction for r in self.per_rank if r.stage is not None]
        return max(bubbles) if bubbles else None

    @property
    def timeline_span_ms(self) -> float | None:
        """From the earliest to the latest recorded interval of the last timed step (None: none recorded)."""
        events = [e for r in self.per_rank if r.stage is not None for e in r.stage.timeline]
        return max(e.end_ms for e in events) - min(e.start_ms for e in events) if events else None


@dataclasses.dataclass(kw_only=True)
class Equivalence(JsonCodec):
    """Is the planned distributed step the same training step as the control? Its JSON adds ``ok``
    (computed, never read back)."""

    criterion: Annotated[str, Str(max_len=200)]   # "bitwise" or "allclose(rtol=..., atol=...)"
    grads_match: bool                   # on every rank, per the criterion
    bitwise_equal: bool
    max_abs_diff: Annotated[float, AS_WRITTEN, Num(nonfinite=True)]
    worst: Annotated[dict[str, Any] | None, Opt(JsonValue())]   # {"rank": r, "param": name}
    params_compared: Annotated[int, Int(0, 1 << 40)]   # per rank
    mismatched: Annotated[list[str], List(Str(max_len=2_000))]
    loss_equal: bool                    # first-step loss, every rank
    collective_counts_equal: bool       # per step, by op, on every rank
    # side -> op -> count (rank 0)
    collective_counts: Annotated[dict[str, dict[str, int]], Map(JsonValue())] = json_field(then=("ok",))

    @property
    def ok(self) -> bool:
        return self.grads_match and self.collective_counts_equal and self.loss_equal


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


@dataclasses.dataclass(kw_only=True)
class PipelineFigures(JsonCodec):
    """What a pipeline run adds to the report (NOTE [one per-rank report]): its schedule and split, the ideal
    bubble, each side's step p95, each planned side's equivalence, the negative control, the per-stage plans."""

    schedule: Schedule
    microbatches: Annotated[int, Int(1, 100_000)]
    batch_size: Annotated[int, Int(1, 1 << 40)]
    split_points: Paths
    split_source: Annotated[str, Str(max_len=2_000)]
    stages_per_rank: Annotated[int, Int(1, 1000)]
    ideal_bubble_fraction: Share
    timeout_s: Annotated[float, Num(0, 1e9)]
    step_ms_p95: Annotated[dict[Side, float], Map(MS, key=r"none|uniform|remat", max_len=3)]
    equivalence: Annotated[dict[Side, PipelineEquivalence], Map(schema(PipelineEquivalence), key=PLANNED, max_len=2)]
    negative_control_rejected: bool | None
    plans: Annotated[dict[Side, PipelinePlan], Map(PIPELINE_PLAN, key=PLANNED, max_len=2)]

    @property
    def ok(self) -> bool:
        """Every planned side bitwise equal to the unplanned run, and the negative control rejected."""
        return all(e.ok for e in self.equivalence.values()) and self.negative_control_rejected is not False


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadRef(JsonCodec):
    """The workload every rank rebuilt: its spec and shape keywords."""

    spec: Annotated[str, Str(max_len=4096)]
    shape: Annotated[dict[str, Any], Map(JsonValue(), key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100)]


Figure = Annotated[dict[str, MsAsWritten | None], _by_side(Opt(MS))]
Name = Annotated[str, Str(max_len=200)]
Fifty = Annotated[str, Str(max_len=50)]


def _refuse_old_layout(d: dict[str, Any]) -> None:
    """A pipeline report in the layout before NOTE [one per-rank report], refused with the command that makes it
    again."""
    if "sides" in d and "engine" not in d:
        raise stale_pipeline_report(d)


def _pipeline_schema(d: dict[str, Any]) -> None:
    """A pipeline run's report is held to the derived schema; a DDP/FSDP2 one to its version (NOTE [one per-rank
    report])."""
    if d.get("engine") == Engine.PIPELINE.value:
        validate(d, schema(DistributedReport), error=DistributedError, what="pipeline report")


# NOTE [checked reading] in remat/_codec.py
_READING = Reading(error=DistributedError, what="distributed.json", version=REPORT_SCHEMA_VERSION, schema=False,
                   refuse=_refuse_old_layout, shape=_pipeline_schema, wrap=(RematError, KeyError, TypeError, ValueError))


@dataclasses.dataclass(kw_only=True)
class DistributedReport(JsonCodec, reading=_READING):
    """The one per-rank report of a run at world size N (NOTE [one per-rank report]): each figure side by side
    (``{side: figure}``; a side not run holds None), then the equivalence, the budget and the verdict
    (``over_budget_ranks``, ``passed``: computed, never read back)."""


    schema_version: Annotated[int, Enum(REPORT_SCHEMA_VERSION)] = json_field(default=REPORT_SCHEMA_VERSION,
                                                                            required=True)
    world_size: Annotated[int, Int(1, 1 << 16)]
    engine: Engine
    backend: Fifty
    device: Fifty
    dtype: Fifty
    workload: WorkloadRef
    torch_version: Annotated[str, Str(max_len=100)]
    steps: Annotated[int, Int(1, 1000)]
    warmup: Annotated[int, Int(1, 100)]
    comm_steps: Annotated[int, Int(0, 1000)]      # 0: none run (a pipeline)
    samples_per_step: Annotated[list[int], List(Int(0, 1 << 40), max_len=1 << 16)]   # per rank
    memory_source: Annotated[MemorySource, MEMORY_SOURCE]
    comm_source: Name
    plan_boundaries: Paths
    per_rank: Annotated[dict[str, list[RankFigures] | None], _by_side(Opt(List(schema(RankFigures), max_len=1 << 16)))]
    global_samples_per_s: Annotated[dict[str, float | None], _by_side(Opt(Num(0, 1e15)))]
    step_ms_p50: Annotated[dict[str, float | None], _by_side(Opt(MS))]
    collectives: Annotated[dict[str, dict[str, CollectiveCount] | None],
                           _by_side(Opt(Map(schema(CollectiveCount), max_len=1000)))]
    exposed_comm_ms: Figure
    comm_ms: Figure
    ablation_step_ms: Figure
    equivalence: Equivalence | None
    # the per-device budget the planned peaks are held to (None: none given)
    # (a file always has both keys; a DDP or FSDP2 file is read without its schema, so they read as their defaults)
    budget_bytes: Bytes | None = json_field(default=None, then=("over_budget_ranks", "passed"), required=True)
    notes: Annotated[list[Annotated[str, Str(max_len=4_000)]], Len(100)] = json_field(default_factory=list,
                                                                                     required=True)
    pipeline: PipelineFigures | None = json_field(default=None, omit=None)   # engine pipeline's own figures

    @classmethod
    def of(cls, sides: dict[str, SideReport | None], *, spec: str, shape: dict[str, Any], **fields: Any) \
            -> "DistributedReport":
        """The report of ``sides`` (in the order given; None: a side not run), each figure laid side by side."""
        def by(get: Any) -> dict[str, Any]:
            return {name: None if s is None else get(s) for name, s in sides.items()}

        return cls(workload=WorkloadRef(spec=spec, shape=shape), per_rank=by(lambda s: s.per_rank),
                   global_samples_per_s=by(lambda s: s.global_samples_per_s), step_ms_p50=by(lambda s: s.step_ms_p50),
                   collectives=by(lambda s: s.collectives), exposed_comm_ms=by(lambda s: s.exposed_comm_ms),
                   comm_ms=by(lambda s: s.comm_ms), ablation_step_ms=by(lambda s: s.ablation_step_ms), **fields)

    @property
    def spec(self) -> str:
        return self.workload.spec

    @property
    def shape(self) -> dict[str, Any]:
        return self.workload.shape

    @property
    def sides(self) -> list[str]:
        """The sides run, in order."""
        return [name for name, rows in self.per_rank.items() if rows is not None]

    def side(self, name: str) -> SideReport | None:
        rows = self.per_rank.get(name)
        if rows is None:
            return None
        p95 = None if self.pipeline is None else self.pipeline.step_ms_p95.get(Side(name))
        return SideReport(per_rank=rows, global_samples_per_s=float(self.global_samples_per_s.get(name) or 0.0),
                          step_ms_p50=float(self.step_ms_p50.get(name) or 0.0),
                          collectives=self.collectives.get(name) or {}, exposed_comm_ms=self.exposed_comm_ms.get(name),
                          comm_ms=self.comm_ms.get(name), ablation_step_ms=self.ablation_step_ms.get(name),
                          step_ms_p95=p95)

    @property
    def control(self) -> SideReport:
        side = self.side(CONTROL)
        if side is None:
            raise DistributedError(f"a {self.engine.value} report has no control side")
        return side

    @property
    def plan(self) -> SideReport | None:
        """The planned side: ``plan`` (a pipeline's: ``remat``)."""
        return self.side(self.planned)

    @property
    def planned(self) -> str:
        """The side whose peaks are held to the budget."""
        return Side.REMAT.value if self.pipeline is not None else PLAN

    @property
    def remat_plan(self) -> PipelinePlan | None:
        """A pipeline's per-stage plans (None: not a pipeline, or it had no ``remat`` side)."""
        return None if self.pipeline is None else self.pipeline.plans.get(Side.REMAT)

    @property
    def over_budget(self) -> list[RankFigures]:
        """The rows of the planned side whose peak is above the per-device budget (none without a plan or budget)."""
        plan = self.plan
        if plan is None or self.budget_bytes is None:
            return []
        return [r for r in plan.per_rank if r.peak_bytes > self.budget_bytes]

    @property
    def over_budget_ranks(self) -> Annotated[list[int], List(Int(0, 1 << 20), max_len=1 << 16)]:
        return [r.rank for r in self.over_budget]

    @property
    def over_budget_stages(self) -> list[int]:
        """A pipeline's stages over the budget on its planned side."""
        return [r.stage.stage for r in self.over_budget if r.stage is not None]

    @property
    def passed(self) -> bool:
        """The plan is the control's training step (a pipeline's: every planned side bitwise the unplanned one's
        and the negative control rejected) and fits the budget on every rank."""
        return ((self.equivalence is None or self.equivalence.ok) and (self.pipeline is None or self.pipeline.ok)
                and not self.over_budget)

    @property
    def timeline_span_ms(self) -> float | None:
        """The longest side's last timed step (ms): one time axis for every side's timeline."""
        spans = [t for name in self.sides if (side := self.side(name)) and (t := side.timeline_span_ms) is not None]
        return max(spans) if spans else None


_PLAIN = re.compile(r"[\w.:/=,-]{1,200}")   # a value put in the command as it is: no space, quote or shell character


def remake_pipeline_command(report: Any, workload: Any = None, shape: Any = None) -> str:
    """``remat distributed --engine pipeline ...`` with an old pipeline report's own settings where they are plain
    (the file is unchecked), else placeholders: the command that makes it again. ``workload`` and ``shape``: the
    receipt context's (default: the report's own). A setting left at its default (no shape, no budget) is left out."""
    rep = report if isinstance(report, dict) else {}
    workload = rep.get("spec") if workload is None else workload
    shape = rep.get("shape") if shape is None else shape
    splits = rep.get("split_points")
    given = {"--workload": workload, "--world-size": rep.get("world_size"),
             "--shape": ",".join(f"{k}={v}" for k, v in shape.items()) if isinstance(shape, dict) else "SHAPE",
             "--schedule": rep.get("schedule"), "--microbatches": rep.get("microbatches"),
             "--split-points": ",".join(map(str, splits)) if isinstance(splits, list) else None,
             "--budget": rep.get("budget_bytes")}
    needed = {"--workload": "WORKLOAD", "--world-size": "P", "--schedule": "SCHEDULE", "--microbatches": "M",
              "--split-points": "PATH.I,..."}
    parts = ["remat distributed --engine pipeline"]
    for flag, v in given.items():
        text = str(v) if v not in (None, "") and not isinstance(v, bool) and _PLAIN.fullmatch(str(v)) else None
        if text or flag in needed or (flag == "--shape" and v):
            parts.append(f"{flag} {text or needed.get(flag, 'SHAPE')}")
    return " ".join([*parts, "--out DIR"])


def stale_pipeline_report(d: dict[str, Any]) -> StaleReportFormat:
    """The refusal of a pipeline report of the layout before NOTE [one per-rank report]."""
    return StaleReportFormat(
        "this is a pipeline report in the old layout (its own 'sides' object), which this remat no longer reads: a "
        "pipeline run is now reported through the one per-rank report (engine pipeline)",
        tip=f"make it again with this remat: `{remake_pipeline_command(d)}`")


# -- assembly (rank 0) ------------------------------------------------------------------------------

def _p50(values: list[float] | None) -> float | None:
    return None if not values else _finite_or_none(percentile(values, 50))


def _side_report(ranks: list[tuple[int, int, RankSide]]) -> SideReport:
    per_rank = [RankFigures(rank=r, peak_bytes=s.peak_bytes, p50_ms=percentile(s.step_ms, 50),
                            p95_ms=percentile(s.step_ms, 95), exposed_comm_ms=_p50(s.exposed_comm_ms),
                            comm_ms=_p50(s.comm_ms), ablation_step_ms=_p50(s.ablation_step_ms), step_ms=s.step_ms)
                for r, _, s in ranks]
    slowest = max(f.p50_ms for f in per_rank)
    samples = sum(n for _, n, _ in ranks)

    return SideReport(per_rank=per_rank, global_samples_per_s=samples / (slowest / 1e3), step_ms_p50=slowest,
                      collectives=ranks[0][2].collectives,
                      exposed_comm_ms=worst([f.exposed_comm_ms for f in per_rank]),
                      comm_ms=worst([f.comm_ms for f in per_rank]),
                      ablation_step_ms=worst([f.ablation_step_ms for f in per_rank]))


def worst(values: list[float | None]) -> float | None:
    """The largest per-rank figure: the slowest rank's (None when a rank has none)."""
    present = [v for v in values if v is not None]
    return max(present) if present and len(present) == len(values) else None


def _op_counts(side: RankSide) -> dict[str, int]:
    """Collectives per step, by op: how many calls."""
    return {op: c.count for op, c in side.collectives.items()}


def _same_collectives(r: RankResult) -> bool:
    """On one rank: the plan issues the control's collectives (count per op, per step), each side the same
    every timed step (a replay that re-issues a collective is another training step)."""
    return (r.plan is not None and _op_counts(r.control) == _op_counts(r.plan)
            and r.control.collectives_stable and r.plan.collectives_stable)


def _same_loss(r: RankResult) -> bool:
    return r.plan is not None and r.plan.loss0 == r.control.loss0


def _equivalence(results: list[RankResult], criterion: str) -> Equivalence:
    grads = [(r.rank, r.grads) for r in results if r.grads is not None]
    worst_rank, worst_cmp = max(grads, key=lambda rg: rg[1].max_abs_diff)
    bitwise = all(g.bitwise_equal for _, g in grads)
    within = all(g.within_tolerance for _, g in grads)
    mismatched = sorted({f"rank {r}: {m}" for r, g in grads for m in g.mismatched})
    r0 = results[0]
    assert r0.plan is not None
    return Equivalence(
        criterion=criterion,
        grads_match=(bitwise if criterion == "bitwise" else within) and not mismatched,
        bitwise_equal=bitwise and not mismatched,
        max_abs_diff=worst_cmp.max_abs_diff,
        worst=None if worst_cmp.worst_param is None else {"rank": worst_rank, "param": worst_cmp.worst_param},
        params_compared=worst_cmp.params_compared,
        mismatched=mismatched,
        loss_equal=all(_same_loss(r) for r in results),
        collective_counts_equal=all(_same_collectives(r) for r in results),
        collective_counts={"control": _op_counts(r0.control), "plan": _op_counts(r0.plan)},
    )


def assemble(results: list[RankResult], cfg: DistributedConfig, *, comm_source: str, torch_version: str,
             criterion: str, notes: list[str]) -> DistributedReport:
    """Rank 0: the report of the run of ``cfg`` from every rank's :class:`RankResult` (ordered by rank);
    ``comm_source``: how communication was timed; ``criterion``: "bitwise" or "allclose(...)"
    (worker.equivalence_criterion)."""
    results = sorted(results, key=lambda r: r.rank)
    if [r.rank for r in results] != list(range(cfg.world_size)):
        raise DistributedError(f"expected results from ranks 0..{cfg.world_size - 1}, got {[r.rank for r in results]}")
    control = _side_report([(r.rank, r.samples_per_step, r.control) for r in results])
    has_plan = results[0].plan is not None
    plan = _side_report([(r.rank, r.samples_per_step, r.plan) for r in results if r.plan is not None]) if has_plan else None
    return DistributedReport.of(
        {CONTROL: control, PLAN: plan},
        world_size=cfg.world_size, engine=cfg.engine, backend=cfg.backend, device=cfg.device, dtype=cfg.dtype,
        spec=cfg.spec, shape=cfg.shape, steps=cfg.steps, warmup=cfg.warmup, comm_steps=cfg.comm_steps,
        samples_per_step=[r.samples_per_step for r in results], memory_source=results[0].memory_source,
        comm_source=comm_source, torch_version=torch_version,
        plan_boundaries=[] if cfg.plan is None else [b.module for b in cfg.plan.boundaries],
        equivalence=_equivalence(results, criterion) if has_plan else None, notes=notes, budget_bytes=cfg.device_budget_bytes)
