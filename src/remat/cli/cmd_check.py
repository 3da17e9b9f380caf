"""``remat check RECEIPT``: re-run the fixtures a receipt names; exit 1 with a list when something changed."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import CheckFailed
from ..receipt import check_receipt, load_receipt
from .render import console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="re-check a receipt: model revisions, equivalence, peak, savings")
    p.add_argument("receipt", type=Path, help="receipt.json written by remat receipt / remat demo")
    p.add_argument("--quick", action="store_true", help="revision hashes and equivalence only (fast, for every CI run)")
    p.add_argument("--workload", default=None,
                   help="workload spec to use instead of the receipt's (the receipt's is imported otherwise)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    receipt = load_receipt(args.receipt)   # ReceiptError (exit 2) before anything is imported or run
    with progress_bar() as progress:
        report = check_receipt(receipt, quick=args.quick, workload=args.workload, progress=progress)
    for line in report.checked:
        console.print(f"[green]ok[/]   {line}", highlight=False)
    for line in report.skipped:
        console.print(f"[dim]skip {line}[/]", highlight=False)
    for f in report.failures:
        where = f" [{f.boundary}]" if f.boundary else ""
        console.print(f"[bold red]FAIL[/] {f.kind}{where}: {f.message}", highlight=False)
    if not report.passed:
        raise CheckFailed(f"{len(report.failures)} check(s) failed for {args.receipt}",
                          tip="if the change is intended, re-run `remat receipt` and commit the new receipt")
    console.print(f"[bold green]receipt holds[/] ({'quick' if report.quick else 'full'} check, {report.wall_s:.0f} s): "
                  f"{args.receipt}", highlight=False)
    return 0
