"""Making and re-checking a pipeline receipt (NOTE [pipeline receipt] in remat/receipt/pipeline.py).

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

from pathlib import Path
from typing import Any

from ..distributed.config import DistributedConfig, Engine, PipelineSettings
from ..distributed.pipeline.engine import run_pipeline_config
from ..plan.pipeline import PipelinePlan, Side
from ..distributed.pipeline.report import PipelineReport
from ..profile import fingerprint, module_revision
from ..receipt.model import ReceiptContext
from ..receipt.pipeline import PipelineReceipt, StageBoundary
from ..types import ProgressFn, no_progress
from ..units import mib
from ..workload import load_workload
from ..workload.loader import LoadedWorkload
from .check import (CheckFinding, CheckLedger, CheckReport, FindingKind, ReportStamps, _shape_findings,
                    choose_workload, same_workload)


def make_pipeline_receipt(report: PipelineReport, *, loaded: LoadedWorkload, command: str = "",
                          check_steps: int = 1, check_timeout_s: float = 60.0) -> PipelineReceipt:
    """The receipt of one pipeline run; ``loaded`` is the workload at the run's (whole-batch) shape."""
    model = loaded.workload.model
    plan = report.remat_plan
    boundaries = [StageBoundary(stage=st.stage, module=b.module, class_name=type(m).__name__, revision=module_revision(m))
                  for st in ([] if plan is None else plan.stages) for b in st.plan.boundaries
                  for m in [model.get_submodule(b.module)]]
    context = ReceiptContext.capture(loaded, boundary_shape=None, memory_source=report.memory_source, command=command)
    return PipelineReceipt(context=context, pipeline=report, boundaries=boundaries, check_steps=check_steps,
                           check_timeout_s=check_timeout_s)


def _model_findings(receipt: PipelineReceipt, model: Any) -> list[CheckFinding]:
    """3. every stage plan's whole-model fingerprint, and each boundary's revision hash."""
    plan = receipt.plan
    out: list[CheckFinding] = []
    now_fp = None if plan is None else fingerprint(model)
    for st in [] if plan is None else plan.stages:
        diffs = st.plan.fingerprint.differences(now_fp)
        if diffs:
            shown = "; ".join(str(x) for x in diffs[:4]) + (f"; ... {len(diffs) - 4} more" if len(diffs) > 4 else "")
            out.append(CheckFinding(kind=FindingKind.MODEL, message=f"stage {st.stage}'s plan: the model changed: {shown}"))
    named = dict(model.named_modules())
    for b in receipt.boundaries:
        m = named.get(b.module)
        if m is None:
            out.append(CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                                    message=f"stage {b.stage} boundary {b.module} ({b.class_name}): the module is gone"))
        elif module_revision(m) != b.revision:
            out.append(CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                                    message=f"stage {b.stage} boundary {b.module} ({b.class_name}): "
                                            f"revision {b.revision} -> {module_revision(m)}"))
    return out


def _rerun_config(receipt: PipelineReceipt, spec: str, plan: PipelinePlan) -> DistributedConfig:
    """5. the unplanned and the planned pipeline, the receipt's schedule, microbatches, split and plans."""
    ctx, p = receipt.context, receipt.pipeline
    settings = PipelineSettings(schedule=p.schedule, microbatches=p.microbatches, split_points=list(p.split_points),
                                split_source=p.split_source, stages_per_rank=p.stages_per_rank,
                                sides=[Side.NONE, Side.REMAT])
    return DistributedConfig(spec=spec, shape=dict(ctx.shape), world_size=p.world_size, engine=Engine.PIPELINE,
                             plan=plan, device=ctx.device, dtype=ctx.dtype, steps=receipt.check_steps, warmup=1,
                             timeout_s=receipt.check_timeout_s, pipeline=settings)


