"""Single step against the step sample (NOTE [step sample]) on models whose steps differ.

For each workload: profile one step (``--sample-steps 1``) and the default sample, plan each at
the budget through the closed loop, then run 20 later training steps with each plan applied and
read each step's peak with torch.profiler's allocator events (remat.memory.reference, the
tracker's independent reference in tests/test_memory.py). Prints one line per (workload, sample):
blocks excluded as "not called", boundaries, the closed loop's measured max, and the profiler's
peaks against the budget. ``--json PATH`` writes the figures.

    PYTHONPATH=src python benchmarks/step_sample.py                      # Wav2Vec2 + the test models
    PYTHONPATH=src python benchmarks/step_sample.py --steps 20 --budget 70%
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import remat
from remat.closed_loop import plan_closed_loop
from remat.memory.reference import profiler_step_peak
from remat.plan import parse_budget
from remat.profile.model import DEFAULT_SAMPLE_STEPS, NOT_CALLED, StepSample
from remat.profile.sample import profile_sample
from remat.workload import load_workload, parse_shape
from remat.workload.contract import TrainingStep

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = [
    (f"{ROOT}/benchmarks/zoo/hf_wav2vec2_ctc.py:build", ""),
    (f"{ROOT}/tests/fixtures/dynamic_workload.py:build", "kind=layerdrop,p=0.3"),
    (f"{ROOT}/tests/fixtures/dynamic_workload.py:build", "kind=depth,p=0.3"),
]


def later_peaks(loaded, plan, steps: int) -> list[int]:
    """torch.profiler's peak (bytes) of ``steps`` training steps (indices 100..) with ``plan`` applied."""
    fresh = loaded.rebuild()
    remat.apply(fresh.workload.model, plan)
    step = TrainingStep(fresh.workload)
    step.run(0)
    return [profiler_step_peak(step, 100 + i) for i in range(steps)]


def one(spec: str, shape: str, n: int, budget: str, steps: int) -> dict:
    loaded = load_workload(spec, parse_shape(shape))
    t0 = time.perf_counter()
    sample = StepSample(steps=n)
    report = profile_sample(loaded, sample)
    not_called = sorted(k for k, why in report.excluded.items() if why == NOT_CALLED or "not called" in why)
    budget_bytes = parse_budget(budget, report.baseline_peak_bytes)
    row = {"workload": spec.rsplit("/", 1)[-1], "shape": shape, "sample_steps": n, "budget_bytes": budget_bytes,
           "not_called": not_called}
    try:
        plan = plan_closed_loop(loaded, report, "optimal", budget_bytes=budget_bytes, reserve=0.05,
                                sample=None if sample.is_single else sample).plan
    except remat.RematError as exc:
        return {**row, "error": exc.message.splitlines()[0], "seconds": time.perf_counter() - t0}
    plan_s = time.perf_counter() - t0
    try:
        peaks = later_peaks(loaded, plan, steps)
    except remat.RematError as exc:
        return {**row, "boundaries": [b.module for b in plan.boundaries], "error": f"training: {exc.message.splitlines()[0]}"}
    return {**row, "boundaries": [b.module for b in plan.boundaries], "measured_max": plan.measured_peak_bytes,
            "plan_seconds": round(plan_s, 1), "profiler_max": max(peaks), "profiler_min": min(peaks),
            "over_budget": sum(p > budget_bytes for p in peaks), "steps": steps,
            "worst_over_budget": max(peaks) / budget_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="70%")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", default=None, help="a substring of the workload specs to run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for spec, shape in WORKLOADS:
        if args.only and args.only not in spec + shape:
            continue
        for n in (1, DEFAULT_SAMPLE_STEPS):
            r = one(spec, shape, n, args.budget, args.steps)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
