"""Cost of the CPU live-tensor tracker, and its agreement with torch.profiler (issue 2).

    .venv/bin/python benchmarks/tracker_overhead.py [--steps 15] [--zoo hf_llama,tv_resnet18,...]

Plain, no-op-mode, tracked and profiled steps are interleaved on one TrainingStep so machine
drift hits them alike; the figures are median(x) / median(plain). The no-op column is a
TorchDispatchMode that only calls the op: the floor any Python dispatch mode pays. The
profiler column is a whole-step peak from torch.profiler's allocator events instead
(``profiler_step_peak``: C++ op and memory records, no Python per op), events read included.
``--zoo``: the zoo's factory files (benchmarks/zoo/NAME.py) at their default shapes instead of
the built-ins.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from remat.memory import measure_step_peak, profiler_step_peak
from remat.workload import TrainingStep, load_workload

class NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


CASES = [("gpt", {"batch_size": 8, "seq_len": 256}), ("mlp", {}), ("cnn", {})]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--zoo", default=None, help="comma-separated zoo factory names (benchmarks/zoo/NAME.py)")
    args = ap.parse_args()
    cases = CASES if args.zoo is None else [(f"benchmarks/zoo/{n}.py:build", {}) for n in args.zoo.split(",")]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, steps {args.steps}")
    print("| workload | shape | plain p50 ms | no-op mode | tracked p50 ms | tracker overhead | profiler overhead "
          "| tracker peak B | profiler peak B | tracker/profiler |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec, shape in cases:
        step = TrainingStep(load_workload(spec, shape).workload)
        for i in range(3):
            step.run(i)
        plain, noop, tracked, profiled = [], [], [], []
        peak = 0
        for i in range(args.steps):
            t0 = time.perf_counter()
            step.run(10 + i)
            plain.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            with NoopMode():
                step.run(10 + i)
            noop.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            peak = measure_step_peak(step, 10 + i).peak_bytes
            tracked.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            ref = profiler_step_peak(step, 10 + i)
            profiled.append((time.perf_counter() - t0) * 1e3)
        p, n, q, r = (statistics.median(x) for x in (plain, noop, tracked, profiled))
        print(f"| {spec.split('/')[-1]} | {shape or 'default'} | {p:.1f} | {100 * (n / p - 1):+.1f}% | {q:.1f} "
              f"| {100 * (q / p - 1):+.1f}% | {100 * (r / p - 1):+.1f}% | {peak} | {ref} | {peak / ref:.4f} |", flush=True)


if __name__ == "__main__":
    main()
