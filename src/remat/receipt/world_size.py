"""The receipt's evidence at a world size: the shipped plan under DDP or FSDP2 on N ranks, or a pipeline run.

NOTE [receipt at a world size]
``remat receipt --world-size N --engine ddp|fsdp2`` runs the shipped plan against the unplanned
step on N ranks (remat.distributed: the control and the plan on every rank, first-step
gradients compared, per-rank peaks, global samples/s) and keeps the whole
:class:`~remat.distributed.DistributedReport` in the receipt as ``world_size``. Every rank's
planned peak is held to the receipt's per-device budget less its reserve, the bar the
single-process peak clears (``decision.effective_budget_bytes``): each rank holds a whole
training step. The receipt then lists world sizes *other than* N (and the other engine) as not
covered, in place of "world size > 1". ``remat check`` reads the recorded per-rank peaks against
the gate's budget (NOTE [gate thresholds] in workflow/gate.py: the repository's, never the
report's own ``budget_bytes``) and, unless ``--quick``, re-runs the same launch at N ranks
with ``check_steps`` timed steps (workflow/world_size.py).

A pipeline run (``remat distributed --engine pipeline``) is the same section with
``engine: "pipeline"``: in place of ``report`` it holds ``pipeline`` (:class:`PipelineEvidence`: the same
DistributedReport, of engine pipeline, and the boundary revisions), and the receipt holds no single-process
section (NOTE [one receipt] in remat/receipt/model.py).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from .. import _json
from .._codec import JsonCodec, Len, json_field, schema
from .._json import MODULE_PATH
from ..distributed.config import Engine
from ..distributed.report import DistributedReport, PipelineFigures
from ..errors import ReceiptError
from ..plan.pipeline import PipelinePlan, Side
from .schema import HEX16, SHORT

MAX_CHECK_STEPS = 100
RUN_WARMUP = 2         # warm-up steps per side of a launch at the world size (remat receipt's and check's)
RUN_COMM_STEPS = 1     # overlap steps per side, after the timed ones

# DistributedReport keeps a hand codec (its JSON is computed); the receipt holds it to this spec of it
# (its top-level keys), and DistributedReport.from_json reads the rest.
DISTRIBUTED_REPORT = _json.Obj({"schema_version": _json.Enum(1), "world_size": _json.Int(1, 1 << 16),
                                "engine": _json.Enum("ddp", "fsdp2")},
                               {k: _json.JsonValue() for k in (
                                   "backend", "device", "dtype", "workload", "torch_version", "steps", "warmup",
                                   "comm_steps", "samples_per_step", "memory_source", "comm_source",
                                   "plan_boundaries", "per_rank", "global_samples_per_s", "step_ms_p50",
                                   "collectives", "exposed_comm_ms", "comm_ms", "ablation_step_ms", "equivalence",
                                   "budget_bytes", "over_budget_ranks", "passed", "notes")})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageBoundary(JsonCodec):
    """One boundary of remat's per-stage plans, with the revision hash ``remat check`` compares."""

    stage: Annotated[int, _json.Int(0, 1 << 20)]
    module: Annotated[str, MODULE_PATH]
    class_name: Annotated[str, SHORT]
    revision: Annotated[str, HEX16]   # remat.profile.module_revision: class sources + parameter shapes


@dataclasses.dataclass(kw_only=True)
class PipelineEvidence(JsonCodec):
    """A pipeline run at its world size: the whole report (per side and stage: peak, in-flight count,
    forward/backward/replay/p2p/idle ms, bubble fraction, the last timed step's timeline; the
    equivalence against the unplanned pipeline and the negative control; the per-stage plans) and
    each stage boundary's revision hash."""

    # the one per-rank report of engine pipeline (NOTE [one per-rank report]), checked against its whole schema
    report: Annotated[DistributedReport, schema(DistributedReport)]
    boundaries: Annotated[list[StageBoundary], Len(100_000)]

    @property
    def plan(self) -> PipelinePlan | None:
        """remat's per-stage plans (None when the run had no ``remat`` side)."""
        return self.report.remat_plan

    @property
    def figures(self) -> PipelineFigures:
        """The report's pipeline figures (``check_parts``: a pipeline run's report has them)."""
        assert self.report.pipeline is not None, "checked by check_parts"
        return self.report.pipeline

    @property
    def why_not(self) -> list[str]:
        """Why this run proves nothing to ship (empty when it does): the decision ``check`` re-checks, against
        the run's own per-device budget."""
        report, figures = self.report, self.figures
        out = []
        if report.remat_plan is None:
            out.append("the run has no per-stage plans (no remat side)")
        eq = figures.equivalence.get(Side.REMAT)
        if eq is None:
            out.append("the per-stage plans were not compared with the unplanned pipeline")
        elif not eq.ok:
            out.append(f"the per-stage plans' gradients differ from the unplanned pipeline's "
                       f"(max |diff| {eq.max_abs_diff:.3g})")
        if figures.negative_control_rejected is False:
            out.append("the negative control (a perturbed gradient) was accepted: the comparison proves nothing")
        if report.over_budget:
            out.append("a stage's measured peak is over the per-device budget: "
                       + ", ".join(f"stage {k}" for k in report.over_budget_stages))
        return out

    def check_parts(self) -> None:
        """The report is a pipeline run's, and the boundary records are its per-stage plans' (a hand-edited receipt
        could mix them)."""
        if self.report.engine is not Engine.PIPELINE or self.report.pipeline is None:
            raise ReceiptError("malformed receipt: $.world_size.pipeline.report is not a pipeline run's report")
        plan = self.plan
        planned = [] if plan is None else [(s.stage, b.module) for s in plan.stages for b in s.plan.boundaries]
        recorded = [(b.stage, b.module) for b in self.boundaries]
        if planned != recorded:
            raise ReceiptError(f"malformed receipt: the per-stage plans' boundaries {planned} differ from "
                               f"the boundary records {recorded}")


