"""``remat demo``: the README's main command. A receipt, end to end, on the built-in ``gpt``.

NOTE [demo sizing]
The demo must finish in under 3 minutes on 2 shared CPU cores, so it runs the same
pipeline as ``remat receipt`` with fewer repetitions (stated in the receipt's
``settings.note``): 1 warm-up + 1 traced step per shape, 3 seeds x 2 steps of paired
verification, 6 frontier plans timed over 10 interleaved steps, 3 capacity probes per plan. The shape is
a 4-layer gpt whose unmodified step peaks at about 84 MiB (CPU live-tensor tracker,
float32), over the demo's 72 MiB budget: a plan has to checkpoint part of the model, and
checkpointing everything would be needlessly slow. torch runs one intra-op thread by
default here: on a shared 2-core machine, two OpenMP threads that lose a core to another
process spin at every barrier; ``--threads`` overrides it.

Its second act (NOTE [blocked step]) is the step people checkpoint for, one that does not fit:
the same gpt at batch 32 on a stated CPU device of 96 MiB, where its unplanned step needs about
1.8x that. The unplanned step is refused on a copy (its evidence printed), ``remat.auto`` plans
it from smaller batches, proves the plan at the largest batch where the control fits, and the
model then trains 3 steps with the plan under the enforced capacity.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from ..autoplan.unlock import describe as describe_unlock, unlock
from ..plan import parse_budget
from ..workflow import make_receipt
from ..receipt import RunSettings, write_receipt
from ..workload import load_workload
from ..receipt.write import HTML_FILE, MD_FILE, RECEIPT_FILE
from .cmd_receipt import render_decision, stage_progress
from .common import MAX_THREADS, add_timeout_arg, bounded_int, check_out_dir
from .render import console, err_console

DEMO_WORKLOAD = "gpt"
DEMO_SHAPE = {"batch_size": 8, "seq_len": 128, "n_layer": 4, "d_model": 128, "n_head": 4}
DEMO_BOUNDARY_SHAPE = {"batch_size": 16}
DEMO_BUDGET = "72MiB"
DEMO_RESERVE = 0.05
# the second act: a batch whose unplanned step needs about 1.8x the stated device (NOTE [blocked step])
DEMO_BLOCKED_SHAPE = {"batch_size": 32}
DEMO_CAPACITY = "96MiB"
DEMO_SETTINGS = RunSettings(
    trace_warmup=1, trace_steps=1, verify_steps=2, verify_seeds=3, verify_timing_steps=3,
    frontier_plans=["none", "all", "uniform:2", "selective", "optimal", "optimal@50%"],
    frontier_steps=10, frontier_warmup=1, capacity_key="batch_size", capacity_tries=3, capacity_steps=2,
    sample_steps=1,
    note="remat demo: fewer repetitions than `remat receipt` runs by default, to finish in under 3 minutes on 2 "
         "CPU cores: 1 warm-up + 1 traced step per shape (default 2 + 3), 3 seeds x 2 steps of verification "
         "(default 3 x 3), 3 timed steps of RNG-preservation overhead (default 10), 6 frontier plans with 1 "
         "warm-up round (default 8 plans, 2 rounds), 3 capacity probes per plan (default 6), 1 sampled step "
         "(default 3; the built-in gpt has no dynamic control flow)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: plan, prove and publish a receipt for the built-in gpt")
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="output folder (default out/demo)")
    p.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=1, help="torch intra-op threads (default 1, NOTE [demo sizing])")
    add_timeout_arg(p)
    p.set_defaults(func=run)


@contextlib.contextmanager
def _quiet_native_stderr(prefixes: tuple[str, ...] = ("USDT:",)) -> Iterator[None]:
    """Drop native (C++) stderr lines starting with ``prefixes`` (the profiler's start/stop
    notices); every other native line, and all Python output, passes through unchanged."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    r, w = os.pipe()
    os.dup2(w, fd)
    os.close(w)
    py_stderr = sys.stderr
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)   # Python (rich) writes bypass the filter

    def pump() -> None:
        with os.fdopen(r, "rb") as src, os.fdopen(os.dup(saved), "wb", buffering=0) as dst:
            for line in src:
                if not line.decode("utf-8", "replace").startswith(prefixes):
                    dst.write(line)

    t = threading.Thread(target=pump, name="remat-stderr-filter", daemon=True)
    t.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = py_stderr
        os.dup2(saved, fd)   # closes the pipe's write end: the pump sees EOF
        os.close(saved)
        t.join(timeout=2)


def _blocked_step(t0: float) -> None:
    """The demo's second act (NOTE [blocked step]): a batch that does not fit a stated device, unlocked."""
    shape = {**DEMO_SHAPE, **DEMO_BLOCKED_SHAPE}
    console.print()
    console.print(f"[bold]A step that does not fit[/]: the same gpt at batch_size={shape['batch_size']} on a CPU "
                  f"device of {DEMO_CAPACITY}, enforced (an allocation past it raises torch.OutOfMemoryError, as on "
                  "CUDA). remat.auto plans it from smaller batches that fit, measures the plan at the blocked batch, "
                  "and proves it where the unplanned control fits.", highlight=False)
    with _quiet_native_stderr(), stage_progress(t0) as progress:
        result = unlock(load_workload(DEMO_WORKLOAD, shape), parse_budget(DEMO_CAPACITY, 0), progress=progress)
    for line in describe_unlock(result):
        console.print("  " + line, highlight=False)


def run(args: argparse.Namespace) -> int:
    check_out_dir(args.out, (RECEIPT_FILE, HTML_FILE, MD_FILE))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    shape = ", ".join(f"{k}={v}" for k, v in DEMO_SHAPE.items())
    console.print(f"[bold]remat demo[/]: {DEMO_WORKLOAD} ({shape}), float32 on cpu, budget {DEMO_BUDGET} with a "
                  f"{DEMO_RESERVE:.0%} reserve.", highlight=False)
    console.print("Trace the step, profile each block, plan the cheapest checkpoints that fit, measure the "
                  "alternatives, prove the plan trains exactly like the original, publish a receipt.",
                  highlight=False)
    loaded = load_workload(DEMO_WORKLOAD, dict(DEMO_SHAPE))
    with _quiet_native_stderr(), stage_progress(t0) as progress:
        receipt = make_receipt(loaded, budget=DEMO_BUDGET, reserve=DEMO_RESERVE, boundary_shape=DEMO_BOUNDARY_SHAPE,
                               settings=DEMO_SETTINGS, command=f"remat demo --out {args.out}", progress=progress)
    files = write_receipt(receipt, args.out)
    console.print()
    render_decision(receipt, files)
    _blocked_step(t0)
    err_console.print(f"[dim]demo finished in {time.perf_counter() - t0:.0f} s; open {files.html} in a browser[/]",
                      highlight=False)
    return 0 if receipt.shipped else 1
