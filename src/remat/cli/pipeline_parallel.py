"""``remat distributed --engine pipeline``: no plan, a uniform plan, remat's per-stage plans, side by side.

Writes ``OUT/pipeline.json`` (PipelineReport), ``OUT/plan.json`` (the per-stage PipelinePlan),
``OUT/profile.json`` (the whole model profiled at the microbatch shape, what it plans from),
``OUT/pipeline.md``, and the pipeline receipt: ``OUT/receipt.json``, ``OUT/report.html`` and
``OUT/report.md`` (NOTE [pipeline receipt] in remat/receipt/pipeline.py), which
``remat check OUT/receipt.json`` re-checks.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from .._io import atomic_write_json
from ..distributed.config import DistributedConfig, Engine, PipelineSettings, check_stages_per_rank
from ..distributed.pipeline.engine import check_split, default_split, microbatch_shape, run_pipeline_config
from ..distributed.pipeline.report import PipelineReport, SideReport
from ..plan import parse_budget, parse_reserve
from ..plan.pipeline import PipelinePlan, Side, load_any_plan
from ..receipt.write import HTML_FILE, MD_FILE, RECEIPT_FILE
from ..receipt.pipeline_render import write_pipeline_receipt
from ..workload import parse_shape
from ..errors import DistributedError, PlanError
from ..types import ProgressFn
from .common import check_out_dir
from ..units import fmt_bytes
from .render import console, progress_bar


def _given_plan(args: argparse.Namespace) -> PipelinePlan | None:
    """``--plan``: a per-stage plan made for this schedule, microbatch count and world size (else PlanError)."""
    path = getattr(args, "plan", None)
    if path is None:
        return None
    given = load_any_plan(path)
    if not isinstance(given, PipelinePlan):
        raise PlanError(f"{path} is a whole-model plan; --engine pipeline runs a per-stage pipeline plan",
                        tip="a pipeline plan is the plan.json that `remat distributed --engine pipeline` writes")
    if (given.schedule.value, given.microbatches, len(given.stages)) != (args.schedule, args.microbatches,
                                                                         args.world_size):
        raise PlanError(f"{path} was planned for {given.schedule.value} with {given.microbatches} microbatches "
                        f"on {len(given.stages)} stages; this run asks for {args.schedule}, {args.microbatches}, "
                        f"{args.world_size}: the stages' in-flight counts, and so the plans, would differ",
                        tip="pass the plan's --schedule, --microbatches and --world-size, or plan again")
    return given


def _launch(args: argparse.Namespace, *, verify_only: bool = False) -> PipelineReport:
    """Plan (unless ``--plan``), launch, write OUT/pipeline.json, plan.json, pipeline.md and the receipt.

    ``verify_only``: the unplanned and the planned pipeline only, one warm-up step each (the step whose
    gradients are compared) and one timed step: ``remat verify --engine pipeline``.
    """
    _refuse_unlaunchable(args)
    shape = parse_shape(args.shape)
    v = args.stages_per_rank or (2 if args.schedule == "interleaved-1f1b" else 1)
    check_stages_per_rank(args.schedule, v, args.world_size, args.microbatches)
    budget, reserve = _budget_and_reserve(args)
    check_out_dir(args.out, ("pipeline.json", "plan.json", RECEIPT_FILE, HTML_FILE, MD_FILE))
    given = _given_plan(args)
    if verify_only and given is None:
        raise PlanError("remat verify --engine pipeline needs --plan: a per-stage plan (the plan.json that "
                        "`remat distributed --engine pipeline` writes)")
    mb_shape = microbatch_shape(shape, args.microbatches)
    points, source = _split(args, shape, given, v * args.world_size)
    with progress_bar() as progress:
        settings = PipelineSettings(
            schedule=args.schedule, microbatches=args.microbatches, split_points=points, split_source=source,
            stages_per_rank=v, profile=None if given is not None else _profile(args, mb_shape, progress),
            budget=budget, reserve=reserve, sides=["none", "uniform", "remat"] if given is None else ["none", "remat"])
        config = DistributedConfig(
            spec=args.workload, shape=shape, world_size=args.world_size, engine=Engine.PIPELINE, plan=given,
            device=args.device, dtype=args.dtype, steps=1 if verify_only else args.dist_steps,
            warmup=1 if verify_only else args.dist_warmup, timeout_s=args.dist_timeout, pipeline=settings)
        result = run_pipeline_config(config, work_dir=Path(args.out) / "distributed",
                                     wall_timeout_s=args.dist_wall_timeout, progress=progress)
    _write_outputs(args, result)
    if result.remat_plan is not None:
        _write_receipt(args, shape, result)
    return result


def _budget_and_reserve(args: argparse.Namespace) -> tuple[str | None, float]:
    """``--budget`` as given (syntax-checked before any measuring) and ``--reserve`` as a share."""
    budget = getattr(args, "budget", None)
    reserve = parse_reserve(getattr(args, "reserve", "5%"))
    if budget is not None:
        parse_budget(budget, 1 << 50)
    return budget, reserve


def _refuse_unlaunchable(args: argparse.Namespace) -> None:
    if getattr(args, "emit_config", None) is not None:
        raise DistributedError("--emit-config does not cover --engine pipeline yet",
                               tip="run `remat distributed --engine pipeline` on one host")
    if not getattr(args, "world_size", None):
        raise DistributedError("--engine pipeline needs --world-size N (one stage per rank, N >= 2)")


def _split(args: argparse.Namespace, shape: dict, given: PipelinePlan | None, n_stages: int) -> tuple[list[str], str]:
    """(split points, where they come from): ``--split-points``, the plan's, or NOTE [default split]."""
    if args.split_points:
        points, source = [p.strip() for p in args.split_points.split(",") if p.strip()], "given (--split-points)"
    elif given is not None:
        points, source = list(given.split_points), f"from the plan ({given.split_source})"
    else:
        points, source = [], ""
    check_split(args.workload, shape, points, n_stages, args.microbatches, dtype=args.dtype)
    if not points:
        points, source = default_split(args.workload, shape, n_stages, args.microbatches, dtype=args.dtype)
    return points, source


