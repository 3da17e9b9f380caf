"""A pipeline run, its receipt and the receipt's re-check (NOTE [one receipt] in remat/receipt/model.py).

``run_pipeline_job`` is ``remat distributed|verify|frontier --engine pipeline``: profile the whole
model at the microbatch shape, split it (given, from the plan, or NOTE [default split]), launch the
unplanned, uniform and remat's per-stage pipelines at the world size, and write ``OUT/pipeline.json``,
``OUT/plan.json``, ``OUT/profile.json``, ``OUT/pipeline.md`` and the receipt (``OUT/receipt.json``,
``report.html``, ``report.md``), which ``remat check OUT/receipt.json`` re-checks.

``check_pipeline_receipt`` checks, in order (``quick`` stops after 4):
1. the reports beside it name its sha256; the workload is the user's (NOTE [workload spec policy]
   in remat/workflow/check.py) and the receipt's;
2. the shape: every keyword of the factory, defaults included;
3. the model: every stage plan's whole-model fingerprint, and each boundary's revision hash;
4. the receipt itself holds (per-stage plans present, bitwise equal, negative control rejected,
   every stage within the per-device budget): a receipt that recorded a failure fails;
5. a world-size-p launch of the unplanned and the planned pipeline with the receipt's schedule,
   microbatches, split and per-stage plans (``check_steps`` timed steps each): gradients
   bitwise equal, the negative control rejected, every stage's peak within the budget.
If the model changed (3), 5 is skipped: the plans are bound to the model they were made for.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .._io import atomic_write_json, atomic_write_text
from ..distributed.config import DistributedConfig, Engine, PipelineSettings, check_stages_per_rank
from ..distributed.pipeline.engine import check_split, default_split, microbatch_shape, run_pipeline_config
from ..errors import PlanError
from ..plan import parse_budget
from ..plan.pipeline import PipelinePlan, Side
from ..distributed.report import DistributedReport
from ..profile import fingerprint, module_revision
from ..receipt.model import Receipt, ReceiptContext
from ..receipt.render import render_pipeline_markdown
from ..receipt.world_size import PipelineEvidence, StageBoundary, WorldSizeEvidence
from ..receipt.write import ReceiptFiles, write_receipt
from ..types import ProgressFn, no_progress
from ..units import mib
from ..workload import load_workload
from ..workload.loader import LoadedWorkload
from .check import (CheckLedger, CheckReport, ReportStamps, _shape_findings, _within_world_size,
                    _workload_is_the_receipts, choose_workload)
from .findings import CheckFinding, FindingKind
from .gate import GateSettings, project_gate


@dataclasses.dataclass(kw_only=True)
class PipelineJob:
    """One ``--engine pipeline`` run, as the CLI's flags give it."""

    spec: str
    shape: dict[str, Any]
    world_size: int
    schedule: str                      # gpipe, 1f1b, interleaved-1f1b
    microbatches: int
    out: Path
    stages_per_rank: int | None = None   # None: 2 for interleaved-1f1b, else 1
    split_points: list[str] = dataclasses.field(default_factory=list)   # empty: the plan's, else NOTE [default split]
    plan: PipelinePlan | None = None   # given per-stage plans (None: plan them at ``budget``)
    budget: str | None = None          # the per-stage plans' budget as given (bytes, or a share of the stage peak)
    reserve: float = 0.05              # share of the budget kept free
    device: str = "cpu"
    dtype: str = "float32"
    steps: int = 10                    # timed steps per side
    warmup: int = 2
    timeout_s: float = 120.0           # p2p/collective timeout (s)
    wall_timeout_s: float = 3600.0     # the whole launch (s)
    command: str = ""                  # the command line, for the receipt
    verify_only: bool = False          # the unplanned and the given plans only, one warm-up and one timed step


@dataclasses.dataclass(kw_only=True)
class PipelineOutcome:
    report: DistributedReport          # engine pipeline (NOTE [one per-rank report])
    report_path: Path                  # OUT/pipeline.json
    receipt: Receipt | None            # None when the run had no per-stage plans
    files: ReceiptFiles | None


