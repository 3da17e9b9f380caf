"""``remat check RECEIPT``: re-run the fixtures a receipt names; exit 1 with a list when something changed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from rich.markup import escape

from ..errors import CheckFailed
from ..pipeline_parallel.check import check_pipeline_receipt
from ..workflow import check_receipt
from ..pipeline_parallel.receipt import PipelineReceipt, load_any_receipt_with_digest
from .common import MAX_THREADS, bounded_int
from .render import console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="re-check a receipt: model revisions, equivalence, peak, savings",
        description="Re-run the fixtures a receipt names on YOUR workload. The receipt is validated as plain JSON "
                    "first (a malformed or hostile file exits 2); nothing in it is executed, imported or unpickled. "
                    "The workload that runs is the one you name: --workload, else [tool.remat] workload = \"...\" "
                    "in ./pyproject.toml, else the receipt's own only when it is a built-in (gpt, cnn, mlp). The "
                    "receipt's workload is compared with it (a mismatch fails, exit 1). report.html and report.md "
                    "beside the receipt must name its sha256. A pipeline receipt (remat distributed --engine pipeline) "
                    "is re-checked by launching the unplanned and the planned pipeline at its world size.")
    p.add_argument("receipt", type=Path, help="receipt.json written by remat receipt / remat demo / remat distributed --engine pipeline")
    p.add_argument("--quick", action="store_true", help="revision hashes and equivalence only (fast, for every CI run)")
    p.add_argument("--workload", default=None,
                   help="your workload spec (default: [tool.remat] workload in ./pyproject.toml, or the receipt's "
                        "when it is a built-in); compared with the receipt's")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=None,
                   help="torch intra-op threads (default: as many as the receipt was made with)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    receipt, digest = load_any_receipt_with_digest(args.receipt)   # before anything is imported or run
    # the receipt's conditions by default (and no oversubscribed OpenMP threads on shared CI)
    torch.set_num_threads(args.threads or max(1, min(receipt.context.threads, os.cpu_count() or 1)))
    with progress_bar() as progress:
        if isinstance(receipt, PipelineReceipt):   # NOTE [pipeline receipt]: re-run at its world size
            report = check_pipeline_receipt(receipt, quick=args.quick, workload=args.workload,
                                            reports=(args.receipt.parent, digest), progress=progress)
        else:
            report = check_receipt(receipt, quick=args.quick, workload=args.workload,
                                   reports=(args.receipt.parent, digest), progress=progress)
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
