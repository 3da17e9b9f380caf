"""Making and re-checking a pipeline receipt (NOTE [pipeline receipt] in remat/pipeline_parallel/receipt.py).

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
from .engine import PipelineConfig, run_pipeline_config
from .report import PipelineReport
from ..profile import fingerprint, module_revision
from ..receipt.model import ReceiptContext, resolved_shape
from .receipt import PipelineReceipt, StageBoundary
from ..types import ProgressFn, no_progress
from ..units import mib
from ..workload import load_workload
from ..workload.loader import LoadedWorkload
from ..workflow.check import CheckFinding, CheckLedger, CheckReport, FindingKind, choose_workload, same_workload


def make_pipeline_receipt(report: PipelineReport, *, loaded: LoadedWorkload, command: str = "",
                          check_steps: int = 1, check_timeout_s: float = 60.0) -> PipelineReceipt:
    """The receipt of one pipeline run; ``loaded`` is the workload at the run's (whole-batch) shape."""
    d = report.data
    model = loaded.workload.model
    boundaries: list[StageBoundary] = []
    plan = d["plans"].get("remat")
    for st in (plan or {}).get("stages", []):
        for b in st["plan"]["boundaries"]:
            m = model.get_submodule(b["module"])
            boundaries.append(StageBoundary(stage=st["stage"], module=b["module"], class_name=type(m).__name__,
                                            revision=module_revision(m)))
    context = ReceiptContext.capture(loaded, boundary_shape=None, memory_source=d["memory_source"], command=command)
    return PipelineReceipt(context=context, pipeline=report, boundaries=boundaries, check_steps=check_steps,
                           check_timeout_s=check_timeout_s)


