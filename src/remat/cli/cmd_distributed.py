"""``remat distributed``: the control and the plan at world size N (DDP or FSDP2), side by side.

``add_distributed_args`` + ``run_distributed_from_args`` are also what ``frontier`` and
``verify`` call to honour ``--world-size N [--engine ddp|fsdp2]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from .._io import atomic_write_json
from ..distributed import DistributedConfig, DistributedReport, Engine, run_distributed
from ..distributed.launch import multinode_commands
from ..plan.model import Plan
from ..workload import parse_shape
from ..errors import OutputError
from ..units import fmt_bytes
from .common import MAX_SECONDS, MAX_STEPS, MAX_WARMUP, add_workload_args, bounded_float, bounded_int, check_out_dir
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
        from ..errors import DistributedError
        # verify and frontier route --engine pipeline to cli/pipeline_parallel.py before they get here
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
        from .pipeline_parallel import run_pipeline, run_pipeline_simulate
        return run_pipeline_simulate(args) if args.simulate else run_pipeline(args)
    if args.simulate:
        from ..errors import DistributedError
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