def check_given_plan(plan: PipelinePlan, *, schedule: str, microbatches: int, world_size: int, source: str) -> None:
    """A given per-stage plan must be made for this schedule, microbatch count and world size (else PlanError)."""
    if (plan.schedule.value, plan.microbatches, len(plan.stages)) != (schedule, microbatches, world_size):
        raise PlanError(f"{source} was planned for {plan.schedule.value} with {plan.microbatches} microbatches "
                        f"on {len(plan.stages)} stages; this run asks for {schedule}, {microbatches}, "
                        f"{world_size}: the stages' in-flight counts, and so the plans, would differ",
                        tip="pass the plan's --schedule, --microbatches and --world-size, or plan again")


def _split(job: PipelineJob, n_stages: int) -> tuple[list[str], str]:
    """(split points, where they come from): given, the plan's, or NOTE [default split]."""
    if job.split_points:
        points, source = list(job.split_points), "given (--split-points)"
    elif job.plan is not None:
        points, source = list(job.plan.split_points), f"from the plan ({job.plan.split_source})"
    else:
        points, source = [], ""
    check_split(job.spec, job.shape, points, n_stages, job.microbatches, dtype=job.dtype)
    if not points:
        points, source = default_split(job.spec, job.shape, n_stages, job.microbatches, dtype=job.dtype)
    return points, source


def _profile(job: PipelineJob, progress: ProgressFn) -> dict:
    """The whole model profiled at the microbatch shape (what the per-stage plans are planned from): its JSON,
    also written to OUT/profile.json."""
    from ..profile.step import profile_workload
    mb_shape = microbatch_shape(job.shape, job.microbatches)
    report = profile_workload(load_workload(job.spec, mb_shape, dtype=job.dtype), progress=progress)
    atomic_write_json(Path(job.out) / "profile.json", report.to_json())
    return report.to_json()


def run_pipeline_job(job: PipelineJob, *, progress: ProgressFn = no_progress) -> PipelineOutcome:
    """Plan (unless ``job.plan``), launch, write OUT/pipeline.json, plan.json, pipeline.md and the receipt."""
    v = job.stages_per_rank or (2 if job.schedule == "interleaved-1f1b" else 1)
    check_stages_per_rank(job.schedule, v, job.world_size, job.microbatches)
    if job.budget is not None:
        parse_budget(job.budget, 1 << 50)   # syntax-checked before any measuring
    if job.verify_only and job.plan is None:
        raise PlanError("remat verify --engine pipeline needs --plan: a per-stage plan (the plan.json that "
                        "`remat distributed --engine pipeline` writes)")
    microbatch_shape(job.shape, job.microbatches)   # the batch divides, before any measuring
    points, source = _split(job, v * job.world_size)
    given = job.plan
    settings = PipelineSettings(
        schedule=job.schedule, microbatches=job.microbatches, split_points=points, split_source=source,
        stages_per_rank=v, profile=None if given is not None else _profile(job, progress),
        budget=job.budget, reserve=job.reserve, sides=["none", "uniform", "remat"] if given is None else ["none", "remat"])
    config = DistributedConfig(
        spec=job.spec, shape=job.shape, world_size=job.world_size, engine=Engine.PIPELINE, plan=given,
        device=job.device, dtype=job.dtype, steps=1 if job.verify_only else job.steps,
        warmup=1 if job.verify_only else job.warmup, timeout_s=job.timeout_s, pipeline=settings)
    result = run_pipeline_config(config, work_dir=Path(job.out) / "distributed", wall_timeout_s=job.wall_timeout_s,
                                 progress=progress)
    out = Path(job.out)
    path = atomic_write_json(out / "pipeline.json", result.to_json())
    if result.remat_plan is not None:
        result.remat_plan.save(out / "plan.json")
    atomic_write_text(out / "pipeline.md", render_pipeline_markdown(result))
    receipt = files = None
    if result.remat_plan is not None:
        receipt = make_pipeline_receipt(result, loaded=load_workload(job.spec, job.shape, dtype=job.dtype),
                                        command=job.command, check_timeout_s=max(job.timeout_s, 1.0))
        files = write_receipt(receipt, out)
    return PipelineOutcome(report=result, report_path=path, receipt=receipt, files=files)


