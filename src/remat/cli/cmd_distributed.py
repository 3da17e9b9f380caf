"""``remat distributed``: the control and the plan at world size N (DDP or FSDP2), side by side; or
``--engine pipeline``: no plan, a uniform plan and remat's per-stage plans, side by side (the run and its
receipt are remat.workflow.pipeline's ``run_pipeline_job``).

``add_distributed_args`` + ``run_distributed_from_args`` are also what ``frontier`` and
``verify`` call to honour ``--world-size N [--engine ddp|fsdp2]``; ``run_pipeline_verify`` and
``run_pipeline_frontier`` are their ``--engine pipeline``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from .._io import atomic_write_json
from ..distributed import DistributedConfig, DistributedReport, Engine, run_distributed
from ..distributed.launch import multinode_commands
from ..plan.model import Plan
from ..workload import parse_shape
from ..distributed.report import SideReport
from ..errors import DistributedError, OutputError, PlanError
from ..plan.pipeline import PipelinePlan, Side, load_any_plan
from ..units import fmt_bytes
from ..receipt.schema import MAX_STEPS, MAX_WARMUP
from .common import MAX_SECONDS, add_workload_args, bounded_float, bounded_int, check_out_dir
from .render import console, progress_bar


def add_distributed_args(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    """``--world-size`` and the options of a distributed run (all prefixed, to sit beside any command's own)."""
    g = p.add_argument_group("distributed (torch.distributed, launched with torchrun)")
    g.add_argument("--world-size", type=bounded_int(1, 1024), default=None, required=required,
                   help="run the step on N ranks of this host and write DIR/distributed.json" +
                        ("" if required else " (default: no distributed run)"))
    g.add_argument("--engine", choices=[e.value for e in Engine], default=Engine.DDP.value,
                   help="ddp (DistributedDataParallel), fsdp2 (fully_shard) or pipeline (torch.distributed.pipelining, "
                        "one stage per rank: per-stage plans side by side, or with verify the planned vs the unplanned "
                        "pipeline) (default: ddp)")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"], default="1f1b",
                   help="pipeline schedule (torch's ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B) "
                        "(default: 1f1b)")
    g.add_argument("--stages-per-rank", type=bounded_int(1, 1000), default=None,
                   help="pipeline stages per rank (interleaved-1f1b: default 2; the others run 1)")
    g.add_argument("--microbatches", type=bounded_int(1, 100_000), default=4,
                   help="pipeline microbatches per step; batch_size must be a multiple (default 4)")
    g.add_argument("--split-points", default=None, metavar="PATH.I,...",
                   help="first block of every pipeline stage after the first, e.g. h.2,h.4 (default: even by "
                        "measured forward time)")
    g.add_argument("--dist-steps", type=bounded_int(1, MAX_STEPS), default=10, help="timed warm steps per rank and side (default 10)")
    g.add_argument("--dist-warmup", type=bounded_int(2, MAX_WARMUP), default=2, help="untimed warm-up steps, at least 2 (default 2)")
    g.add_argument("--dist-comm-steps", type=bounded_int(1, MAX_STEPS), default=3,
                   help="extra steps with the compute timer on, for exposed communication (default 3)")
    g.add_argument("--dist-timeout", type=bounded_float(0, MAX_SECONDS), default=120.0,
                   help="seconds any one collective may take before the rank fails (default 120)")
    g.add_argument("--dist-wall-timeout", type=bounded_float(0, MAX_SECONDS), default=3600.0,
                   help="seconds the whole distributed run may take (default 3600)")
    g.add_argument("--find-unused-parameters", action="store_true", help="DDP find_unused_parameters=True")
    g.add_argument("--no-ablation", action="store_true", help="skip the no-op comm hook ablation")


