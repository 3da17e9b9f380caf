"""What a pipeline run measured (``pipeline.json``): per side, per stage, and the schedule's ideal bubble.

Sides: ``none`` (no plan), ``uniform`` (the same rule on every stage, e.g. every block),
``remat`` (per-stage plans, NOTE [pipeline in-flight cost model]). Times in ms, bytes in bytes.
NOTE [pipeline instruments] (pipeline_parallel/worker.py) says how each figure is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._json import BYTES, MS, Bool, Enum, Int, JsonValue, List, Map, Num, Obj, Opt, Str, Tuple, validate
from ..errors import DistributedError
from .plan import PIPELINE_PLAN, SCHEDULES, ideal_bubble
from ..plan.schema import MODULE_PATH
from ..measure import p50
from ..distributed.report import percentile

PIPELINE_REPORT_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TimelineEvent:
    kind: str        # forward, loss, backward, replay, optimizer, p2p:<what>
    mb: int          # microbatch, -1 when none
    start_ns: int
    end_ns: int


@dataclasses.dataclass(kw_only=True)
class StageResult:
    """One stage (rank), one side, as measured on its rank (gathered by rank 0)."""

    side: str
    stage: int
    rank: int
    host: str
    in_flight: int
    blocks: list[str]
    boundaries: list[str]
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


def _med(xs: list[float]) -> float:
    """remat.measure's p50 (the one definition), 0.0 for no values."""
    return float(p50(xs)) if xs else 0.0


STAGE = Obj({
    "stage": Int(0, 1 << 20), "rank": Int(0, 1 << 20), "host": Str(max_len=300), "in_flight": Int(1, 1 << 20),
    "blocks": List(MODULE_PATH, max_len=100_000), "boundaries": List(MODULE_PATH, max_len=100_000),
    "p50_ms": MS, "p95_ms": MS, "forward_ms": MS, "backward_ms": MS, "replay_ms": MS, "optimizer_ms": MS,
    "p2p_ms": MS, "exposed_p2p_ms": MS, "idle_ms": MS, "bubble_fraction": Num(0, 1),
    "peak_bytes": BYTES, "held_at_backward_bytes": List(BYTES, max_len=100_000), "fits_budget": Opt(Bool()),
    "bubble_delta_vs_none": Opt(Num(-1, 1)), "predicted_peak_bytes": Opt(Int(-(2 ** 53), 2 ** 53)),
    "grad_sq_sum": Opt(Num(0, 1e300)),
    "timeline": List(Tuple(Str(max_len=100), Int(-1, 1 << 20), Num(-1e9, 1e9), Num(-1e9, 1e9)), max_len=1_000_000),
})
SIDE = Obj({"per_stage": List(STAGE, max_len=100_000), "p50_ms": MS, "p95_ms": MS, "samples_per_s": Num(0, 1e15),
            "max_peak_bytes": BYTES, "max_bubble_fraction": Num(0, 1)})
EQUIVALENCE = Obj({"criterion": Enum("bitwise"), "bitwise_equal": Bool(), "max_abs_diff": Num(0, 1e300),
                   "params_compared": Int(0, 1 << 40), "mismatched": List(Str(max_len=2_000), max_len=100_000),
                   "first_loss_equal": Opt(Bool()), "ok": Bool()})
PIPELINE_REPORT = Obj({
    "schema_version": Enum(PIPELINE_REPORT_SCHEMA_VERSION), "spec": Str(max_len=4096),
    "shape": Map(JsonValue(), key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100),
    "world_size": Int(2, 1 << 16), "schedule": Enum(*SCHEDULES), "microbatches": Int(1, 100_000),
    "stages_per_rank": Int(1, 1000),
    "batch_size": Int(1, 1 << 40), "split_points": List(MODULE_PATH, max_len=100_000), "split_source": Str(max_len=2_000),
    "ideal_bubble_fraction": Num(0, 1), "backend": Str(max_len=50), "device": Str(max_len=50),
    "dtype": Str(max_len=50), "memory_source": Str(max_len=100), "torch_version": Str(max_len=100),
    "steps": Int(1, 1000), "warmup": Int(1, 100), "timeout_s": Num(0, 1e9), "budget_bytes": Opt(BYTES),
    "sides": Map(SIDE, key=r"none|uniform|remat", max_len=3),
    "equivalence": Map(EQUIVALENCE, key=r"uniform|remat", max_len=2),
    "negative_control_rejected": Opt(Bool()),
    "plans": Map(PIPELINE_PLAN, key=r"uniform|remat", max_len=2),
    "notes": List(Str(max_len=4_000), max_len=100),
})


