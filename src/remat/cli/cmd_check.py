"""``remat check RECEIPT``: re-run the fixtures a receipt names; exit 1 with a list when something changed."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import torch

from rich.markup import escape

from ..errors import CheckFailed, ReceiptError
from ..workload import parse_autocast
from ..workflow import GateSettings, ReportStamps, fixture_plan
from ..workflow.check import CheckReport
from ..workflow.check_child import check_any_receipt
from ..workflow.gate import MAX_WORLD_SIZE, NO_AUTOCAST, limit, project_gate
from ..receipt.model import load_receipt_with_digest
from .common import MAX_THREADS, beat_until_first_step, bounded_int
from .main import time_limit
from .render import console, err_console, progress_bar, untrusted


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="re-check a receipt: consistency, model revisions, equivalence, peak, savings, step time",
        description="Re-run the fixtures a receipt names on YOUR workload. The receipt is validated as plain JSON "
                    "first (a malformed or hostile file exits 2); nothing in it is executed, imported or unpickled. "
                    "The workload that runs is the one you name: --workload, else [tool.remat] workload = \"...\" "
                    "in ./pyproject.toml, else the receipt's own only when it is a built-in (gpt, cnn, mlp). The "
                    "receipt's workload is compared with it (a mismatch fails, exit 1). A receipt that contradicts "
                    "itself fails before anything runs. Budget, reserve and tolerances come from the flags below or "
                    "[tool.remat] (budget, reserve, device-memory, peak-tolerance, saving-tolerance, time-tolerance, max-seeds, "
                    "max-steps, timeout, max-world-size), never from the receipt alone; a receipt made at a world size "
                    "above max-world-size (default: the CPU cores) fails before anything launches. [tool.remat] may "
                    "pin shape = {batch_size = 32}, dtype, autocast (\"none\") and world-size: a receipt made at "
                    "anything else fails before anything runs. report.html and "
                    "report.md must be beside the receipt (unless --no-reports) and be the reports rendered from it "
                    "(check renders them again and compares). The workload runs in a child process: if it dies or exits before "
                    "reporting (os._exit, a segfault), exit 2; past --timeout it is killed with all it started: exit 4. A pipeline receipt "
                    "(remat distributed --engine pipeline) is re-checked by launching the unplanned and the planned "
                    "pipeline at its world size.")
    p.add_argument("receipt", type=Path, help="receipt.json written by remat receipt / remat demo / remat distributed --engine pipeline")
    p.add_argument("--quick", action="store_true", help="consistency, revision hashes and equivalence only (fast, for every CI run)")
    p.add_argument("--workload", default=None,
                   help="your workload spec (default: [tool.remat] workload in ./pyproject.toml, or the receipt's "
                        "when it is a built-in); compared with the receipt's")
    p.add_argument("--budget", default=None, help="the peak budget (bytes, 64MiB; default: [tool.remat] budget, else "
                                                  "the receipt's once it is consistent)")
    p.add_argument("--device-memory", default=None,
                   help="the device's capacity (2GiB), enforced on the CPU while re-running (default: [tool.remat] "
                        "device-memory, else the receipt's)")
    p.add_argument("--reserve", default=None, help="share of the budget kept free (default: [tool.remat] reserve, else the receipt's)")
    p.add_argument("--peak-tolerance", default=None, help="how far the peak may exceed the claimed one (default 5%%)")
    p.add_argument("--saving-tolerance", default=None, help="how far a boundary's saving may fall below its claim "
                                                            "(default 10%%, or the receipt's when tighter)")
    p.add_argument("--time-tolerance", default=None, help="how far the overhead may exceed the claimed one, as a share "
                                                          "of the control's step (default 10%%)")
    p.add_argument("--timeout", type=float, default=None, help="time limit for the whole check in seconds (default: "
                                                               "[tool.remat] timeout, else 3600); past it: exit 4")
    p.add_argument("--autocast", default=None, choices=["none", "bf16", "fp16", "bfloat16", "float16"],
                   help="the autocast you train with (none: without); the receipt's must be it (default: "
                        "[tool.remat] autocast, else the receipt's, under which check re-runs the step)")
    p.add_argument("--max-world-size", type=bounded_int(1, MAX_WORLD_SIZE), default=None,
                   help="the most ranks check may launch to re-run a receipt made at a world size (default: "
                        "[tool.remat] max-world-size, else this machine's CPU cores); a receipt above it fails "
                        "before anything runs")
    p.add_argument("--no-reports", action="store_true", help="do not fail when report.html / report.md are missing")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None,
                   help="torch intra-op threads (default: as many as the receipt was made with)")
    p.set_defaults(func=run)


def gate_from_args(args: argparse.Namespace) -> GateSettings:
    return GateSettings(budget=args.budget, reserve=args.reserve, device_memory=args.device_memory,
                        peak_tolerance=args.peak_tolerance,
                        saving_tolerance=args.saving_tolerance, time_tolerance=args.time_tolerance,
                        timeout_s=args.timeout, max_world_size=args.max_world_size)


def render_report(report: CheckReport) -> None:
    """Each line of the report; every string in it may come from the receipt (NOTE [printed receipt strings])."""
    for line in report.checked:
        console.print(f"[green]ok[/]   {untrusted(line)}", highlight=False)
    for line in report.skipped:
        console.print(f"[dim]skip {untrusted(line)}[/]", highlight=False)
    for f in report.failures:
        where = untrusted(f" [{f.boundary}]") if f.boundary else ""
        console.print(f"[bold red]FAIL[/] {f.kind}{where}: {untrusted(f.message)}", highlight=False)


def _check_autocast(given: str | None, receipt: object) -> None:
    """``--autocast`` names the receipt's autocast dtype ("none": the receipt's step ran without), or is left out:
    check re-runs the receipt's step as it was made (a pin: NOTE [gate pins] in workflow/gate.py)."""
    recorded = getattr(getattr(receipt, "context", None), "autocast", None)
    if given is not None and (None if given == NO_AUTOCAST else parse_autocast(given)) != recorded:
        raise ReceiptError(f"--autocast {given}, but the receipt was made "
                           + (f"under autocast {recorded}" if recorded else "without autocast"),
                           tip="re-run `remat receipt` with the autocast you train with, or drop --autocast")