def _budget_bytes(args: argparse.Namespace, plan: Plan | None) -> int | None:
    """``remat distributed --budget`` for ddp/fsdp2: bytes, or a share of the plan's own no-checkpoint peak
    (None: the plan's budget)."""
    if args.budget is None:
        return None
    from ..plan.budget import parse_budget
    return parse_budget(args.budget, plan.baseline_peak_bytes if plan is not None else 0)


def config_from_args(args: argparse.Namespace, plan: Plan | None, *, budget_bytes: int | None = None,
                     wall_timeout_s: float | None = None) -> DistributedConfig:
    """``budget_bytes``: per-device budget (None: the plan's); ``wall_timeout_s``: each rank's own limit
    (the multi-node path; NOTE [rank wall clock] in the worker)."""
    return DistributedConfig(spec=args.workload, shape=parse_shape(args.shape), world_size=args.world_size,
                             engine=Engine(args.engine), plan=plan, device=args.device, dtype=args.dtype,
                             steps=args.dist_steps, warmup=args.dist_warmup, comm_steps=args.dist_comm_steps,
                             timeout_s=args.dist_timeout, ablation=not args.no_ablation,
                             find_unused_parameters=args.find_unused_parameters,
                             budget_bytes=budget_bytes, wall_timeout_s=wall_timeout_s)


def run_distributed_from_args(args: argparse.Namespace, plan: Plan | None, out_dir: Path, *,
                              budget_bytes: int | None = None) -> DistributedReport | None:
    """Run, write ``out_dir/distributed.json``, print the table; None when ``--world-size`` was not given.
    ``budget_bytes``: the per-device budget every rank's planned peak is held to (None: the plan's).

    Rank files, torchrun's log and the config go to ``out_dir/distributed/``.
    """
    if not getattr(args, "world_size", None):
        return None
    if args.engine == "pipeline":
        # verify and frontier route --engine pipeline to run_pipeline_verify/_frontier before they get here
        raise DistributedError("--engine pipeline takes per-stage plans, not a whole-model plan",
                               tip="remat distributed --engine pipeline --world-size 2 --schedule 1f1b --microbatches 4 ...")
    config = config_from_args(args, plan, budget_bytes=budget_bytes)
    with progress_bar() as progress:
        report = run_distributed(config, work_dir=Path(out_dir) / "distributed", wall_timeout_s=args.dist_wall_timeout,
                                 progress=progress)
    path = atomic_write_json(Path(out_dir) / "distributed.json", report.to_json())
    render_report(report)
    console.print(f"wrote {path}")
    return report


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def render_report(report: DistributedReport) -> None:
    """The report's tables: per rank and side (a pipeline's: per stage and side, NOTE [one per-rank report])."""
    if report.pipeline is not None:
        render_pipeline(report)
        return
    table = Table(title=f"{report.spec} on {report.world_size} ranks, {report.engine.value} over {report.backend} "
                        f"({report.steps} timed steps per rank)")
    for col in ("side", "rank", "p50 ms", "p95 ms", "peak", "exposed comm ms", "comm ms", "no-comm ms"):
        table.add_column(col, justify="left" if col == "side" else "right")
    for name in ("control", "plan"):
        side = report.side(name)
        if side is None:
            continue
        for r in side.per_rank:
            table.add_row(name, str(r.rank), _ms(r.p50_ms), _ms(r.p95_ms), fmt_bytes(r.peak_bytes),
                          _ms(r.exposed_comm_ms), _ms(r.comm_ms), _ms(r.ablation_step_ms))
    console.print(table)
    for name in ("control", "plan"):
        side = report.side(name)
        if side is None:
            continue
        colls = ", ".join(f"{op} x{c.count} ({fmt_bytes(c.bytes)})" for op, c in side.collectives.items()) or "none"
        console.print(f"[bold]{name}[/]: {side.global_samples_per_s:.1f} samples/s, per step: {colls}")
    render_budget(report)
    eq = report.equivalence
    if eq is not None:
        verdict = "[green]same training step[/]" if eq.ok else "[bold red]DIFFERENT[/]"
        console.print(f"equivalence ({eq.criterion}): {verdict}: grads {'match' if eq.grads_match else 'differ'} "
                      f"(max |diff| {eq.max_abs_diff:.3g}), first loss {'equal' if eq.loss_equal else 'differs'}, "
                      f"collective counts {'unchanged' if eq.collective_counts_equal else 'CHANGED'} by the plan")


