"""``remat check RECEIPT``: re-run the fixtures a receipt names; exit 1 with a list when something changed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from rich.markup import escape

from ..errors import CheckFailed, ReceiptError
from ..receipt import check_receipt, load_receipt
from .common import MAX_THREADS, bounded_int
from .render import console, err_console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="re-check a receipt: model revisions, equivalence, peak, savings",
        description="Re-run the fixtures a receipt names. The receipt is validated as plain JSON first (a malformed "
                    "or hostile file exits 2); nothing in it is executed or unpickled, except that its workload "
                    "spec is imported and its factory called with the recorded shape, to rebuild your training "
                    "step: that is your own code, so only check receipts from your repository. A receipt may name "
                    "a built-in, a file.py:fn inside the working directory, or a package.module:fn outside the "
                    "standard library; --workload names it yourself instead.")
    p.add_argument("receipt", type=Path, help="receipt.json written by remat receipt / remat demo")
    p.add_argument("--quick", action="store_true", help="revision hashes and equivalence only (fast, for every CI run)")
    p.add_argument("--workload", default=None,
                   help="workload spec to use instead of the receipt's (the receipt's is imported otherwise)")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None,
                   help="torch intra-op threads (default: as many as the receipt was made with)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        receipt = load_receipt(args.receipt)   # before anything is imported or run
        if args.threads is not None and args.threads < 1:
            raise ReceiptError(f"--threads must be at least 1, got {args.threads}")
        # the receipt's conditions by default (and no oversubscribed OpenMP threads on shared CI)
        torch.set_num_threads(args.threads or max(1, min(receipt.context.threads, os.cpu_count() or 1)))
        with progress_bar() as progress:
            report = check_receipt(receipt, quick=args.quick, workload=args.workload, progress=progress)
    except ReceiptError as exc:
        # printed here, escaped: the message quotes the (untrusted) receipt, and rich would
        # read "[...]" in it as markup
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        if exc.tip:
            err_console.print(f"[yellow]tip:[/] {escape(exc.tip)}", highlight=False)
        return exc.exit_code
    for line in report.checked:
        console.print(f"[green]ok[/]   {escape(line)}", highlight=False)
    for line in report.skipped:
        console.print(f"[dim]skip {escape(line)}[/]", highlight=False)
    for f in report.failures:
        where = escape(f" [{f.boundary}]") if f.boundary else ""
        console.print(f"[bold red]FAIL[/] {f.kind}{where}: {escape(f.message)}", highlight=False)
    if not report.passed:
        raise CheckFailed(f"{len(report.failures)} check(s) failed for {args.receipt}",
                          tip="if the change is intended, re-run `remat receipt` and commit the new receipt")
    console.print(f"[bold green]receipt holds[/] ({'quick' if report.quick else 'full'} check, {report.wall_s:.0f} s): "
                  f"{escape(str(args.receipt))}", highlight=False)
    return 0
