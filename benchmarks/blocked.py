"""Issue 40's figures: remat.auto on a step that does not fit a stated CPU capacity (NOTE [blocked step]).

For each model (tests/fixtures/blocked_models.py: the built-in GPT, the built-in ResNet with BatchNorm,
a Hugging Face Llama) and each ratio R (the unplanned step's torch.profiler peak over the capacity):

- the negative control: the unplanned step, on a copy under ``remat.CpuCapacity``, is refused;
- ``remat.auto(device_memory=capacity, verify="quick")``: its wall time, in planned-step equivalents
  (over the median planned step of the timing below), and the same for a second call without
  ``verify`` (the default) on a fresh copy;
- ``--steps`` training steps of the user's model with the plan, each under the enforced capacity and
  measured by torch.profiler: the worst over the capacity;
- step time against all-blocks checkpointing (Hugging Face's ``gradient_checkpointing_enable`` on the
  Llama; torch's ``checkpoint_wrapper`` on every block elsewhere) and against first-k (the fewest
  leading blocks that fit the same capacity, ``remat.auto(planner="first-k")``), interleaved
  ``--rounds`` times: the median ratio and its range.

    PYTHONPATH=src python benchmarks/blocked.py --ratio 1.6 --ratio 3 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.blocked_models import (SCENARIOS, Scenario, planned_peaks, train_step,  # noqa: E402
                                     unplanned_peak, unplanned_refused)

import remat  # noqa: E402


def all_blocks(s: Scenario) -> torch.nn.Module:
    """A copy with every block checkpointed, as the simple recipe does it."""
    model = copy.deepcopy(s.model)
    if s.name == "hf_llama":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    blocks = model.h if s.name == "gpt" else model.blocks
    targets = set(map(id, blocks))
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in targets)
    return model


def interleaved(s: Scenario, arms: dict[str, torch.nn.Module], rounds: int) -> dict[str, list[float]]:
    """Warm step seconds of each arm, one step each per round, in a rotating order."""
    opts = {k: s.optimizer(m) for k, m in arms.items()}
    for k, m in arms.items():
        train_step(m, opts[k], s.batch, s.loss_fn)
    times: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            train_step(arms[k], opts[k], s.batch, s.loss_fn)
            times[k].append(time.perf_counter() - t)
    return times


def run(name: str, ratio: float, steps: int, rounds: int) -> dict:
    s = SCENARIOS[name]()
    unplanned = unplanned_peak(s)
    capacity = int(unplanned / ratio)
    row: dict = {"model": name, "ratio": ratio, "unplanned_bytes": unplanned, "capacity_bytes": capacity,
                 "control_refused": unplanned_refused(s, capacity)}
    pristine = copy.deepcopy(s.model)
    t = time.perf_counter()
    try:
        handle, peaks = planned_peaks(s, capacity, steps, verify="quick")
    except remat.RematError as exc:
        row.update(refused=type(exc).__name__, message=exc.message, floor_bytes=getattr(exc, "floor_bytes", None))
        return row
    auto_s = handle.report.seconds
    r = handle.report
    planned = copy.deepcopy(pristine)
    remat.apply(planned, handle.plan)
    # first-k: the fewest leading blocks whose checkpointing fits the same capacity, measured by remat's closed loop
    first_k_model = copy.deepcopy(pristine)
    first_k = remat.auto(first_k_model, s.batch, loss_fn=s.loss_fn, optimizer=s.optimizer(first_k_model),
                         device_memory=capacity, planner="first-k", use_cache=False).plan
    # remat.auto as most calls make it (verify=None): its cost alone, on a fresh copy
    unverified_model = copy.deepcopy(pristine)
    unverified_s = remat.auto(unverified_model, s.batch, loss_fn=s.loss_fn, optimizer=s.optimizer(unverified_model),
                              device_memory=capacity, use_cache=False).report.seconds
    pristine_s = Scenario(s.name, pristine, s.batch, s.loss_fn)
    times = interleaved(pristine_s, {"remat": planned, "all_blocks": all_blocks(pristine_s),
                                     "first_k": first_k_model}, rounds)
    ratios = [a / b for a, b in zip(times["remat"], times["all_blocks"])]
    ratios_fk = [a / b for a, b in zip(times["remat"], times["first_k"])]
    row.update(auto_seconds=auto_s, wall_seconds=time.perf_counter() - t,
               step_equivalents=auto_s / statistics.median(times["remat"]),
               auto_seconds_unverified=unverified_s,
               step_equivalents_unverified=unverified_s / statistics.median(times["remat"]),
               worst_peak_over_capacity=max(peaks) / capacity, steps=len(peaks),
               boundaries=list(r.boundaries), blocked=r.blocked.describe() if r.blocked else None,
               predicted_over_measured=r.predicted_peak_bytes / (r.measured_peak_bytes or 1),
               remat_over_all_blocks_median=statistics.median(ratios),
               remat_over_all_blocks_range=[min(ratios), max(ratios)],
               remat_over_first_k_median=statistics.median(ratios_fk),
               remat_over_first_k_range=[min(ratios_fk), max(ratios_fk)],
               first_k_planner=first_k.planner.format(), first_k_boundaries=len(first_k.boundaries),
               first_k_step_ms=1000 * statistics.median(times["first_k"]),
               remat_step_ms=1000 * statistics.median(times["remat"]),
               all_blocks_step_ms=1000 * statistics.median(times["all_blocks"]))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, action="append", help="unplanned peak over the capacity (repeatable)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("models", nargs="*", default=list(SCENARIOS))
    args = ap.parse_args()
    rows = []
    for ratio in args.ratio or [1.6]:
        for name in args.models:
            row = run(name, ratio, args.steps, args.rounds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