def render_budget(report: DistributedReport) -> None:
    """Each rank's planned peak against the per-device budget; a table naming the ranks over it."""
    if report.budget_bytes is None or report.plan is None:
        return
    over = report.over_budget
    if not over:
        worst = max(r.peak_bytes for r in report.plan.per_rank)
        console.print(f"per-device budget {fmt_bytes(report.budget_bytes)}: [green]every rank fits[/] "
                      f"(largest planned peak {fmt_bytes(worst)})")
        return
    table = Table(title=f"[bold red]{len(over)} of {report.world_size} ranks over the per-device budget "
                        f"{fmt_bytes(report.budget_bytes)}[/]")
    for col in ("rank", "planned peak", "budget", "over by"):
        table.add_column(col, justify="right")
    for r in over:
        table.add_row(str(r.rank), fmt_bytes(r.peak_bytes), fmt_bytes(report.budget_bytes),
                      f"{fmt_bytes(r.peak_bytes - report.budget_bytes)} ({r.peak_bytes / report.budget_bytes - 1:.1%})")
    console.print(table)


def exit_code(report: DistributedReport) -> int:
    """0 when the plan is the control's step and fits on every rank, else 1 (NOTE [exit codes])."""
    return 0 if report.passed else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distributed", help="measure the control and a plan at world size N (DDP or FSDP2)")
    add_workload_args(p)
    p.add_argument("--plan", type=Path, default=None, help="plan.json to apply on every rank (default: control only)")
    p.add_argument("--out", required=True, type=Path, help="output folder (distributed.json)")
    p.add_argument("--emit-config", type=Path, default=None, metavar="PATH",
                   help="only write the run's config to PATH and print the torchrun command of each node")
    p.add_argument("--nnodes", type=bounded_int(1, 1024), default=1,
                   help="with --emit-config: nodes the world size is split over (default 1)")
    p.add_argument("--master-addr", default=None,
                   help="with --emit-config: node 0's host name or address (default: this host's name)")
    p.add_argument("--master-port", type=bounded_int(1, 65535), default=29500,
                   help="with --emit-config: node 0's rendezvous port (default 29500)")
    add_distributed_args(p, required=True)
    p.add_argument("--budget", default=None,
                   help="per-device peak budget. ddp/fsdp2: every rank's planned peak is held to it (exit 1 over "
                        "it), bytes with a unit or a share of the plan's no-checkpoint peak (default: the plan's "
                        "budget). pipeline: the budget of the per-stage plans, bytes or a share of the largest "
                        "unplanned stage peak (default 80%%)")
    p.add_argument("--reserve", default="5%", help="pipeline engine: share of the budget kept free (default 5%%)")
    p.add_argument("--simulate", action="store_true",
                   help="pipeline engine: launch nothing; predict each stage's peak and bubble at --world-size "
                        "stages for --target-device with the simulate stage (FakeTensorMode, roofline times)")
    p.add_argument("--target-device", default="cpu", help="with --simulate: the device model (cpu, a100, h100, h200)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.engine == "pipeline":
        return run_pipeline_simulate(args) if args.simulate else run_pipeline(args)
    if args.simulate:
        raise DistributedError("--simulate applies to --engine pipeline only", tip="remat plan --simulate for one device")
    plan = Plan.load(args.plan) if args.plan is not None else None
    if args.emit_config is not None:
        return emit_config(args, plan)
    check_out_dir(args.out, ("distributed.json",))
    report = run_distributed_from_args(args, plan, args.out, budget_bytes=_budget_bytes(args, plan))
    assert report is not None
    return exit_code(report)


def emit_config(args: argparse.Namespace, plan: Plan | None) -> int:
    """Write the config (with each rank's own wall-clock limit) and print each node's complete torchrun command."""
    import shlex
    import socket
    emit = Path(args.emit_config)
    if emit.is_dir():
        raise OutputError(f"--emit-config {emit} is a folder; it names the config file to write")
    check_out_dir(emit.parent if str(emit.parent) else Path("."))
    commands = multinode_commands(emit, args.out, world_size=args.world_size, nnodes=args.nnodes,
                                  master_addr=args.master_addr or socket.gethostname(), master_port=args.master_port)
    config = config_from_args(args, plan, budget_bytes=_budget_bytes(args, plan), wall_timeout_s=args.dist_wall_timeout)
    config.save(emit)
    console.print(f"wrote {emit}; put it on every node and run there ({args.world_size} ranks = {args.nnodes} "
                  f"node(s) x {args.world_size // args.nnodes}):")
    for k, cmd in enumerate(commands):
        console.print(f"  node {k}: {shlex.join(cmd)}", highlight=False, soft_wrap=True)
    return 0


# -- --engine pipeline (the run is remat.workflow.pipeline's: NOTE [one receipt] in remat/receipt/model.py) --

def _given_plan(args: argparse.Namespace) -> PipelinePlan | None:
    """``--plan``: a per-stage plan made for this schedule, microbatch count and world size (else PlanError)."""
    from ..workflow.pipeline import check_given_plan
    path = getattr(args, "plan", None)
    if path is None:
        return None
    given = load_any_plan(path)
    if not isinstance(given, PipelinePlan):
        raise PlanError(f"{path} is a whole-model plan; --engine pipeline runs a per-stage pipeline plan",
                        tip="a pipeline plan is the plan.json that `remat distributed --engine pipeline` writes")
    check_given_plan(given, schedule=args.schedule, microbatches=args.microbatches, world_size=args.world_size,
                     source=str(path))
    return given


def _launch(args: argparse.Namespace, *, verify_only: bool = False) -> DistributedReport:
    """``--engine pipeline``: the flags as a PipelineJob, run (remat.workflow.pipeline), its tables printed."""
    from ..plan import parse_reserve
    from ..receipt.write import HTML_FILE, MD_FILE, RECEIPT_FILE
    from ..workflow.pipeline import PipelineJob, run_pipeline_job
    if getattr(args, "emit_config", None) is not None:
        raise DistributedError("--emit-config does not cover --engine pipeline yet",
                               tip="run `remat distributed --engine pipeline` on one host")
    if not getattr(args, "world_size", None):
        raise DistributedError("--engine pipeline needs --world-size N (one stage per rank, N >= 2)")
    reserve = parse_reserve(getattr(args, "reserve", "5%"))
    check_out_dir(args.out, ("pipeline.json", "plan.json", RECEIPT_FILE, HTML_FILE, MD_FILE))
    job = PipelineJob(
        spec=args.workload, shape=parse_shape(args.shape), world_size=args.world_size, schedule=args.schedule,
        microbatches=args.microbatches, out=Path(args.out), stages_per_rank=args.stages_per_rank,
        split_points=[p.strip() for p in (args.split_points or "").split(",") if p.strip()], plan=_given_plan(args),
        budget=getattr(args, "budget", None), reserve=reserve, device=args.device, dtype=args.dtype,
        steps=args.dist_steps, warmup=args.dist_warmup, timeout_s=args.dist_timeout,
        wall_timeout_s=args.dist_wall_timeout, verify_only=verify_only,
        command=" ".join(shlex.quote(a) for a in ["remat", *sys.argv[1:]]) if sys.argv else "")
    with progress_bar() as progress:
        outcome = run_pipeline_job(job, progress=progress)
    render_report(outcome.report)
    console.print(f"wrote {outcome.report_path}")
    if outcome.files is not None and outcome.receipt is not None and outcome.receipt.pipeline is not None:
        why = outcome.receipt.pipeline.why_not
        console.print(f"wrote {outcome.files.receipt}, {outcome.files.html} and {outcome.files.markdown}; re-check "
                      f"it: remat check {outcome.files.receipt}" + ("" if not why else f" (it does NOT hold: "
                                                                     f"{'; '.join(why)})"), highlight=False)
    return outcome.report


def run_pipeline(args: argparse.Namespace) -> int:
    """``remat distributed --engine pipeline``: no plan, uniform, per-stage plans side by side (or ``--plan``)."""
    result = _launch(args)
    if result.over_budget:
        console.print("[bold red]remat's per-stage plans measured over the per-device budget on "
                      + ", ".join(f"stage {k}" for k in result.over_budget_stages) + "[/]")
    return exit_code(result)


def run_pipeline_verify(args: argparse.Namespace) -> int:
    """``remat verify --engine pipeline --plan plan.json``: the planned pipeline vs the unplanned one with the same
    schedule, microbatches and split, bitwise on CPU; the negative control (a perturbed gradient) must be rejected.
    Exit 1 when they differ or the control is accepted."""
    result = _launch(args, verify_only=True)
    assert result.pipeline is not None
    eq = result.pipeline.equivalence.get(Side.REMAT)
    if eq is not None and eq.ok and result.pipeline.negative_control_rejected is True:
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
    return exit_code(result)


def _frontier_table(report: DistributedReport) -> Table:
    """Each side a point: largest stage peak vs step p50, ``*`` where no other side is as good on both."""
    from ..receipt.render import sides_of
    sides = sides_of(report)
    points = {name: (s.max_peak_bytes, s.step_ms_p50) for name, s in sides}
    budget = report.budget_bytes
    rows = []
    for name, s in sides:
        mine = points[name]
        dominated = any(o[0] <= mine[0] and o[1] <= mine[1] and o != mine for o in points.values())
        fits = "-" if budget is None else ("yes" if s.max_peak_bytes <= budget else "no")
        rows.append([name + ("" if dominated else " *"), fmt_bytes(s.max_peak_bytes), f"{s.step_ms_p50:.1f}",
                     f"{s.global_samples_per_s:.1f}", fits, f"{s.max_bubble_fraction or 0.0:.3f}"])
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
            for r in side.per_rank if (s := r.stage) is not None and (s.bubble_delta_vs_none or 0.0) > 0.0]