def _profile(args: argparse.Namespace, mb_shape: dict, progress: ProgressFn) -> dict:
    """The whole model profiled at the microbatch shape (what the per-stage plans are planned from): its JSON,
    also written to OUT/profile.json."""
    from ..profile.step import profile_workload
    from ..workload.loader import load_workload
    report = profile_workload(load_workload(args.workload, mb_shape, dtype=args.dtype), progress=progress)
    atomic_write_json(Path(args.out) / "profile.json", report.to_json())
    return report.to_json()


def _write_outputs(args: argparse.Namespace, result: PipelineReport) -> None:
    """OUT/pipeline.json, plan.json (remat's per-stage plans) and pipeline.md; the table."""
    path = atomic_write_json(Path(args.out) / "pipeline.json", result.to_json())
    if result.remat_plan is not None:
        result.remat_plan.save(Path(args.out) / "plan.json")
    from .._io import atomic_write_text
    from ..receipt.pipeline_markdown import render_pipeline_markdown
    atomic_write_text(Path(args.out) / "pipeline.md", render_pipeline_markdown(result))
    render(result)
    console.print(f"wrote {path}")


def _write_receipt(args: argparse.Namespace, shape: dict, result: PipelineReport) -> None:
    """The pipeline receipt (NOTE [pipeline receipt]): OUT/receipt.json, report.html and report.md."""
    from ..workflow.pipeline import make_pipeline_receipt
    from ..workload.loader import load_workload
    command = " ".join(shlex.quote(a) for a in ["remat", *sys.argv[1:]]) if sys.argv else ""
    receipt = make_pipeline_receipt(result, loaded=load_workload(args.workload, shape, dtype=args.dtype),
                                    command=command, check_timeout_s=max(args.dist_timeout, 1.0))
    files = write_pipeline_receipt(receipt, args.out)
    console.print(f"wrote {files.receipt}, {files.html} and {files.markdown}; re-check it: remat check "
                  f"{files.receipt}" + ("" if receipt.holds else f" (it does NOT hold: {'; '.join(receipt.why_not)})"),
                  highlight=False)


def run_pipeline(args: argparse.Namespace) -> int:
    """``remat distributed --engine pipeline``: no plan, uniform, per-stage plans side by side (or ``--plan``)."""
    result = _launch(args)
    if result.remat_fits is False:
        console.print("[bold red]remat's per-stage plans measured over the per-device budget on "
                      + ", ".join(f"stage {k}" for k in result.over_budget_stages) + "[/]")
    return 0 if result.ok and result.remat_fits is not False else 1


def run_pipeline_verify(args: argparse.Namespace) -> int:
    """``remat verify --engine pipeline --plan plan.json``: the planned pipeline vs the unplanned one with the same
    schedule, microbatches and split, bitwise on CPU; the negative control (a perturbed gradient) must be rejected.
    Exit 1 when they differ or the control is accepted."""
    result = _launch(args, verify_only=True)
    eq = result.equivalence.get(Side.REMAT)
    if eq is not None and eq.ok and result.negative_control_rejected is True:
        console.print("[bold green]PASSED[/]: the planned pipeline trains bitwise like the unplanned one")
        return 0
    console.print("[bold red]FAILED[/]: " + ("the planned pipeline's gradients differ" if not (eq and eq.ok)
                                           else "the negative control was accepted: the comparison proves nothing"))
    return 1


def run_pipeline_frontier(args: argparse.Namespace) -> int:
    """``remat frontier --engine pipeline``: the pipeline's frontier points are its three sides (no plan; the
    uniform plan on every stage; remat's per-stage plans at ``--budget``): largest stage peak vs step p50."""
    if getattr(args, "plans", None):
        raise DistributedError("--plans does not apply to --engine pipeline: its points are no plan, the uniform "
                               "plan on every stage and remat's per-stage plans at --budget",
                               tip="drop --plans; run again with another --budget for another point")
    result = _launch(args)
    console.print(_frontier_table(result))
    return 0 if result.ok and result.remat_fits is not False else 1


