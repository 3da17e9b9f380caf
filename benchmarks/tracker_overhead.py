"""Cost of remat's CPU peak instruments, and their agreement with torch.profiler (issues 2 and 24).

    .venv/bin/python benchmarks/tracker_overhead.py [--steps 15] [--zoo hf_llama,tv_resnet18,...]

Plain, no-op-mode, tracked and profiled steps are interleaved on one TrainingStep so machine
drift hits them alike; the figures are median(x) / median(plain). The no-op column is a
TorchDispatchMode that only calls the op: the floor any Python dispatch mode pays. The
profiler column is a whole-step peak from torch.profiler's allocator events instead
(``profiler_step_peak``: C++ op and memory records, no Python per op), events read included.
The counter columns are the allocator counter (NOTE [CPU allocator counter], what
``measure_step_peak`` uses on CPU when it can be built). Once installed it stays in the process
(every CPU allocation passes through it, counted only inside a window), so it is timed in a second
phase, after the first phase's plain steps, each workload in a process of its own: "counter
overhead" is median(counted) / median(plain steps of phase 2, counter installed, interleaved with
the counted ones) - 1; "installed" is median(plain of phase 2) / median(plain of phase 1,
counter not installed) - 1. The two phases are not interleaved with each other (the counter
cannot be taken out again), so the "installed" column carries the drift between them.
``--zoo``: the zoo's factory files (benchmarks/zoo/NAME.py) at their default shapes instead of
the built-ins.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from remat.memory import LiveTensorTracker, measure_step_peak, profiler_step_peak, track_step_state
from remat.memory.allocator import ENV_VAR, counter_status
from remat.workload import TrainingStep, load_workload

class NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


CASES = [("gpt", {"batch_size": 8, "seq_len": 256}), ("mlp", {}), ("cnn", {})]


def measure_one(spec: str, shape: dict, steps: int) -> str:
    """One workload's table row: phase 1 (counter not installed), then phase 2 (installed)."""
    step = TrainingStep(load_workload(spec, shape).workload)
    for i in range(3):
        step.run(i)
    plain, noop, tracked, profiled = [], [], [], []
    peak = ref = 0
    for i in range(steps):
        t0 = time.perf_counter()
        step.run(10 + i)
        plain.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        with NoopMode():
            step.run(10 + i)
        noop.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        with LiveTensorTracker(keep_timeline=False) as tracker:
            track_step_state(tracker, step)
            step.run(10 + i, marker=tracker.mark)
        peak = tracker.peak_bytes
        tracked.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        ref = profiler_step_peak(step, 10 + i)
        profiled.append((time.perf_counter() - t0) * 1e3)
    p, n, q, r = (statistics.median(x) for x in (plain, noop, tracked, profiled))
    row = (f"| {spec.split('/')[-1].split('.')[0]} | {shape or 'default'} | {p:.1f} | {100 * (n / p - 1):+.1f}% "
           f"| {100 * (q / p - 1):+.1f}% | {100 * (r / p - 1):+.1f}% ")
    os.environ.pop(ENV_VAR, None)
    status = counter_status()   # builds (or loads) and installs the counter: phase 2
    if not status.available:
        return row + f"| n/a ({status.reason}) | | | {peak} | {ref} | |"
    plain2, counted = [], []
    cpeak = 0
    for i in range(steps):
        t0 = time.perf_counter()
        step.run(10 + i)
        plain2.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        cpeak = measure_step_peak(step, 10 + i).peak_bytes
        counted.append((time.perf_counter() - t0) * 1e3)
    c, p2 = statistics.median(counted), statistics.median(plain2)
    return row + (f"| {100 * (c / p2 - 1):+.1f}% | {100 * (p2 / p - 1):+.1f}% | {cpeak} | {peak} | {ref} "
                  f"| {peak / cpeak:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--zoo", default=None, help="comma-separated zoo factory names (benchmarks/zoo/NAME.py)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # a child process: one workload's row
    args = ap.parse_args()
    if args.one is not None:
        spec, shape = json.loads(args.one)
        print(measure_one(spec, shape, args.steps), flush=True)
        return
    cases = CASES if args.zoo is None else [(f"benchmarks/zoo/{n}.py:build", {}) for n in args.zoo.split(",")]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, steps {args.steps}")
    print("| workload | shape | plain p50 ms | no-op mode | tracker overhead | profiler overhead | counter overhead "
          "| installed | counter peak B | tracker peak B | profiler peak B | tracker/counter |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec, shape in cases:   # a process per workload: the counter, once installed, stays in its process
        out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", json.dumps([spec, shape])],
                             capture_output=True, text=True)
        rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
        print(rows[-1] if rows and out.returncode == 0 else f"| {spec} | failed: {out.stderr.strip()[-300:]} |",
              flush=True)


if __name__ == "__main__":
    main()