def render_pipeline(report: DistributedReport) -> None:
    """A pipeline run's per-stage and per-side tables and the equivalence, in pipeline.md's cells and words."""
    from ..receipt.render import SIDE_HEADERS, STAGE_HEADERS, equivalence_text, side_cells, sides_of, stage_rows
    f = report.pipeline
    assert f is not None
    title = (f"{report.spec} pipeline: {report.world_size} stages, {f.schedule.value}, {f.microbatches} "
             f"microbatches, split at {', '.join(f.split_points)} (ideal bubble "
             f"{f.ideal_bubble_fraction:.3f})")
    console.print(_table(title, STAGE_HEADERS, stage_rows(report, no="[red]no[/]")))
    console.print(_table(None, SIDE_HEADERS, [side_cells(name, side) for name, side in sides_of(report)]))
    for name, side in sides_of(report):
        worse = _bubble_growth(side)
        if worse:
            console.print(f"{name}: bubble grew over the unplanned run on {', '.join(worse)}")
    for side_name, eq in f.equivalence.items():
        verdict = "[green]bitwise equal[/]" if eq.ok else "[bold red]DIFFERENT[/]"
        console.print("equivalence: " + equivalence_text(side_name.value, eq, verdict, escape=escape))
    neg = f.negative_control_rejected
    if neg is not None:
        console.print(f"negative control (a gradient perturbed by 1e-3): {'rejected' if neg else '[bold red]ACCEPTED[/]'}")