def _frontier_table(report: PipelineReport) -> Table:
    """Each side a point: largest stage peak vs step p50, ``*`` where no other side is as good on both."""
    points = {name: (s.max_peak_bytes, s.p50_ms) for name, s in report.sides.items()}
    budget = report.budget_bytes
    rows = []
    for name, s in report.sides.items():
        mine = points[name]
        dominated = any(o[0] <= mine[0] and o[1] <= mine[1] and o != mine for o in points.values())
        fits = "-" if budget is None else ("yes" if s.max_peak_bytes <= budget else "no")
        rows.append([name.value + ("" if dominated else " *"), fmt_bytes(s.max_peak_bytes), f"{s.p50_ms:.1f}",
                     f"{s.samples_per_s:.1f}", fits, f"{s.max_bubble_fraction:.3f}"])
    return _table("pipeline frontier: largest stage peak vs step p50 (* = Pareto)",
                  ["side", "largest stage peak", "step p50 ms", "samples/s", "fits", "largest bubble"], rows)


def run_pipeline_simulate(args: argparse.Namespace) -> int:
    """``remat distributed --engine pipeline --simulate``: per-stage peaks and bubbles predicted at --world-size
    for --target-device (NOTE [simulated pipeline]); OUT/pipeline-sim.json, nothing launched."""
    from ..distributed.pipeline.simulate import simulate_pipeline
    shape = parse_shape(args.shape)
    check_out_dir(args.out, ("pipeline-sim.json",))
    points = [p.strip() for p in args.split_points.split(",") if p.strip()] if args.split_points else None
    plan = _given_plan(args)
    if args.schedule == "interleaved-1f1b":
        raise DistributedError("--simulate covers gpipe and 1f1b so far", tip="--schedule 1f1b")
    with progress_bar() as progress:
        sim = simulate_pipeline(args.workload, shape, world_size=args.world_size, microbatches=args.microbatches,
                                schedule=args.schedule, split_points=points or (plan.split_points if plan else None),
                                target_device=args.target_device, dtype=args.dtype, plan=plan, progress=progress)
    path = atomic_write_json(Path(args.out) / "pipeline-sim.json", sim.to_json())
    table = Table(title=f"{sim.spec} simulated on {sim.world_size} x {sim.device}: {sim.schedule.value}, {sim.microbatches} "
                        f"microbatches, split at {', '.join(sim.split_points)} (ideal bubble "
                        f"{sim.ideal_bubble_fraction:.3f}; predicted step {sim.step_ms:.1f} ms)")
    for col in ("stage", "blocks", "in flight", "fwd ms", "bwd ms", "held / mb", "static", "peak", "bubble"):
        table.add_column(col, justify="left" if col == "blocks" else "right")
    for s in sim.stages:
        table.add_row(str(s.stage), f"{s.blocks[0]}..{s.blocks[-1]}", str(s.in_flight), f"{s.forward_ms:.2f}",
                      f"{s.backward_ms:.2f}", fmt_bytes(s.held_bytes), fmt_bytes(s.static_bytes),
                      fmt_bytes(s.peak_bytes), f"{s.bubble_fraction:.3f}")
    console.print(table)
    console.print(f"wrote {path}")
    return 0


def _table(title: str | None, headers: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for col in headers:
        table.add_column(col, justify="left" if col in ("side", "boundaries") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _bubble_growth(side: SideReport) -> list[str]:
    """The stages whose bubble grew over the unplanned run's, with their replay time."""
    return [f"stage {s.stage} +{s.bubble_delta_vs_none:.3f} (replay {s.replay_ms:.1f} ms)"
            for s in side.per_stage if (s.bubble_delta_vs_none or 0.0) > 0.0]


def render(report: PipelineReport) -> None:
    """The per-stage and per-side tables and the equivalence, in pipeline.md's cells and words."""
    from ..receipt.pipeline_markdown import SIDE_HEADERS, STAGE_HEADERS, equivalence_text, side_cells, stage_cells
    title = (f"{report.spec} pipeline: {report.world_size} stages, {report.schedule.value}, {report.microbatches} "
             f"microbatches, split at {', '.join(report.split_points)} (ideal bubble "
             f"{report.ideal_bubble_fraction:.3f})")
    console.print(_table(title, STAGE_HEADERS, [stage_cells(name, s, no="[red]no[/]")
                                                for name, side in report.sides.items() for s in side.per_stage]))
    console.print(_table(None, SIDE_HEADERS, [side_cells(name, side) for name, side in report.sides.items()]))
    for name, side in report.sides.items():
        worse = _bubble_growth(side)
        if worse:
            console.print(f"{name.value}: bubble grew over the unplanned run on {', '.join(worse)}")
    for name, eq in report.equivalence.items():
        verdict = "[green]bitwise equal[/]" if eq.ok else "[bold red]DIFFERENT[/]"
        console.print("equivalence: " + equivalence_text(name, eq, verdict, escape=escape))
    neg = report.negative_control_rejected
    if neg is not None:
        console.print(f"negative control (a gradient perturbed by 1e-3): {'rejected' if neg else '[bold red]ACCEPTED[/]'}")
