"""``remat receipt``: every stage end to end (trace, profile, plan, frontier, verify) -> DIR/receipt.json + reports."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from typing import Iterator

import torch
from rich.markup import escape

from ..errors import RematError
from ..plan import check_budget_syntax, parse_capacity, parse_reserve
from ..workflow import make_receipt
from ..receipt import Receipt, ReceiptFiles, RunSettings, ShipStatus, write_receipt
from ..receipt.write import HTML_FILE, MD_FILE, RECEIPT_FILE
from ..types import ProgressFn
from ..workload import parse_shape
from ..frontier.run import DEFAULT_COMPILED_PLANS
from ..receipt.schema import MAX_SEEDS, MAX_STEPS
from .common import (MAX_SECONDS, MAX_THREADS, add_autocast_arg, add_budget_args, add_compile_args, add_workload_args,
                     bounded_float, bounded_int, check_out_dir, out_folder, compile_from_args, load_from_args)
from .cmd_plan import add_sample_args
from .render import console, err_console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("receipt", help="run every stage end to end and publish a receipt CI can re-check")
    add_workload_args(p)
    add_autocast_arg(p)
    p.add_argument("--boundary-shape", default="",
                   help="a second shape, e.g. seq_len=128 (the longest batch of the run): traced, and its steps join "
                        "the step sample, so the plan holds at both shapes")
    add_budget_args(p, budget_needs="required unless --device-memory is given",
                    device_memory=", enforced on the CPU; a step that does not fit unplanned is planned from smaller "
                                  "batches and verified where the control fits (NOTE [blocked receipt])")
    p.add_argument("--candidates", default=None, help="comma-separated module paths, class names or regexes")
    add_run_args(p)
    g = p.add_argument_group("at a world size (torch.distributed, launched with torchrun)")
    g.add_argument("--world-size", type=bounded_int(1, 1024), default=None,
                   help="also run the shipped plan on N ranks of this host (every rank's planned peak held to the "
                        "budget less the reserve; remat check re-runs it at N) (default: one process only)")
    g.add_argument("--engine", choices=["ddp", "fsdp2"], default="ddp", help="with --world-size (default ddp)")
    g.add_argument("--dist-steps", type=bounded_int(1, 100), default=2,
                   help="timed steps per side at the world size, here and in remat check (default 2)")
    g.add_argument("--dist-timeout", type=bounded_float(0, MAX_SECONDS), default=120.0,
                   help="seconds any one collective may take (default 120)")
    p.add_argument("--out", required=True, type=out_folder, help="output folder (receipt.json, report.html, report.md)")
    p.set_defaults(func=run)


def add_run_args(p: argparse.ArgumentParser) -> None:
    d = RunSettings()
    p.add_argument("--verify-steps", type=bounded_int(1, MAX_STEPS), default=d.verify_steps, help=f"steps per paired run (default {d.verify_steps})")
    p.add_argument("--verify-seeds", type=bounded_int(1, MAX_SEEDS), default=d.verify_seeds, help=f"paired runs (default {d.verify_seeds})")
    p.add_argument("--plans", default=None,
                   help="frontier plans, as remat frontier takes them (default: "
                        + ",".join(d.frontier_plans).replace("%", "%%") + "; with --compile "
                        + ",".join(DEFAULT_COMPILED_PLANS) + ", each also compiled)")
    add_compile_args(p)
    p.add_argument("--frontier-steps", type=bounded_int(1, MAX_STEPS), default=d.frontier_steps,
                   help=f"timed warm steps per plan (default {d.frontier_steps})")
    p.add_argument("--no-capacity", action="store_true", help="skip the batch capacity search")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None, help="torch intra-op threads (default: torch's own)")
    add_sample_args(p, boundary_shape=False)
    p.add_argument("--saving-tolerance", default="10%",
                   help="how far a boundary's measured saving may fall before remat check fails (default 10%%)")


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    return RunSettings(verify_steps=args.verify_steps, verify_seeds=args.verify_seeds,
                       frontier_plans=([s.strip() for s in args.plans.split(",") if s.strip()] if args.plans is not None
                                       else list(DEFAULT_COMPILED_PLANS) if getattr(args, "compile", False)
                                       else RunSettings().frontier_plans),
                       frontier_steps=args.frontier_steps, capacity_key=None if args.no_capacity else "batch_size",
                       saving_tolerance=parse_reserve(args.saving_tolerance), sample_steps=args.sample_steps,
                       compile=None if not getattr(args, "compile", False) else compile_from_args(args).to_json())


@contextlib.contextmanager
def stage_progress(t0: float | None = None) -> Iterator[ProgressFn]:
    """rich bars (stderr) plus one kept line per finished stage, with the time since ``t0``."""
    start = t0 if t0 is not None else time.perf_counter()
    finished: set[str] = set()
    with progress_bar() as bar:
        def update(what: str, done: int, total: int) -> None:
            bar(what, done, total)
            if done >= total and what not in finished:
                finished.add(what)
                err_console.print(f"  [green]done[/] {escape(what)} [dim]({time.perf_counter() - start:.0f} s)[/]",
                                  highlight=False)
        yield update


def render_decision(receipt: Receipt, files: ReceiptFiles) -> None:
    d = receipt.decision
    color = "green" if d.status is ShipStatus.SHIP else "red"
    for i, line in enumerate(d.why):
        console.print(f"[bold {color}]{escape(line)}[/]" if i == 0 else f"  {escape(line)}", highlight=False)
    console.print(escape(f"wrote {files.receipt}, {files.html} and {files.markdown}"), highlight=False)
    console.print(escape(f"re-check it in CI: remat check {files.receipt}"), highlight=False)


def run(args: argparse.Namespace) -> int:
    reserve = parse_reserve(args.reserve)
    if args.threads is not None:   # at least 1: bounded_int
        torch.set_num_threads(args.threads)
    capacity = parse_capacity(args.device_memory) if args.device_memory is not None else None
    if args.budget is None and capacity is None:
        raise RematError("remat receipt needs --budget or --device-memory",
                         tip="pass --budget 60%, or --device-memory 2GiB to fit the device")
    if capacity is not None and args.world_size is not None:
        raise RematError("--device-memory is a capacity of one process's device; the ranks of --world-size do not "
                         "enforce it", tip="make the receipt with --device-memory alone, or --world-size with --budget")
    if args.budget is not None:
        check_budget_syntax(args.budget)  # cheap syntax checks before minutes of measuring
    settings = settings_from_args(args)
    boundary = parse_shape(args.boundary_shape) or None
    check_out_dir(args.out, (RECEIPT_FILE, HTML_FILE, MD_FILE))
    loaded = load_from_args(args)
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None
    command = " ".join(shlex.quote(a) for a in ["remat", *sys.argv[1:]]) if sys.argv else ""
    with stage_progress() as progress:
        receipt = make_receipt(loaded, budget=args.budget, reserve=reserve, boundary_shape=boundary,
                               settings=settings, candidates=candidates, command=command, boundary_in_sample=True,
                               device_memory_bytes=capacity, progress=progress)
        if args.world_size is not None:
            from ..workflow.world_size import with_world_size
            receipt = with_world_size(receipt, world_size=args.world_size, engine=args.engine,
                                      check_steps=args.dist_steps, check_timeout_s=args.dist_timeout,
                                      progress=progress)
    files = write_receipt(receipt, args.out)
    render_decision(receipt, files)
    return 0 if receipt.shipped and _holds_at_world_size(receipt) else 1


def _holds_at_world_size(receipt: Receipt) -> bool:
    """No run at a world size, or one that holds (printed when it does not)."""
    ws = receipt.world_size
    if ws is None:
        return True
    why = ws.why_not(receipt.decision.effective_budget_bytes)
    for line in why:
        console.print(f"[bold red]{escape(line)}[/]", highlight=False)
    return not why

