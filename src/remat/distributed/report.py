"""Results of a distributed run: what each rank measured, and the report (``distributed.json``).

Each rank produces a :class:`RankResult`; rank 0 gathers them and assembles the
:class:`DistributedReport`, whose ``to_json()`` lays the control and the plan side by side
under every top-level figure (``per_rank``, ``collectives``, ``exposed_comm_ms``...).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .._codec import FloatAsWritten, JsonCodec, json_field
from ..errors import DistributedError
from ..types import MemorySource
from ..percentile import percentile
from .config import DistributedConfig, Engine

REPORT_SCHEMA_VERSION = 1
SIDES = ("control", "plan")


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# -- what one rank measured -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveCount(JsonCodec):
    """Collectives of one op in one training step: how many calls, how many payload bytes."""

    count: int
    bytes: int


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

@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFigures(JsonCodec):
    """One rank's figures for one side, as ``per_rank`` lists them. The optional figures read as None
    (``step_ms`` as no steps) when the key is missing, as they always did."""

    rank: int
    peak_bytes: int
    p50_ms: float
    p95_ms: float
    exposed_comm_ms: FloatAsWritten | None = json_field(absent=None)   # p50 over the comm steps
    comm_ms: FloatAsWritten | None = json_field(absent=None)           # p50 over the comm steps
    ablation_step_ms: FloatAsWritten | None = json_field(absent=None)  # p50
    step_ms: list[float] = json_field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class SideReport:
    """All ranks, one side. Global figures follow the slowest rank (it sets the step time)."""

    per_rank: list[RankFigures]
    global_samples_per_s: float          # sum of samples per step over ranks / slowest rank's p50
    step_ms_p50: float                   # slowest rank's p50
    collectives: dict[str, CollectiveCount]
    exposed_comm_ms: float | None        # slowest (largest) per-rank p50
    comm_ms: float | None
    ablation_step_ms: float | None       # slowest per-rank p50 with the no-op comm hook


@dataclasses.dataclass(kw_only=True)
class Equivalence(JsonCodec):
    """Is the planned distributed step the same training step as the control? Its JSON adds ``ok``
    (computed, never read back)."""

    criterion: str                      # "bitwise" or "allclose(rtol=..., atol=...)"
    grads_match: bool                   # on every rank, per the criterion
    bitwise_equal: bool
    max_abs_diff: FloatAsWritten
    worst: dict[str, Any] | None        # {"rank": r, "param": name}
    params_compared: int                # per rank
    mismatched: list[str]
    loss_equal: bool                    # first-step loss, every rank
    collective_counts_equal: bool       # per step, by op, on every rank
    collective_counts: dict[str, dict[str, int]] = json_field(then=("ok",))  # side -> op -> count (rank 0)

    @property
    def ok(self) -> bool:
        return self.grads_match and self.collective_counts_equal and self.loss_equal


@dataclasses.dataclass(kw_only=True)
class DistributedReport:
    world_size: int
    engine: Engine
    backend: str
    device: str
    dtype: str
    spec: str
    shape: dict[str, Any]
    steps: int
    warmup: int
    comm_steps: int
    samples_per_step: list[int]          # per rank
    memory_source: MemorySource
    comm_source: str
    torch_version: str
    plan_boundaries: list[str]
    control: SideReport
    plan: SideReport | None
    equivalence: Equivalence | None
    notes: list[str] = dataclasses.field(default_factory=list)
    budget_bytes: int | None = None      # per-device budget the planned peaks are held to (None: none given)
    schema_version: int = REPORT_SCHEMA_VERSION

    def side(self, name: str) -> SideReport | None:
        return self.control if name == "control" else self.plan

    @property
    def over_budget(self) -> list[RankFigures]:
        """The ranks whose planned peak is above the per-device budget (none without a plan or a budget)."""
        if self.plan is None or self.budget_bytes is None:
            return []
        return [r for r in self.plan.per_rank if r.peak_bytes > self.budget_bytes]

    @property
    def passed(self) -> bool:
        """The plan is the control's training step (when there is a plan) and fits the budget on every rank."""
        return (self.equivalence is None or self.equivalence.ok) and not self.over_budget

    # A hand codec: the JSON is computed, each figure of the two sides laid side by side under one key
    # (``per_rank``: {"control": [...], "plan": [...]}) and the verdict added (``passed``, ``over_budget_ranks``).
    def to_json(self) -> dict[str, Any]:
        def by_side(get: Any) -> dict[str, Any]:
            return {name: (None if (s := self.side(name)) is None else get(s)) for name in SIDES}

        return {
            "schema_version": self.schema_version,
            "world_size": self.world_size,
            "engine": self.engine.value,
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "workload": {"spec": self.spec, "shape": self.shape},
            "torch_version": self.torch_version,   # the key every other context uses
            "steps": self.steps,
            "warmup": self.warmup,
            "comm_steps": self.comm_steps,
            "samples_per_step": self.samples_per_step,
            "memory_source": self.memory_source.value,
            "comm_source": self.comm_source,
            "plan_boundaries": self.plan_boundaries,
            "per_rank": by_side(lambda s: [r.to_json() for r in s.per_rank]),
            "global_samples_per_s": by_side(lambda s: s.global_samples_per_s),
            "step_ms_p50": by_side(lambda s: s.step_ms_p50),
            "collectives": by_side(lambda s: {op: c.to_json() for op, c in s.collectives.items()}),
            "exposed_comm_ms": by_side(lambda s: s.exposed_comm_ms),
            "comm_ms": by_side(lambda s: s.comm_ms),
            "ablation_step_ms": by_side(lambda s: s.ablation_step_ms),
            "equivalence": None if self.equivalence is None else self.equivalence.to_json(),
            "budget_bytes": self.budget_bytes,
            "over_budget_ranks": [r.rank for r in self.over_budget],
            "passed": self.passed,
            "notes": self.notes,
        }

    @classmethod
    def from_json(cls, d: Any) -> "DistributedReport":
        if not isinstance(d, dict) or d.get("schema_version") != REPORT_SCHEMA_VERSION:
            raise DistributedError("not a distributed.json of schema version "
                                   f"{REPORT_SCHEMA_VERSION}: {str(d)[:80]!r}")
        try:
            sides: dict[str, SideReport | None] = {}
            for name in SIDES:
                if d["per_rank"].get(name) is None:
                    sides[name] = None
                    continue
                sides[name] = SideReport(
                    per_rank=[RankFigures.from_json(r) for r in d["per_rank"][name]],
                    global_samples_per_s=float(d["global_samples_per_s"][name]),
                    step_ms_p50=float(d["step_ms_p50"][name]),
                    collectives={op: CollectiveCount.from_json(c) for op, c in d["collectives"][name].items()},
                    exposed_comm_ms=d["exposed_comm_ms"][name],
                    comm_ms=d["comm_ms"][name],
                    ablation_step_ms=d["ablation_step_ms"][name],
                )
            control = sides["control"]
            assert control is not None
            return cls(world_size=int(d["world_size"]), engine=Engine(d["engine"]), backend=str(d["backend"]),
                       device=str(d["device"]), dtype=str(d["dtype"]), spec=str(d["workload"]["spec"]),
                       shape=dict(d["workload"]["shape"]), steps=int(d["steps"]), warmup=int(d["warmup"]),
                       comm_steps=int(d["comm_steps"]), samples_per_step=[int(x) for x in d["samples_per_step"]],
                       memory_source=MemorySource(d["memory_source"]), comm_source=str(d["comm_source"]),
                       torch_version=str(d["torch_version"]), plan_boundaries=list(d["plan_boundaries"]),
                       control=control, plan=sides["plan"],
                       equivalence=None if d["equivalence"] is None else Equivalence.from_json(d["equivalence"]),
                       notes=list(d.get("notes", [])), schema_version=int(d["schema_version"]),
                       budget_bytes=None if d.get("budget_bytes") is None else int(d["budget_bytes"]))
        except (KeyError, TypeError, ValueError, AssertionError) as exc:
            raise DistributedError(f"malformed distributed.json: {type(exc).__name__}: {exc}") from exc


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

    def worst(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present and len(present) == len(values) else None

    return SideReport(per_rank=per_rank, global_samples_per_s=samples / (slowest / 1e3), step_ms_p50=slowest,
                      collectives=ranks[0][2].collectives,
                      exposed_comm_ms=worst([f.exposed_comm_ms for f in per_rank]),
                      comm_ms=worst([f.comm_ms for f in per_rank]),
                      ablation_step_ms=worst([f.ablation_step_ms for f in per_rank]))


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
    return DistributedReport(
        world_size=cfg.world_size, engine=cfg.engine, backend=cfg.backend, device=cfg.device, dtype=cfg.dtype,
        spec=cfg.spec, shape=cfg.shape, steps=cfg.steps, warmup=cfg.warmup, comm_steps=cfg.comm_steps,
        samples_per_step=[r.samples_per_step for r in results], memory_source=results[0].memory_source,
        comm_source=comm_source, torch_version=torch_version,
        plan_boundaries=[] if cfg.plan is None else [b.module for b in cfg.plan.boundaries],
        control=control, plan=plan, equivalence=_equivalence(results, criterion) if has_plan else None,
        notes=notes, budget_bytes=cfg.device_budget_bytes)
