"""Simulated vs measured peak and step time on a CUDA GPU (issue 8).

For the built-in ``gpt`` at two shapes: the simulated trace (``remat.simulate``, FakeTensorMode,
device model picked from the GPU's name) against the same step run for real on the GPU
(peak: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; time: warm p50
over 10 steps, ``torch.cuda.synchronize`` before each clock read). Prints a Markdown table
for benchmarks/RESULTS.md. Exits 0 with a message where CUDA is not available.

    python benchmarks/gpu_simulate_check.py [--dtype bfloat16] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = [  # (label, shape): GPT-2 small-ish and a deeper, longer one; both fit a 40 GB+ GPU without checkpointing
    ("gpt 12x768 B8 T1024", dict(batch_size=8, seq_len=1024, n_layer=12, d_model=768, n_head=12, vocab=50304)),
    ("gpt 24x1024 B4 T2048", dict(batch_size=4, seq_len=2048, n_layer=24, d_model=1024, n_head=16, vocab=50304)),
]


def device_model_name() -> str:
    name = torch.cuda.get_device_name().upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return key.lower()
    return "h100"  # unknown part: compare against the H100 model and say so in the table


def measure(shape: dict, dtype: str, steps: int) -> tuple[int, float, float]:
    """(peak bytes, p50 ms, p95 ms) of the real step on cuda."""
    from remat.memory import read_cuda_stats, reset_cuda_peak
    from remat.workload import TrainingStep, load_workload
    step = TrainingStep(load_workload("gpt", shape, device="cuda", dtype=dtype).workload)
    for i in range(2):  # optimizer state exists after the first step
        step.run(i)
    reset_cuda_peak()
    step.run(2)
    peak = read_cuda_stats().peak_bytes
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step.run(3 + i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    del step
    torch.cuda.empty_cache()
    q = statistics.quantiles(times, n=20)
    return peak, statistics.median(times), q[18]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_simulate_check: no CUDA device here (torch.cuda.is_available() is False); nothing measured.")
        return 0
    from remat.simulate import simulate_workload
    model = device_model_name()
    gib = 2**30
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {args.dtype}, device model {model}\n")
    print("| shape | simulated peak | measured peak | sim/measured | predicted step (roofline) | measured p50 (p95) "
          "| measured/predicted (calibration) | simulation wall |")
    print("|---|---|---|---|---|---|---|---|")
    for label, shape in SHAPES:
        sim = simulate_workload("gpt", shape, dtype=args.dtype, target_device=model)
        peak, p50, p95 = measure(shape, args.dtype, args.steps)
        print(f"| {label} | {sim.trace.peak_bytes / gib:.2f} GiB | {peak / gib:.2f} GiB | "
              f"{sim.trace.peak_bytes / peak:.3f} | {sim.runtime.step_ms:.1f} ms | {p50:.1f} ms ({p95:.1f}) | "
              f"{p50 / sim.runtime.step_ms:.2f} | {sim.wall_s:.1f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
