"""Per-stage plans for pipeline parallelism. Pure: no torch.

NOTE [pipeline in-flight cost model]
Under a pipeline schedule, stage k holds the saved activations of ``n_k`` microbatches at
its peak (its *in-flight* count): GPipe runs every forward before any backward, so every
stage holds all ``m``; torch's ``Schedule1F1B`` runs ``p - k`` warm-up forwards on stage k
(``min(m, p - k)``), so stage 0 holds up to ``p`` microbatches and the last stage one.
A boundary's saving is therefore counted once per microbatch held. Under torch's
``ScheduleInterleaved1F1B`` a rank runs ``v`` stages (``--stages-per-rank``); its load is
not a closed formula here: the rank walks the schedule's own action list
(``pipeline_order[rank]``: forwards add a microbatch to their stage, backwards remove one) and
takes each local stage's count at the moment the rank holds the most (``in_flight_from_order``).
One plan per *rank* then covers its ``v`` stages, each candidate's saving counted by the stage
it lies in, since the stages share the device and its budget.

We do not write a second optimiser: each stage gets its own :class:`ProfileReport`, derived
from the one profile of the whole model at the *microbatch* shape, and the ordinary
planners (``make_plan``: optimal, all, ...) plan it:

* candidates: those inside the stage's blocks only;
* ``saved_bytes[mode] * n_k`` (every held microbatch frees it);
* ``replay_ms[mode] * m`` (each microbatch replays once per step);
* ``replay_extra_bytes[mode] + saved_bytes[mode]``: while one microbatch's boundary replays,
  that microbatch's activations are back (one copy, not ``n_k``) plus the replay's transients;
* rows: the stage's *measured* peak without a plan (``base_peak_bytes``, from the control
  pipeline run) with every stage candidate held, and one more row per candidate with that
  candidate replaying. Without a plan every row is the measured peak.

So the predicted stage peak of a choice is ``base - n_k * sum(saved) + max(saved_j + extra_j
over the replayed j)``. Stages run on separate devices and a step is as slow as its slowest
stage, so planning each stage for its least added time under the one per-device budget also
minimises the slowest stage's added time.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Annotated, Any

from .._codec import Bytes, JsonCodec, Len, Reading, json_field, schema
from .._json import Enum, Int, List, Num, Str, json_kind, read_json_file
from ..errors import BudgetError, PlanError
from ..profile.model import CandidateCost, PeakRow, ProfileReport
from .model import Plan
from .schema import MODULE_PATH
from .spec import PlannerSpec

PIPELINE_PLAN_SCHEMA_VERSION = 1


class Schedule(str, enum.Enum):
    """A torch.distributed.pipelining single-stage-per-rank schedule."""

    GPIPE = "gpipe"      # ScheduleGPipe: all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: p - k warm-up forwards, then one forward / one backward
    INTERLEAVED_1F1B = "interleaved-1f1b"   # ScheduleInterleaved1F1B: v >= 2 stages per rank, looped

    @property
    def multi(self) -> bool:
        """Several stages per rank (torch's PipelineScheduleMulti)."""
        return self is Schedule.INTERLEAVED_1F1B


class Side(str, enum.Enum):
    """One side of a pipeline run: which plan every stage runs under."""

    NONE = "none"         # no plan
    UNIFORM = "uniform"   # the same rule on every stage (e.g. every block)
    REMAT = "remat"       # remat's per-stage plans (NOTE [pipeline in-flight cost model])

    def __str__(self) -> str:   # the name a report and a progress line print: "none", not "Side.NONE"
        return self.value


SIDES = tuple(s.value for s in Side)


def in_flight(schedule: Schedule | str, stage: int, stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at once (NOTE [pipeline in-flight cost model])."""
    if Schedule(schedule).multi:
        raise PlanError("an interleaved schedule's in-flight counts come from its action list "
                        "(in_flight_from_order), not from a formula")
    if Schedule(schedule) is Schedule.GPIPE:
        return microbatches
    return min(microbatches, stages - stage)


def in_flight_from_order(actions: list[tuple[int, str]]) -> dict[int, int]:
    """{stage: microbatches held} at the first moment a rank holds the most, from its schedule's actions in
    order, ``(stage, "F")`` a forward and ``(stage, "B")`` a backward (NOTE [pipeline in-flight cost model])."""
    held: dict[int, int] = {}
    best: dict[int, int] = {}
    top = -1
    for stage, kind in actions:
        held.setdefault(stage, 0)
        if kind == "F":
            held[stage] += 1
            if sum(held.values()) > top:
                top, best = sum(held.values()), dict(held)
        elif kind == "B":
            held[stage] -= 1
    return {s: max(1, best.get(s, 0)) for s in held}


def ideal_bubble(stages: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The schedule's bubble fraction with equal stage times and free communication, ``p`` ranks:
    (p - 1) / (m + p - 1); interleaved with ``v`` stages per rank, (p - 1) / (v m + p - 1)."""
    return (stages - 1) / (stages_per_rank * microbatches + stages - 1)


def in_stage(name: str, prefixes: list[str]) -> bool:
    """Whether module ``name`` is one of ``prefixes`` or lies inside one."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def stage_report(report: ProfileReport, prefixes: list[str], *, in_flight_count: int | dict[str, int],
                 microbatches: int, base_peak_bytes: int) -> ProfileReport:
    """The profile of one stage (or of one rank's stages), scaled by its in-flight load (NOTE [pipeline in-flight
    cost model]). ``in_flight_count``: one count, or one per block prefix (a rank's interleaved stages)."""
    counts = in_flight_count if isinstance(in_flight_count, dict) else {p: in_flight_count for p in prefixes}
    if min(counts.values(), default=0) < 1 or microbatches < 1:
        raise PlanError(f"in-flight counts and microbatches must be >= 1, got {counts} and {microbatches}")

    def held(name: str) -> int:
        return next(n for p, n in counts.items() if name == p or name.startswith(p + "."))
    cands: list[CandidateCost] = []
    for c in report.candidates:
        if not in_stage(c.name, prefixes):
            continue
        n_held = held(c.name)
        cands.append(dataclasses.replace(
            c, parent=c.parent if c.parent is not None and in_stage(c.parent, prefixes) else None,
            saved_bytes={m: v * n_held for m, v in c.saved_bytes.items()},
            replay_ms={m: v * microbatches for m, v in c.replay_ms.items()},
            replay_extra_bytes={m: c.replay_extra_bytes.get(m, 0) + c.saved_bytes.get(m, 0)
                                for m in c.replay_extra_bytes}))
    names = tuple(c.name for c in cands)
    rows = [PeakRow(base_bytes=base_peak_bytes, live=names, replaying=(), label="measured stage peak")]
    rows += [PeakRow(base_bytes=base_peak_bytes, live=names, replaying=(n,), label=f"replay of {n}") for n in names]
    keep = set(names)
    return dataclasses.replace(
        report, candidates=cands, rows=rows, excluded={k: v for k, v in report.excluded.items() if in_stage(k, prefixes)},
        baseline_peak_bytes=base_peak_bytes, baseline_step_ms=report.baseline_step_ms * microbatches,
        refuted_hazards={k: v for k, v in report.refuted_hazards.items() if k in keep},
        mode_excluded={k: v for k, v in report.mode_excluded.items() if k in keep}, phase_peak_bytes={})


@dataclasses.dataclass(kw_only=True)
class StagePlan(JsonCodec):
    stage: Annotated[int, Int(0, 100_000)]
    blocks: Annotated[list[str], List(MODULE_PATH, max_len=100_000)]   # the stage's blocks, e.g. ["h.0", "h.1"]
    in_flight: Annotated[int, Int(1, 100_000)]   # microbatches held at once (NOTE [pipeline in-flight cost model])
    base_peak_bytes: Bytes                       # measured peak of the stage without a plan (bytes)
    plan: Plan


@dataclasses.dataclass(kw_only=True)
class PipelinePlan(JsonCodec, reading=Reading(error=PlanError, what="pipeline plan")):
    """One plan per pipeline stage under one per-device budget (``plan.json`` with ``"kind": "pipeline"``);
    ``from_json`` checks against :data:`PIPELINE_PLAN` first (NOTE [checked reading] in remat/_codec.py)."""

    schema_version: Annotated[int, Enum(PIPELINE_PLAN_SCHEMA_VERSION)] = json_field(
        default=PIPELINE_PLAN_SCHEMA_VERSION, required=True)
    kind: Annotated[str, Enum("pipeline")] = json_field(default="pipeline", required=True)   # is_pipeline_plan_json
    schedule: Schedule
    microbatches: Annotated[int, Int(1, 100_000)]
    budget_bytes: Annotated[int, Int(1, 2 ** 53)]
    reserve: Annotated[float, Num(0, 0.999999)]
    stages: Annotated[list[StagePlan], Len(100_000, min_len=1)]
    split_points: Annotated[list[str], List(MODULE_PATH, max_len=100_000)]   # first block of every stage after the first
    split_source: Annotated[str, Str(max_len=2_000)]   # "given" or how the default split was measured

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.schedule)
        if [s.stage for s in self.stages] != list(range(len(self.stages))):
            raise PlanError(f"pipeline plan stages must be numbered 0..{len(self.stages) - 1} in order")

    def for_stage(self, stage: int) -> Plan:
        if not 0 <= stage < len(self.stages):
            raise PlanError(f"the pipeline plan has {len(self.stages)} stages; there is no stage {stage}")
        return self.stages[stage].plan

    def save(self, path: Path | str) -> Path:
        from .._io import atomic_write_json
        return atomic_write_json(path, self.to_json())


PIPELINE_PLAN = schema(PipelinePlan)


def is_pipeline_plan_json(d: Any) -> bool:
    return json_kind(d) == "pipeline"


def load_any_plan(path: Path | str) -> Plan | PipelinePlan:
    """``plan.json``: a whole-model :class:`Plan` or a :class:`PipelinePlan` (``"kind": "pipeline"``)."""
    from .model import MAX_PLAN_BYTES
    data = read_json_file(path, error=PlanError, what="plan file", max_bytes=MAX_PLAN_BYTES,
                          tip="remat plan ... --out DIR writes DIR/plan.json")
    if is_pipeline_plan_json(data):
        return PipelinePlan.from_json(data, source=f"pipeline plan {path}")
    return Plan.from_json(data, source=f"plan {path}")


def plan_stages(report: ProfileReport, stage_blocks: list[list[str]], *, schedule: Schedule | str, microbatches: int,
                base_peaks: list[int], planner: str | PlannerSpec, budget_bytes: int | None, reserve: float = 0.05,
                allow_hazards: bool = False, in_flights: list[dict[str, int]] | None = None) -> list[Plan]:
    """One plan per stage, each from ``make_plan`` on the stage's scaled profile; BudgetError names the stage."""
    from .budget import effective_budget
    from .planners import make_plan
    p = len(stage_blocks)
    if len(base_peaks) != p:
        raise PlanError(f"{len(base_peaks)} measured stage peaks for {p} stages")
    plans = []
    for k, blocks in enumerate(stage_blocks):
        load = in_flights[k] if in_flights is not None else in_flight(schedule, k, p, microbatches)
        sub = stage_report(report, blocks, in_flight_count=load,
                           microbatches=microbatches, base_peak_bytes=base_peaks[k])
        # a stage that already fits gets no boundary: under load a profile's replay estimate can come out 0 ms,
        # and a budget planner then adds "free" boundaries that cost real replay time
        fits = budget_bytes is not None and base_peaks[k] <= effective_budget(budget_bytes, reserve, 0)
        try:
            plans.append(make_plan(sub, "none" if fits and PlannerSpec.parse(planner).needs_budget else planner,
                                   budget_bytes=budget_bytes, reserve=reserve, allow_hazards=allow_hazards))
        except BudgetError as exc:
            exc.message = f"pipeline stage {k} ({blocks[0]}..{blocks[-1]}): {exc.message}"
            exc.args = (exc.message if exc.tip is None else f"{exc.message}\nTip: {exc.tip}",)
            raise
    return plans