def make_pipeline_receipt(report: DistributedReport, *, loaded: LoadedWorkload, command: str = "",
                          check_steps: int = 1, check_timeout_s: float = 60.0) -> Receipt:
    """The receipt of one pipeline run (NOTE [one receipt]); ``loaded`` is the workload at the run's
    (whole-batch) shape."""
    model = loaded.workload.model
    plan = report.remat_plan
    boundaries = [StageBoundary(stage=st.stage, module=b.module, class_name=type(m).__name__, revision=module_revision(m))
                  for st in ([] if plan is None else plan.stages) for b in st.plan.boundaries
                  for m in [model.get_submodule(b.module)]]
    context = ReceiptContext.capture(loaded, boundary_shape=None, memory_source=report.memory_source, command=command)
    run = WorldSizeEvidence(pipeline=PipelineEvidence(report=report, boundaries=boundaries), check_steps=check_steps,
                            check_timeout_s=check_timeout_s)
    return Receipt(context=context, world_size=run)


def _model_findings(pe: PipelineEvidence, model: Any) -> list[CheckFinding]:
    """3. every stage plan's whole-model fingerprint, and each boundary's revision hash."""
    plan = pe.plan
    out: list[CheckFinding] = []
    now_fp = None if plan is None else fingerprint(model)
    for st in [] if plan is None else plan.stages:
        diffs = st.plan.fingerprint.differences(now_fp)
        if diffs:
            shown = "; ".join(str(x) for x in diffs[:4]) + (f"; ... {len(diffs) - 4} more" if len(diffs) > 4 else "")
            out.append(CheckFinding(kind=FindingKind.MODEL, message=f"stage {st.stage}'s plan: the model changed: {shown}"))
    named = dict(model.named_modules())
    for b in pe.boundaries:
        m = named.get(b.module)
        if m is None:
            out.append(CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                                    message=f"stage {b.stage} boundary {b.module} ({b.class_name}): the module is gone"))
        elif module_revision(m) != b.revision:
            out.append(CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                                    message=f"stage {b.stage} boundary {b.module} ({b.class_name}): "
                                            f"revision {b.revision} -> {module_revision(m)}"))
    return out


def _rerun_config(receipt: Receipt, spec: str, plan: PipelinePlan) -> DistributedConfig:
    """5. the unplanned and the planned pipeline, the receipt's schedule, microbatches, split and plans."""
    ctx, ws = receipt.context, receipt.world_size
    assert ws is not None and ws.pipeline is not None
    p = ws.pipeline.figures
    settings = PipelineSettings(schedule=p.schedule, microbatches=p.microbatches, split_points=list(p.split_points),
                                split_source=p.split_source, stages_per_rank=p.stages_per_rank,
                                sides=[Side.NONE, Side.REMAT])
    return DistributedConfig(spec=spec, shape=dict(ctx.shape), world_size=ws.world_size, engine=Engine.PIPELINE,
                             plan=plan, device=ctx.device, dtype=ctx.dtype, steps=ws.check_steps, warmup=1,
                             timeout_s=ws.check_timeout_s, pipeline=settings)