@dataclasses.dataclass(kw_only=True)
class PipelineReport:
    """``pipeline.json``: the JSON is the data model (validated on read); accessors for the common figures."""

    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return self.data

    @classmethod
    def from_json(cls, d: Any) -> "PipelineReport":
        if not isinstance(d, dict):
            raise DistributedError("pipeline report JSON must be an object")
        validate(d, PIPELINE_REPORT, error=DistributedError, what="pipeline report")
        return cls(data=d)

    def side(self, name: str) -> dict[str, Any] | None:
        return self.data["sides"].get(name)

    @property
    def remat_fits(self) -> bool | None:
        """Whether every stage of remat's side measured within the per-device budget (None: no budget/side)."""
        side = self.side("remat")
        if side is None or self.data["budget_bytes"] is None:
            return None
        return all(s["fits_budget"] for s in side["per_stage"])

    @property
    def ok(self) -> bool:
        """Every planned side bitwise equal to the unplanned run, and the negative control rejected."""
        eq = self.data["equivalence"]
        return all(e["ok"] for e in eq.values()) and self.data["negative_control_rejected"] is not False


def _stage_json(r: StageResult, budget: int | None, pipeline_ms: list[float]) -> dict[str, Any]:
    """``pipeline_ms``: per timed step, the first stage's start to the last stage's end (NOTE [pipeline instruments])."""
    steps = [(b - a) / 1e6 for a, b in r.step_ns]
    idle = [max(0.0, g - c) for g, c in zip(pipeline_ms, r.compute_ms)]
    bubble = [i / g if g > 0 else 0.0 for i, g in zip(idle, pipeline_ms)]
    return {
        "stage": r.stage, "rank": r.rank, "host": r.host, "in_flight": r.in_flight, "blocks": r.blocks,
        "boundaries": r.boundaries, "p50_ms": percentile(steps, 50), "p95_ms": percentile(steps, 95),
        "forward_ms": _med(r.forward_ms), "backward_ms": _med(r.backward_ms), "replay_ms": _med(r.replay_ms),
        "optimizer_ms": _med(r.optimizer_ms), "p2p_ms": _med(r.p2p_ms), "exposed_p2p_ms": _med(r.exposed_p2p_ms),
        "idle_ms": _med(idle), "bubble_fraction": min(1.0, max(0.0, _med(bubble))),
        "peak_bytes": r.peak_bytes, "held_at_backward_bytes": r.held_at_backward_bytes,
        "fits_budget": None if budget is None else r.peak_bytes <= budget,
        "bubble_delta_vs_none": None, "predicted_peak_bytes": None, "grad_sq_sum": r.grad_sq_sum,
        "timeline": [],
    }