def check_pipeline_receipt(receipt: PipelineReceipt, *, quick: bool = False, workload: str | None = None,
                           reports: tuple[Path, str] | None = None, cwd: Path | None = None,
                           work_dir: Path | None = None, wall_timeout_s: float = 600.0,
                           progress: ProgressFn = no_progress) -> CheckReport:
    """The module docstring's checks; failures are data (``passed``), for the CLI's exit code 1."""
    ctx = receipt.context
    d = receipt.pipeline.data
    chosen = choose_workload(ctx.workload, workload, cwd=cwd)
    spec = chosen.spec
    ledger = CheckLedger(spec, quick, reports)
    failures, checked, skipped, done = ledger.failures, ledger.checked, ledger.skipped, ledger.report
    if not same_workload(spec, ctx.workload, cwd=cwd):
        failures.append(CheckFinding(kind=FindingKind.WORKLOAD, message=(
            f"the receipt was made for workload {ctx.workload!r}, but {chosen.source} names {spec!r}: nothing was run")))
        return done()
    checked.append(f"workload {spec} ({chosen.source}) is the receipt's")
    progress("check", 1, 5)
    # 2. the shape
    now = resolved_shape(spec, ctx.shape)
    then = ctx.resolved_shape
    shape = [CheckFinding(kind=FindingKind.SHAPE, message=f"shape keyword {k}: {then.get(k, '<absent>')} -> "
                                                          f"{now.get(k, '<absent>')}")
             for k in sorted(then.keys() | now.keys()) if then.get(k, "<absent>") != now.get(k, "<absent>")]
    failures += shape
    if not shape:
        checked.append(f"shape unchanged ({', '.join(f'{k}={v}' for k, v in then.items())})")
    # 3. the model the plans are bound to
    plan = receipt.plan
    model = load_workload(spec, dict(ctx.shape), device=ctx.device, dtype=ctx.dtype).workload.model
    progress("check", 2, 5)
    model_findings: list[CheckFinding] = []
    if plan is not None:
        now_fp = fingerprint(model)
        for st in plan.stages:
            diffs = st.plan.fingerprint.differences(now_fp)
            if diffs:
                shown = "; ".join(str(x) for x in diffs[:4]) + (f"; ... {len(diffs) - 4} more" if len(diffs) > 4 else "")
                model_findings.append(CheckFinding(kind=FindingKind.MODEL,
                                                   message=f"stage {st.stage}'s plan: the model changed: {shown}"))
    named = dict(model.named_modules())
    for b in receipt.boundaries:
        m = named.get(b.module)
        if m is None:
            model_findings.append(CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                                               message=f"stage {b.stage} boundary {b.module} ({b.class_name}): the "
                                                       "module is gone"))
        elif module_revision(m) != b.revision:
            model_findings.append(CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                                               message=f"stage {b.stage} boundary {b.module} ({b.class_name}): "
                                                       f"revision {b.revision} -> {module_revision(m)}"))
    failures += model_findings
    if not model_findings:
        checked.append(f"model unchanged: {len(receipt.boundaries)} stage boundar"
                       f"{'y' if len(receipt.boundaries) == 1 else 'ies'} and the whole-model fingerprint")
    progress("check", 3, 5)
    # 4. what the receipt itself recorded
    for why in receipt.why_not:
        failures.append(CheckFinding(kind=FindingKind.DECISION, message=f"the receipt records that {why}"))
    if receipt.holds:
        checked.append(f"the receipt records per-stage plans within {mib(d['budget_bytes'])} per device, bitwise "
                       "equal to the unplanned pipeline, negative control rejected")
    progress("check", 4, 5)
    if quick:
        skipped.append(f"the pipeline was not re-run (--quick): equivalence and per-stage peaks need a launch at "
                       f"world size {d['world_size']}")
        return done()
    if model_findings or plan is None:
        skipped.append("the pipeline was not re-run: " + ("the model is not the one the plans were made for (re-run "
                                                           "the pipeline)" if model_findings else "no per-stage plans"))
        return done()
    # 5. re-run: the unplanned and the planned pipeline, same schedule, microbatches, split and plans
    config = PipelineConfig(spec=spec, shape=dict(ctx.shape), world_size=d["world_size"], schedule=d["schedule"],
                            microbatches=d["microbatches"], split_points=list(d["split_points"]),
                            split_source=d["split_source"], stages_per_rank=d["stages_per_rank"], plan=plan.to_json(),
                            device=ctx.device, dtype=ctx.dtype,
                            steps=receipt.check_steps, warmup=1, timeout_s=receipt.check_timeout_s,
                            sides=["none", "remat"])
    again = run_pipeline_config(config, work_dir=work_dir, wall_timeout_s=wall_timeout_s, progress=progress)
    a = again.data
    eq = a["equivalence"].get("remat")
    if eq is not None and eq["ok"]:
        checked.append(f"re-run at world size {a['world_size']} ({a['schedule']}, {a['microbatches']} microbatches): "
                       f"gradients bitwise equal to the unplanned pipeline over {eq['params_compared']} parameters")
    else:
        failures.append(CheckFinding(kind=FindingKind.EQUIVALENCE, message=(
            "re-run: the planned pipeline's gradients differ from the unplanned one's"
            + ("" if eq is None else f" (max |diff| {eq['max_abs_diff']:.3g}; "
                                     + "; ".join(eq["mismatched"][:3]) + ")"))))
    if a["negative_control_rejected"] is False:
        failures.append(CheckFinding(kind=FindingKind.EQUIVALENCE,
                                     message="re-run: the negative control (a perturbed gradient) was accepted"))
    budget = d["budget_bytes"]
    for s, was in zip(a["sides"]["remat"]["per_stage"], d["sides"]["remat"]["per_stage"]):
        if budget is not None and s["peak_bytes"] > budget:
            failures.append(CheckFinding(kind=FindingKind.PEAK, message=(
                f"stage {s['stage']}: peak {mib(s['peak_bytes'])} with its plan is over the per-device budget "
                f"{mib(budget)} (the receipt measured {mib(was['peak_bytes'])})")))
        else:
            checked.append(f"stage {s['stage']}: peak {mib(s['peak_bytes'])} within {mib(budget)} "
                           f"(receipt: {mib(was['peak_bytes'])})")
    progress("check", 5, 5)
    return done()