def _rerun_findings(was: DistributedReport, again: DistributedReport, ledger: CheckLedger) -> None:
    """5. the re-run's equivalence, negative control and per-stage peaks, against the receipt's budget."""
    f = again.pipeline
    assert f is not None and was.plan is not None and again.plan is not None, "pipeline runs with a remat side"
    eq = f.equivalence.get(Side.REMAT)
    if eq is not None and eq.ok:
        ledger.checked.append(f"re-run at world size {again.world_size} ({f.schedule.value}, {f.microbatches} "
                              f"microbatches): gradients bitwise equal to the unplanned pipeline over "
                              f"{eq.params_compared} parameters")
    else:
        ledger.failures.append(CheckFinding(kind=FindingKind.EQUIVALENCE, message=(
            "re-run: the planned pipeline's gradients differ from the unplanned one's"
            + ("" if eq is None else f" (max |diff| {eq.max_abs_diff:.3g}; " + "; ".join(eq.mismatched[:3]) + ")"))))
    if f.negative_control_rejected is False:
        ledger.failures.append(CheckFinding(kind=FindingKind.EQUIVALENCE,
                                            message="re-run: the negative control (a perturbed gradient) was accepted"))
    budget = was.budget_bytes
    for s, before in zip(again.plan.per_rank, was.plan.per_rank):
        stage = s.rank if s.stage is None else s.stage.stage
        if budget is not None and s.peak_bytes > budget:
            ledger.failures.append(CheckFinding(kind=FindingKind.PEAK, message=(
                f"stage {stage}: peak {mib(s.peak_bytes)} with its plan is over the per-device budget "
                f"{mib(budget)} (the receipt measured {mib(before.peak_bytes)})")))
        else:
            ledger.checked.append(f"stage {stage}: peak {mib(s.peak_bytes)} within {mib(budget)} "
                                  f"(receipt: {mib(before.peak_bytes)})")


def check_pipeline_receipt(receipt: Receipt, *, quick: bool = False, workload: str | None = None,
                           reports: ReportStamps | None = None, cwd: Path | None = None,
                           work_dir: Path | None = None, wall_timeout_s: float = 600.0,
                           gate: GateSettings | None = None, progress: ProgressFn = no_progress) -> CheckReport:
    """The module docstring's checks; failures are data (``passed``), for the CLI's exit code 1. Given ``gate``, a
    receipt made at more ranks than its ``max-world-size`` (over ``[tool.remat]``'s in ``cwd``) fails before
    anything runs, as every receipt's does (NOTE [gate thresholds] in remat/workflow/gate.py)."""
    ctx, pe = receipt.context, receipt.pipeline
    assert pe is not None, "a pipeline run's receipt"
    was = pe.report
    chosen = choose_workload(ctx.workload, workload, cwd=cwd)
    spec = chosen.spec
    ledger = CheckLedger(spec, quick, reports)
    failures, checked, skipped = ledger.failures, ledger.checked, ledger.skipped
    if not _workload_is_the_receipts(ledger, receipt, chosen, cwd) or (
            gate is not None and not _within_world_size(ledger, receipt, gate, project_gate(cwd))):
        return ledger.report()
    progress("check", 1, 5)
    shape = _shape_findings(receipt, spec)   # 2. reads the receipt's context only, as a receipt's check does
    failures += shape
    if not shape:
        checked.append(f"shape unchanged ({', '.join(f'{k}={v}' for k, v in ctx.resolved_shape.items())})")
    model = load_workload(spec, dict(ctx.shape), device=ctx.device, dtype=ctx.dtype).workload.model
    progress("check", 2, 5)
    model_findings = _model_findings(pe, model)
    failures += model_findings
    if not model_findings:
        n = len(pe.boundaries)
        checked.append(f"model unchanged: {n} stage boundar{'y' if n == 1 else 'ies'} and the whole-model fingerprint")
    progress("check", 3, 5)
    # 4. what the receipt itself recorded
    failures += [CheckFinding(kind=FindingKind.DECISION, message=f"the receipt records that {why}")
                 for why in pe.why_not]
    if not pe.why_not:
        checked.append(f"the receipt records per-stage plans within {mib(was.budget_bytes)} per device, bitwise "
                       "equal to the unplanned pipeline, negative control rejected")
    progress("check", 4, 5)
    plan = pe.plan
    if quick:
        skipped.append(f"the pipeline was not re-run (--quick): equivalence and per-stage peaks need a launch at "
                       f"world size {was.world_size}")
    elif model_findings or plan is None:
        skipped.append("the pipeline was not re-run: " + ("the model is not the one the plans were made for (re-run "
                                                           "the pipeline)" if model_findings else "no per-stage plans"))
    else:
        again = run_pipeline_config(_rerun_config(receipt, spec, plan), work_dir=work_dir,
                                    wall_timeout_s=wall_timeout_s, progress=progress)
        _rerun_findings(was, again, ledger)
        progress("check", 5, 5)
    return ledger.report()