def assemble_pipeline(cfg: Any, gathered: list[dict[str, Any]], *, torch_version: str, memory_source: str) -> PipelineReport:
    p = cfg.world_size
    batch_size = int(cfg.shape.get("batch_size", 1))
    rank0 = gathered[0]
    plans = {k: rank0[k] for k in ("uniform", "remat") if rank0.get(k) is not None}
    budget = plans["remat"]["budget_bytes"] if "remat" in plans else None
    sides: dict[str, Any] = {}
    for name in cfg.sides:
        stages = [g["results"][name] for g in gathered]
        # a step of the pipeline: from the first stage's start to the last stage's end (one clock per host)
        n = min(len(r.step_ns) for r in stages)
        global_ms = [(max(r.step_ns[i][1] for r in stages) - min(r.step_ns[i][0] for r in stages)) / 1e6
                     for i in range(n)]
        per_stage = [_stage_json(r, budget, global_ms) for r in stages]
        t0 = min(r.timeline_t0_ns for r in stages)
        for js, r in zip(per_stage, stages):
            shift = r.timeline_t0_ns - t0
            js["timeline"] = [[e.kind, e.mb, (e.start_ns + shift) / 1e6, (e.end_ns + shift) / 1e6] for e in r.timeline]
        p50 = percentile(global_ms, 50)
        sides[name] = {"per_stage": per_stage, "p50_ms": p50, "p95_ms": percentile(global_ms, 95),
                       "samples_per_s": batch_size / (p50 / 1000.0) if p50 > 0 else 0.0,
                       "max_peak_bytes": max(s["peak_bytes"] for s in per_stage),
                       "max_bubble_fraction": max(s["bubble_fraction"] for s in per_stage)}
    # where replay stretched the bubbles: each planned stage's bubble fraction less the unplanned one's
    for name, side in sides.items():
        if name != "none" and "none" in sides:
            for js, base in zip(side["per_stage"], sides["none"]["per_stage"]):
                js["bubble_delta_vs_none"] = max(-1.0, min(1.0, js["bubble_fraction"] - base["bubble_fraction"]))
        if name in plans:
            for js, st in zip(side["per_stage"], plans[name]["stages"]):
                js["predicted_peak_bytes"] = st["plan"]["predicted_peak_bytes"]
    equivalence: dict[str, Any] = {}
    for name in cfg.sides:
        if name == "none":
            continue
        comps = [g["comparisons"].get(name) for g in gathered]
        if any(c is None for c in comps):
            continue
        l0 = [g["losses"].get("none") for g in gathered][p - 1], [g["losses"].get(name) for g in gathered][p - 1]
        missing = [f"stage {k}: {n}: no gradient" for k, g in enumerate(gathered)
                   for side in ("none", name) for n in g.get("missing_grads", {}).get(side, [])]
        bitwise = all(c.bitwise_equal and not c.mismatched for c in comps) and not missing
        first_loss_equal = None if l0[0] is None else l0[0] == l0[1]
        equivalence[name] = {"criterion": "bitwise", "bitwise_equal": bitwise,
                             "max_abs_diff": max(c.max_abs_diff for c in comps),
                             "params_compared": sum(c.params_compared for c in comps),
                             "mismatched": [f"stage {k}: {m}" for k, c in enumerate(comps) for m in c.mismatched]
                             + missing,
                             "first_loss_equal": first_loss_equal,
                             "ok": bitwise and first_loss_equal is not False}
    negs = [g["negative_rejected"] for g in gathered]
    notes = [
        "bubble_fraction = idle / step per stage, idle = the pipeline's step (first stage's start to last stage's "
        "end, one host clock) - union(forward, loss, backward, optimizer) of the stage; "
        "ideal_bubble_fraction = (p - 1) / (v m + p - 1) (v stages per rank, 1 but for interleaved schedules) for "
        "equal stage times and free communication; with v > 1 a 'stage' row is a rank and its v stages",
        "p2p_ms is the time the stage's thread is blocked posting or waiting on isend/irecv (it includes waiting "
        "for a peer still computing); exposed_p2p_ms = union(p2p) - union(compute)",
        "replay_ms is inside backward_ms; peak_bytes and held_at_backward_bytes come from one extra step under the "
        f"live-tensor tracker ({memory_source})",
        "step p50/p95: per step, the first stage's start to the last stage's end; samples/s = batch_size / p50",
    ]
    notes += [n for n in rank0.get("notes", [])]
    data = {
        "schema_version": PIPELINE_REPORT_SCHEMA_VERSION, "spec": cfg.spec, "shape": dict(cfg.shape),
        "world_size": p, "schedule": cfg.schedule.value, "microbatches": cfg.microbatches, "batch_size": batch_size,
        "split_points": list(cfg.split_points), "split_source": cfg.split_source,
        "stages_per_rank": cfg.stages_per_rank,
        "ideal_bubble_fraction": ideal_bubble(p, cfg.microbatches, cfg.stages_per_rank), "backend": cfg.backend, "device": cfg.device,
        "dtype": cfg.dtype, "memory_source": memory_source, "torch_version": torch_version, "steps": cfg.steps,
        "warmup": cfg.warmup, "timeout_s": cfg.timeout_s, "budget_bytes": budget, "sides": sides,
        "equivalence": equivalence,
        "negative_control_rejected": None if any(x is None for x in negs) else all(negs),
        "plans": plans, "notes": notes,
    }
    return PipelineReport.from_json(data)
