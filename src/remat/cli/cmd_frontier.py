"""``remat frontier``: peak vs warm step time for a set of plans, batch capacity, Pareto set, ship decision."""

from __future__ import annotations

import argparse

from rich import box
from rich.markup import escape
from rich.table import Table

from .._io import atomic_write_bytes, atomic_write_json
from ..errors import RematError
from ..frontier import (DEFAULT_PLANS, Decision, FrontierPoint, FrontierReport, FrontierSettings, parse_plan_requests,
                        render_frontier_png, run_frontier, short_overhead)
from ..memory.capacity import step_capacity
from ..plan import budget_on_device, check_budget_syntax, parse_capacity, parse_reserve
from ..profile.blocked import profile_on_device
from ..profile.model import StepSample
from ..units import fmt_bytes
from .cmd_distributed import add_distributed_args, run_distributed_from_args
from ..receipt.schema import MAX_STEPS, MAX_TRIES, MAX_WARMUP
from .common import (add_autocast_arg, add_budget_args, add_compile_args, add_workload_args, bounded_int,
                     check_out_dir, out_folder, compile_from_args, load_from_args, refuse_autocast_with)
from .render import console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("frontier", help="measure peak vs step time for several plans, capacity, and which to ship")
    add_workload_args(p)
    add_autocast_arg(p)
    add_budget_args(p, budget_needs="required unless --device-memory is given",
                    device_memory=", enforced on the CPU; each plan's capacity is then what it unlocks on this device "
                                  "(NOTE [blocked step])")
    p.add_argument("--plans", default=None,
                   help="comma-separated planner specs; planner@X plans at budget X (default: "
                        + ",".join(DEFAULT_PLANS).replace("%", "%%") + "; the control 'none' is always measured)")
    p.add_argument("--steps", type=bounded_int(1, MAX_STEPS), default=10, help="timed warm steps per plan, interleaved (default 10)")
    p.add_argument("--warmup", type=bounded_int(1, MAX_WARMUP), default=2, help="untimed warm-up rounds (default 2)")
    p.add_argument("--capacity-key", default="batch_size",
                   help="shape keyword whose largest fitting value is searched (default batch_size; e.g. seq_len)")
    p.add_argument("--no-capacity", action="store_true", help="skip the capacity search")
    p.add_argument("--capacity-max", type=bounded_int(1, 2 ** 31), default=None, help="largest value tried (default 64x the current one)")
    p.add_argument("--capacity-tries", type=bounded_int(1, MAX_TRIES), default=8, help="most probes per plan (default 8)")
    p.add_argument("--capacity-steps", type=bounded_int(1, MAX_STEPS), default=3, help="timed steps per plan at its capacity (default 3)")
    p.add_argument("--capacity-granularity", type=bounded_int(1, 2 ** 31), default=1,
                   help="stop bisecting when the bracket is this narrow (default 1: the exact value)")
    p.add_argument("--out", required=True, type=out_folder, help="output folder (frontier.json, frontier.png)")
    add_compile_args(p)
    p.add_argument("--budget-tries", type=bounded_int(1, 20), default=6,
                   help="with --compile: most recompiles spent aiming torch's activation_memory_budget at the "
                        "budget (default 6)")
    add_distributed_args(p)
    p.set_defaults(func=run)


_STYLE = {Decision.SHIP: "bold green", Decision.INFEASIBLE: "dim", Decision.FAILED: "red"}


def _point_row(p: FrontierPoint, budget_bytes: int) -> tuple[str, ...]:
    """One table row: plan, peak MiB, p50/p95 ms, overhead, capacity (+: not resolved), samples/s, decision."""
    cap = p.capacity_text(budget_bytes)
    decision = p.decision.value + (" *" if p.pareto else "")
    style = _STYLE.get(p.decision, "")
    return (p.plan, "-" if p.peak_bytes is None else f"{p.peak_bytes / 2**20:.2f}",
            "-" if p.p50_ms is None else f"{p.p50_ms:.1f}/{p.p95_ms:.1f}",
            short_overhead(p.overhead_pct, p.overhead_interval), cap,
            "-" if p.samples_per_s is None else f"{p.samples_per_s:.1f}",
            f"[{style}]{decision}[/]" if style else decision)


def _points_table(report: FrontierReport) -> Table:
    key = report.capacity_key or "capacity"
    table = Table(title=f"frontier: {report.context.get('workload')} {report.context.get('shape') or ''}",
                  box=box.SIMPLE_HEAD, pad_edge=False, caption=f"cap = largest {key} whose peak fits; samples/s at cap; ovh = p50 vs control; "
                          "* = on the Pareto set (peak vs p50)")
    for col in ("plan", "peak MiB", "p50/p95 ms", "ovh", "cap", "samples/s", "decision"):
        table.add_column(col, justify="left" if col in ("plan", "decision") else "right", no_wrap=True)
    for p in report.points:
        table.add_row(*_point_row(p, report.budget_bytes))
    return table


