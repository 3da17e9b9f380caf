"""``remat verify``: paired control vs planned runs, hazards, negative controls -> DIR/verify.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from .._io import atomic_write_json
from ..wrap import load_plan
from ..verify import VerifyReport, verify_plan
from .cmd_distributed import add_distributed_args, run_distributed_from_args
from ..receipt.schema import MAX_SEEDS, MAX_STEPS
from .common import (WORKLOAD_DEFAULTS, add_autocast_arg, add_compile_args, add_workload_args,
                     bounded_int, check_out_dir, out_folder, compile_from_args, fill_from_plan, load_from_args, refuse_autocast_with)
from .render import console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove the planned step trains exactly like the unmodified one")
    add_workload_args(p, from_plan=True)
    add_autocast_arg(p, from_plan=True)
    p.add_argument("--plan", required=True, type=Path,
                   help="plan.json from `remat plan` (with --engine pipeline: from `remat distributed --engine pipeline`)")
    p.add_argument("--steps", type=bounded_int(1, MAX_STEPS), default=3, help="training steps per paired run (default 3)")
    p.add_argument("--seeds", type=bounded_int(1, MAX_SEEDS), default=3, help="paired runs with seeds 0..N-1 (default 3)")
    p.add_argument("--timing-steps", type=bounded_int(0, MAX_STEPS), default=10,
                   help="timed steps per variant for the RNG preservation overhead (default 10, 0 to skip)")
    p.add_argument("--out", required=True, type=out_folder, help="output folder")
    add_compile_args(p)
    add_distributed_args(p)
    p.set_defaults(func=run)


def _fmt(x: float | None) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.2e}")


def _steps_table(report: VerifyReport) -> Table:
    """One row per compared step: loss, its difference, gradient errors, bitwise, result."""
    table = Table(title=f"verify {report.workload} ({report.planner} plan, {report.dtype})")
    for col in ("seed", "step", "mode", "loss", "|dloss|", "grad abs err", "grad rel err", "bitwise", "result"):
        table.add_column(col, justify="left" if col in ("mode", "result") else "right")
    for s in report.per_step:
        table.add_row(str(s.seed), str(s.step), s.mode, f"{s.loss[0]:.5f}", _fmt(abs(s.loss[1] - s.loss[0])),
                      _fmt(s.grad_max_abs), _fmt(s.grad_max_rel), "yes" if s.bitwise else "no",
                      "[green]ok[/]" if s.passed else "[bold red]DIFF[/]")
    return table


def _print_first_difference(report: VerifyReport) -> None:
    first_bad = next((s for s in report.per_step if not s.passed), None)
    if first_bad is not None:
        console.print(f"first difference: seed {first_bad.seed} step {first_bad.step} ({first_bad.mode}) in "
                      f"[bold]{first_bad.first_divergent_module or '-'}[/] ({first_bad.first_divergence}): "
                      f"{', '.join(first_bad.divergent[:4])}", highlight=False)


def _print_boundaries(report: VerifyReport) -> None:
    """Each boundary's forward and replay calls per step, per mode."""
    for b in report.boundaries:
        calls = ", ".join(f"{m} {b.forward_calls[m]} forward + {b.replay_calls.get(m, 0)} replay"
                          for m in b.forward_calls)
        console.print(f"  {b.module} ({b.mode.value}{', guarded' if b.guarded else ''}): {calls} per step"
                      f"{'; draws RNG' if b.draws_rng else ''}", highlight=False)


def _print_rng_policy(report: VerifyReport) -> None:
    pol, t = report.rng_policy, report.rng_timing
    timing = "" if t is None else (
        f"; preservation costs {t.overhead_ms:+.2f} ms/step "
        f"(p50 {t.with_ms:.2f} vs {t.without_ms:.2f} ms over {t.steps} warm steps each)")
    console.print(f"RNG policy: [bold]{pol.policy}[/] ({pol.justification}){timing}", highlight=False)


def _print_findings(report: VerifyReport, max_lines: int) -> None:
    """Negative controls, the first ``max_lines`` hazards, warnings."""
    for n in report.negative_controls:
        state = ("[green]rejected[/]" if n.rejected else "[bold red]NOT rejected[/]") if n.applicable else "n/a"
        console.print(f"negative control {n.name}: {state} ({n.detail})", highlight=False)
    for h in report.hazards[:max_lines]:
        console.print(f"[bold red]hazard[/] {h.module} ({h.kind.value}, {h.mode}): {h.detail}", highlight=False)
    if len(report.hazards) > max_lines:
        console.print(f"... and {len(report.hazards) - max_lines} more hazards in verify.json")
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)


def _print_verdict(report: VerifyReport) -> None:
    if not report.passed:
        console.print(f"[bold red]FAILED[/]: first divergent module {report.first_divergent_module or '-'}")
        return
    if report.compile is not None:
        console.print("compiled: control = the compiled unplanned step; tolerances "
                      + ", ".join(f"{k} rtol {v.rtol:g}" for k, v in report.tolerances.items()), highlight=False)
    if report.autocast is not None:
        tol = report.tolerances.get(report.dtype)
        console.print(f"autocast: both sides' forward under torch.autocast({report.autocast}); {report.dtype} tensors "
                      f"compared at rtol {tol.rtol:g}, atol {tol.atol:g}, the autocast dtype's"
                      if tol else f"autocast: both sides' forward under torch.autocast({report.autocast})", highlight=False)
    console.print("[bold green]PASSED[/]: the planned step is the same training procedure as the control")


def render_report(report: VerifyReport, max_lines: int = 12) -> None:
    console.print(_steps_table(report))
    _print_first_difference(report)
    _print_boundaries(report)
    _print_rng_policy(report)
    _print_findings(report, max_lines)
    _print_verdict(report)


def run(args: argparse.Namespace) -> int:
    if args.engine == "pipeline":   # per-stage plans: the planned pipeline vs the unplanned one, bitwise
        from .cmd_distributed import run_pipeline_verify
        refuse_autocast_with(args, "--engine pipeline", "the pipeline engine runs the workload's step as it is")
        for name, value in WORKLOAD_DEFAULTS.items():
            setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
        return run_pipeline_verify(args)
    plan = load_plan(args.plan)  # bad plan -> PlanError, exit 2, before building anything
    fill_from_plan(args, plan.workload)   # NOTE [plan workload]: what the plan was made for, unless given
    if args.world_size:
        refuse_autocast_with(args, "--world-size", "the distributed run does not run the step under autocast")
    check_out_dir(args.out, ("verify.json", "distributed.json"))
    loaded = load_from_args(args)
    with progress_bar() as progress:
        report = verify_plan(loaded, plan, steps=args.steps, seeds=args.seeds, timing_steps=args.timing_steps,
                             compile=compile_from_args(args), progress=progress)
    out = atomic_write_json(args.out / "verify.json", report.to_json())
    render_report(report)
    console.print(f"wrote {out}")
    report.raise_if_failed()  # VerificationFailed: exit 1
    # --world-size N: the same plan against the same unplanned engine configuration, on N ranks
    dist = run_distributed_from_args(args, plan, args.out)
    if dist is not None and not dist.passed:   # not the control's step, or a rank over the plan's budget
        console.print(f"[bold red]the distributed check failed at world size {dist.world_size}[/]")
        return 1
    return 0
