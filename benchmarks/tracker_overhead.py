"""Cost of the CPU live-tensor tracker, and its agreement with torch.profiler (issue 2).

    .venv/bin/python benchmarks/tracker_overhead.py [--steps 15]

Plain, no-op-mode and tracked steps are interleaved on one TrainingStep so machine drift
hits them alike; the figures are median(x) / median(plain). The no-op column is a
TorchDispatchMode that only calls the op: the floor any Python dispatch mode pays.
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
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, steps {args.steps}")
    print("| workload | shape | plain p50 ms | no-op mode | tracked p50 ms | tracker overhead | tracker peak B | profiler peak B | tracker/profiler |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec, shape in CASES:
        step = TrainingStep(load_workload(spec, shape).workload)
        for i in range(3):
            step.run(i)
        plain, noop, tracked = [], [], []
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
        ref = profiler_step_peak(step, 99)
        p, n, q = statistics.median(plain), statistics.median(noop), statistics.median(tracked)
        print(f"| {spec} | {shape or 'default'} | {p:.1f} | {100 * (n / p - 1):+.1f}% | {q:.1f} | {100 * (q / p - 1):+.1f}% "
              f"| {peak} | {ref} | {peak / ref:.4f} |")


if __name__ == "__main__":
    main()