def run(args: argparse.Namespace) -> int:
    gate = gate_from_args(args)
    # the alarm (NOTE [exit codes]) bounds this process's own work and a pipeline receipt's; the user's
    # workload runs in a child process stopped from here at the same limit (NOTE [workload in a child process])
    with time_limit("check", limit("timeout_s", gate, project_gate())):
        return _run(args, gate)


def _run(args: argparse.Namespace, gate: GateSettings) -> int:
    receipt, digest = load_receipt_with_digest(args.receipt)   # before anything is imported or run
    _check_autocast(args.autocast, receipt)
    # the receipt's conditions by default (and no oversubscribed OpenMP threads on shared CI)
    torch.set_num_threads(args.threads or max(1, min(receipt.context.threads, os.cpu_count() or 1)))
    reports = ReportStamps(folder=args.receipt.parent, receipt=receipt, digest=digest,
                           required=not args.no_reports)
    with progress_bar() as progress:
        first_step = threading.Event()   # the child's first step (a pipeline's runs here)
        pipeline = receipt.pipeline is not None   # NOTE [one receipt]: re-run at its world size, from here
        beat_until_first_step("check: building the workload and running its first step",
                              until=None if pipeline else first_step)
        if not pipeline:   # the user's code runs in a child process (NOTE [workload in a child process])
            err_console.print(f"check: {escape(fixture_plan(receipt, quick=args.quick).describe())}", highlight=False)
        report = check_any_receipt(receipt, path=args.receipt, digest=digest, quick=args.quick, workload=args.workload,
                                   reports=reports, gate=gate, progress=progress, on_first_step=first_step.set)
    render_report(report)
    if not report.passed:
        raise CheckFailed(f"{len(report.failures)} check(s) failed for {args.receipt}",
                          tip="if the change is intended, re-run `remat receipt` and commit the new receipt")
    console.print(f"[bold green]receipt holds[/] ({'quick' if report.quick else 'full'} check, {report.wall_s:.0f} s): "
                  f"{escape(str(args.receipt))}", highlight=False)
    return 0
