"""The receipt at a world size: running the shipped plan on N ranks for ``remat receipt --world-size N``,
and re-checking it for ``remat check`` (NOTE [receipt at a world size] in remat/receipt/world_size.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..distributed import DistributedConfig, DistributedReport, Engine, run_distributed
from ..plan import Plan
from ..receipt.model import Coverage, Receipt, UnsupportedMode
from ..receipt.world_size import RUN_COMM_STEPS, RUN_WARMUP, WorldSizeEvidence
from ..types import ProgressFn, no_progress
from ..units import mib
from .build import WORLD_SIZE_MODE
from .findings import CheckFinding, FindingKind
from .gate import Thresholds

DEFAULT_WALL_S = 1800.0


def _config(receipt: Receipt, plan: Plan, *, world_size: int, engine: Engine, budget_bytes: int, steps: int,
            timeout_s: float) -> DistributedConfig:
    ctx = receipt.context
    return DistributedConfig(spec=ctx.workload, shape=dict(ctx.shape), world_size=world_size, engine=engine, plan=plan,
                             device=ctx.device, dtype=ctx.dtype, steps=steps, warmup=RUN_WARMUP,
                             comm_steps=RUN_COMM_STEPS,
                             timeout_s=timeout_s, ablation=False, budget_bytes=budget_bytes)


def _coverage(unsupported: list[UnsupportedMode], report: DistributedReport) -> list[UnsupportedMode]:
    """"world size > 1" becomes the sizes and engines not run."""
    other = (Engine.FSDP2 if report.engine is Engine.DDP else Engine.DDP).value
    engine = report.engine.value
    entry = UnsupportedMode(mode=f"world sizes other than {report.world_size} ({engine})", status=Coverage.NOT_RUN,
                            detail=f"the plan ran at world size {report.world_size} under {engine} "
                                   f"({report.backend}) only; {other} and other sizes were not run (FSDP2 shards and "
                                   "DDP's buckets move the per-rank peaks with the world size)")
    return [entry if u.mode == WORLD_SIZE_MODE else u for u in unsupported]


def with_world_size(receipt: Receipt, *, world_size: int, engine: Engine | str, check_steps: int = 2,
                    check_timeout_s: float = 120.0, work_dir: Path | None = None,
                    wall_timeout_s: float = DEFAULT_WALL_S, progress: ProgressFn = no_progress) -> Receipt:
    """``receipt`` with its shipped plan run at ``world_size`` ranks under ``engine`` (unchanged when nothing
    ships): each rank's planned peak held to the receipt's budget less its reserve."""
    plan = receipt.plan.plan
    if not receipt.shipped or plan is None:
        return receipt
    cfg = _config(receipt, plan, world_size=world_size, engine=Engine(engine),
                  budget_bytes=receipt.decision.effective_budget_bytes, steps=check_steps, timeout_s=check_timeout_s)
    report = run_distributed(cfg, work_dir=work_dir, wall_timeout_s=wall_timeout_s, progress=progress)
    evidence = WorldSizeEvidence(report=report, check_steps=check_steps, check_timeout_s=check_timeout_s)
    return dataclasses.replace(receipt, world_size=evidence, unsupported=_coverage(receipt.unsupported, report))


def _samples_line(report: DistributedReport) -> str:
    """Global samples/s beside the per-device peaks."""
    side = report.plan if report.plan is not None else report.control
    peaks = ", ".join(f"rank {r.rank} {mib(r.peak_bytes)}" for r in side.per_rank)
    return f"{side.global_samples_per_s:.1f} samples/s over {report.world_size} ranks; per-device peaks {peaks}"


def check_recorded(receipt: Receipt, thresholds: Thresholds) -> tuple[list[CheckFinding], list[str]]:
    """The recorded run at its world size against the gate's per-device budget (never the report's own):
    (failures, what held)."""
    ev = receipt.world_size
    if ev is None:
        return [], []
    limit = thresholds.effective_budget_bytes
    why = ev.why_not(limit)
    failures = [CheckFinding(kind=FindingKind.DECISION, message=f"the receipt records that {w}") for w in why]
    held = [] if why else [f"the receipt records the plan at world size {ev.world_size} ({ev.engine.value}): "
                           f"the control's step on every rank, every planned peak within {mib(limit)}; "
                           f"{_samples_line(ev.report)}"]
    return failures, held


def _rank_findings(again: DistributedReport, was: DistributedReport, limit: int, tol: float) -> list[CheckFinding]:
    out = []
    recorded = {r.rank: r.peak_bytes for r in (was.plan.per_rank if was.plan else [])}
    for r in again.plan.per_rank if again.plan else []:
        if r.peak_bytes > limit:
            out.append(CheckFinding(kind=FindingKind.PEAK, message=(
                f"re-run at world size {again.world_size}: rank {r.rank}'s planned peak {mib(r.peak_bytes)} is over "
                f"the per-device budget {mib(limit)} (the receipt measured {mib(recorded.get(r.rank))})")))
        claimed = recorded.get(r.rank)
        if claimed is not None and r.peak_bytes > claimed * (1.0 + tol):
            out.append(CheckFinding(kind=FindingKind.PEAK_CLAIM, message=(
                f"re-run at world size {again.world_size}: rank {r.rank}'s planned peak {mib(r.peak_bytes)} is over "
                f"the {mib(claimed)} the receipt claims (more than the {tol:.0%} tolerance)")))
    return out


def check_rerun(receipt: Receipt, plan: Plan, thresholds: Thresholds, *, spec: str, work_dir: Path | None = None,
                wall_timeout_s: float = DEFAULT_WALL_S, progress: ProgressFn = no_progress
                ) -> tuple[list[CheckFinding], list[str]]:
    """Re-run the recorded launch at its world size on the user's workload ``spec``: equivalence, each rank's
    peak against the gate's budget and against the receipt's claim; (failures, what held)."""
    ev = receipt.world_size
    if ev is None:
        return [], []
    limit = thresholds.effective_budget_bytes
    cfg = dataclasses.replace(_config(receipt, plan, world_size=ev.world_size, engine=ev.engine,
                                      budget_bytes=limit, steps=ev.check_steps, timeout_s=ev.check_timeout_s),
                              spec=spec)
    again = run_distributed(cfg, work_dir=work_dir, wall_timeout_s=wall_timeout_s, progress=progress)
    failures = _rank_findings(again, ev.report, limit, thresholds.peak_tolerance.value)
    eq = again.equivalence
    if eq is None or not eq.ok:
        failures.append(CheckFinding(kind=FindingKind.EQUIVALENCE, message=(
            f"re-run at world size {again.world_size} ({again.engine.value}): the plan is not the control's "
            "training step"
            + ("" if eq is None else f" (grads {'match' if eq.grads_match else 'differ'}, max |diff| "
                                      f"{eq.max_abs_diff:.3g}, collective counts "
                                      f"{'unchanged' if eq.collective_counts_equal else 'changed'})"))))
    held = [] if failures else [
        f"re-run at world size {again.world_size} ({again.engine.value}, {again.backend}): gradients "
        f"{eq.criterion} equal on every rank, every planned peak within {mib(limit)}; {_samples_line(again)}"]
    return failures, held