def _rerun_findings(was: PipelineReport, again: PipelineReport, ledger: CheckLedger) -> None:
    """5. the re-run's equivalence, negative control and per-stage peaks, against the receipt's budget."""
    eq = again.equivalence.get(Side.REMAT)
    if eq is not None and eq.ok:
        ledger.checked.append(f"re-run at world size {again.world_size} ({again.schedule.value}, {again.microbatches} "
                              f"microbatches): gradients bitwise equal to the unplanned pipeline over "
                              f"{eq.params_compared} parameters")
    else:
        ledger.failures.append(CheckFinding(kind=FindingKind.EQUIVALENCE, message=(
            "re-run: the planned pipeline's gradients differ from the unplanned one's"
            + ("" if eq is None else f" (max |diff| {eq.max_abs_diff:.3g}; " + "; ".join(eq.mismatched[:3]) + ")"))))
    if again.negative_control_rejected is False:
        ledger.failures.append(CheckFinding(kind=FindingKind.EQUIVALENCE,
                                            message="re-run: the negative control (a perturbed gradient) was accepted"))
    budget = was.budget_bytes
    for s, before in zip(again.sides[Side.REMAT].per_stage, was.sides[Side.REMAT].per_stage):
        if budget is not None and s.peak_bytes > budget:
            ledger.failures.append(CheckFinding(kind=FindingKind.PEAK, message=(
                f"stage {s.stage}: peak {mib(s.peak_bytes)} with its plan is over the per-device budget "
                f"{mib(budget)} (the receipt measured {mib(before.peak_bytes)})")))
        else:
            ledger.checked.append(f"stage {s.stage}: peak {mib(s.peak_bytes)} within {mib(budget)} "
                                  f"(receipt: {mib(before.peak_bytes)})")


def check_pipeline_receipt(receipt: PipelineReceipt, *, quick: bool = False, workload: str | None = None,
                           reports: ReportStamps | None = None, cwd: Path | None = None,
                           work_dir: Path | None = None, wall_timeout_s: float = 600.0,
                           max_world_size: int | None = None, progress: ProgressFn = no_progress) -> CheckReport:
    """The module docstring's checks; failures are data (``passed``), for the CLI's exit code 1. A receipt made
    at more ranks than ``max_world_size`` fails before anything runs (NOTE [gate thresholds] in
    remat/workflow/gate.py)."""
    ctx, was = receipt.context, receipt.pipeline
    chosen = choose_workload(ctx.workload, workload, cwd=cwd)
    spec = chosen.spec
    ledger = CheckLedger(spec, quick, reports)
    failures, checked, skipped = ledger.failures, ledger.checked, ledger.skipped
    if not same_workload(spec, ctx.workload, cwd=cwd):
        failures.append(CheckFinding(kind=FindingKind.WORKLOAD, message=(
            f"the receipt was made for workload {ctx.workload!r}, but {chosen.source} names {spec!r}: nothing was run")))
        return ledger.report()
    checked.append(f"workload {spec} ({chosen.source}) is the receipt's")
    if max_world_size is not None and was.world_size > max_world_size:
        failures.append(CheckFinding(kind=FindingKind.FIXTURE, message=(
            f"the receipt was made at world size {was.world_size}, more than the {max_world_size} ranks check may "
            "launch; raise --max-world-size, or max-world-size in [tool.remat], if that is meant")))
        skipped.append(f"nothing re-run and nothing launched: the receipt's world size {was.world_size} is above "
                       f"the gate's {max_world_size}")
        return ledger.report()
    progress("check", 1, 5)
    shape = _shape_findings(receipt, spec)   # 2. reads the receipt's context only, as a receipt's check does
    failures += shape
    if not shape:
        checked.append(f"shape unchanged ({', '.join(f'{k}={v}' for k, v in ctx.resolved_shape.items())})")
    model = load_workload(spec, dict(ctx.shape), device=ctx.device, dtype=ctx.dtype).workload.model
    progress("check", 2, 5)
    model_findings = _model_findings(receipt, model)
    failures += model_findings
    if not model_findings:
        n = len(receipt.boundaries)
        checked.append(f"model unchanged: {n} stage boundar{'y' if n == 1 else 'ies'} and the whole-model fingerprint")
    progress("check", 3, 5)
    # 4. what the receipt itself recorded
    failures += [CheckFinding(kind=FindingKind.DECISION, message=f"the receipt records that {why}")
                 for why in receipt.why_not]
    if receipt.holds:
        checked.append(f"the receipt records per-stage plans within {mib(was.budget_bytes)} per device, bitwise "
                       "equal to the unplanned pipeline, negative control rejected")
    progress("check", 4, 5)
    plan = receipt.plan
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