def _how_measured(report: FrontierReport) -> str:
    """The budget line: effective budget, the peaks' instrument, how the steps were timed."""
    return (f"budget {fmt_bytes(report.budget_bytes)} less {report.reserve:.0%} reserve = "
            f"{fmt_bytes(report.effective_budget_bytes)}; peaks from {report.context.get('memory_source')}; "
            f"times: {report.context.get('steps')} warm steps per plan, "
            + ("interleaved round-robin" if report.context.get("interleaved", True)
               else "each plan alone (interleaved builds ran out of device memory)"))


def _budget_search_line(report: FrontierReport) -> str:
    tries = "; ".join(f"{t.ratio:g} -> " + ("failed" if t.peak_bytes is None else
                                              f"{t.peak_bytes / 2**20:.2f} MiB{' fits' if t.fits else ''}")
                      for t in report.budget_search)
    return f"torch activation_memory_budget aimed at {fmt_bytes(report.effective_budget_bytes)}: {tries}"


def _print_decisions(report: FrontierReport) -> None:
    """Every point not shipped with its reason, then the shipped one (or that nothing ships)."""
    for p in report.points:
        if p.decision is not Decision.SHIP:
            console.print(escape(f"  {p.plan}: {p.decision.value}: {p.reason}"), highlight=False)
    shipped = report.shipped
    if shipped is not None:
        console.print(f"[bold green]ship {escape(shipped.plan)}[/]: {escape(shipped.reason)}", highlight=False)
    else:
        console.print("[bold red]no measured plan clears the budget with the reserve[/]")


def render_frontier(report: FrontierReport) -> None:
    console.print(_points_table(report))
    preds = [f"{p.plan} {p.predicted_step_ms:.1f}/{p.p50_ms:.1f} ms ({p.step_prediction_ratio:.2f})"
             for p in report.points if p.step_prediction_ratio is not None and p.plan != report.control]
    if preds:
        console.print("predicted/measured step time (control p50 + modelled replay): " + "; ".join(preds))
    console.print(_how_measured(report))
    if report.budget_search:
        console.print(_budget_search_line(report), highlight=False)
    if report.context.get("compiled_peaks"):
        console.print(str(report.context["compiled_peaks"]), highlight=False)
    _print_decisions(report)


def _checked_flags(args: argparse.Namespace, capacity: int | None) -> float:
    """Cheap checks first, a typo should not cost minutes of profiling: the reserve, else a usage error."""
    reserve = parse_reserve(args.reserve)
    if args.budget is not None:
        check_budget_syntax(args.budget)
    if capacity is not None and args.budget is not None and not str(args.budget).strip().endswith("%"):
        budget_on_device(args.budget, 0, capacity)   # an amount above the device: refused before profiling
    parse_plan_requests(args.plans)   # the counts are at least 1 already (bounded_int)
    return reserve


def run(args: argparse.Namespace) -> int:
    capacity = parse_capacity(args.device_memory) if args.device_memory is not None else None
    if args.budget is None and (capacity is None or args.engine == "pipeline"):
        raise RematError("remat frontier needs --budget" + ("" if args.engine != "pipeline" else
                                                             " with --engine pipeline"),
                         tip="pass --budget 60%, or --device-memory 2GiB to fit the device")
    if args.engine == "pipeline":   # the pipeline's points: no plan, uniform, per-stage plans at --budget
        from .cmd_distributed import run_pipeline_frontier
        refuse_autocast_with(args, "--engine pipeline", "the pipeline engine runs the workload's step as it is")
        return run_pipeline_frontier(args)
    if getattr(args, "world_size", None):
        refuse_autocast_with(args, "--world-size", "the distributed run does not run the step under autocast")
    reserve = _checked_flags(args, capacity)
    check_out_dir(args.out, ("frontier.json", "frontier.png", "distributed.json"))
    loaded = load_from_args(args)
    # NOTE [device capacity]: on the CPU every step runs under the stated capacity, enforced
    with progress_bar() as progress, step_capacity(capacity if args.device == "cpu" else None):
        report, _ = profile_on_device(loaded, StepSample.of(1, []), capacity_bytes=capacity,
                                      batch_key=args.capacity_key, progress=progress)
        budget = budget_on_device(args.budget, report.baseline_peak_bytes, capacity)
        assert budget is not None
        settings = FrontierSettings(
            budget_bytes=budget, reserve=reserve, plans=args.plans, steps=args.steps, warmup=args.warmup,
            capacity_key=None if args.no_capacity else args.capacity_key, capacity_max=args.capacity_max,
            capacity_tries=args.capacity_tries, capacity_steps=args.capacity_steps,
            capacity_granularity=args.capacity_granularity, compile=compile_from_args(args),
            budget_tries=args.budget_tries)
        frontier = run_frontier(loaded, settings, report=report, progress=progress)
    png = render_frontier_png(frontier)
    atomic_write_json(args.out / "frontier.json", frontier.to_json())
    atomic_write_bytes(args.out / "frontier.png", png)
    render_frontier(frontier)
    console.print(f"wrote {args.out / 'frontier.json'} and {args.out / 'frontier.png'}")
    if frontier.shipped is None:
        return 1
    # --world-size N: the shipped plan against the control on N ranks (distributed.json)
    if getattr(args, "world_size", None):
        shipped = frontier.shipped_plan
        dist = run_distributed_from_args(args, shipped, args.out)
        if dist is not None and not dist.passed:   # not the control's step, or a rank over the plan's budget
            return 1
    return 0