@dataclasses.dataclass(kw_only=True)
class WorldSizeEvidence(JsonCodec):
    """NOTE [receipt at a world size]. ``engine`` and ``world_size`` are the run's own (filled in from it when
    not given; a file naming others is refused), written first so a reader sees them first."""

    engine: Annotated[Engine, _json.Enum(*(e.value for e in Engine))] = json_field(default=None, required=True)
    world_size: Annotated[int, _json.Int(1, 1 << 16)] = json_field(default=None, required=True)
    # DDP or FSDP2: the control and the plan on every rank; left out of a pipeline run's
    report: Annotated[DistributedReport, DISTRIBUTED_REPORT] | None = json_field(default=None, omit=None)
    # a pipeline run; left out of a DDP or FSDP2 run's
    pipeline: PipelineEvidence | None = json_field(default=None, omit=None)
    # timed steps per side when `remat check` re-runs it
    check_steps: Annotated[int, _json.Int(1, MAX_CHECK_STEPS)] = json_field(default=2, required=True)
    # per-collective (pipeline: p2p) timeout of that re-run (s)
    check_timeout_s: Annotated[float, _json.Num(1, 86400.0)] = json_field(default=120.0, required=True)

    def __post_init__(self) -> None:
        if (self.report is None) == (self.pipeline is None):
            raise ReceiptError("malformed receipt: $.world_size holds "
                               + ("neither" if self.report is None else "both") + " a report and a pipeline run")
        run = (self.report.engine, self.report.world_size) if self.report is not None else \
            (Engine.PIPELINE, self.pipeline.report.world_size)   # type: ignore[union-attr]
        given = (run[0] if self.engine is None else Engine(self.engine),
                 run[1] if self.world_size is None else self.world_size)
        if given != run:
            raise ReceiptError("malformed receipt: $.world_size names another world size or engine than its report")
        self.engine, self.world_size = run
        if self.pipeline is not None:
            self.pipeline.check_parts()

    @property
    def rerun_steps(self) -> int:
        """Steps ``remat check`` runs to re-run a DDP/FSDP2 run, over every rank: per rank and side the warm-up,
        the timed steps, the gradient step and the overlap steps (remat/distributed/worker.py), control and plan."""
        return self.world_size * 2 * (RUN_WARMUP + self.check_steps + 1 + RUN_COMM_STEPS)

    @property
    def rerun_processes(self) -> int:
        """Processes that re-run starts: the launcher (``torch.distributed.run``) and one per rank."""
        return 1 + self.world_size

    def why_not(self, budget_bytes: int) -> list[str]:
        """What a recorded DDP/FSDP2 run shows against a per-device ``budget_bytes`` (empty when it holds)."""
        r, out = self.report, []
        assert r is not None, "a pipeline run's evidence is PipelineEvidence.why_not"
        if r.plan is None or r.equivalence is None:
            out.append(f"the run at world size {r.world_size} has no planned side")
        elif not r.equivalence.ok:
            out.append(f"at world size {r.world_size} ({r.engine.value}) the plan is not the control's training step "
                       f"(grads {'match' if r.equivalence.grads_match else 'differ'}, max |diff| "
                       f"{r.equivalence.max_abs_diff:.3g}; collective counts "
                       f"{'unchanged' if r.equivalence.collective_counts_equal else 'changed'})")
        for rank in [] if r.plan is None else r.plan.per_rank:
            if rank.peak_bytes > budget_bytes:
                out.append(f"at world size {r.world_size} rank {rank.rank}'s planned peak {rank.peak_bytes} bytes is "
                           f"over the per-device budget {budget_bytes} bytes")
        return out
