"""torch.profiler's peak of a receipt's shipped plan over later training steps (issue 28's zoo column).

    .venv/bin/python benchmarks/zoo/profiler_peak.py OUT/<model>/receipt/receipt.json \
        --workload benchmarks/zoo/hf_gpt2.py:build [--shape k=v,...] [--steps 5] [--json FILE]

The receipt's own peaks come from remat's CPU live-tensor tracker at the sampled steps. This
re-measures the *shipped* plan with an independent instrument (torch.profiler's allocator events,
``remat.memory.profiler_step_peak``) on steps the planner never saw: a fresh build, the plan
applied by name, 2 warm-up steps, then ``--steps`` steps at indices 2, 3, ... (each a new batch and
seed under the workload contract). The figure is the max over those steps; "within" compares it
with the budget the user asked for (not the reserve-lowered effective budget).

Prints one JSON object (and writes it to ``--json``): peaks per step (bytes), the max, the budget and
the effective budget from the receipt, and whether the max is within each. Exit 0 when it measured
(whatever the verdict), 2 when the receipt ships no plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WARMUP = 2   # steps before the first measured one: the optimizer state exists from step 1 on


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("receipt", type=Path)
    ap.add_argument("--workload", required=True, help="the workload spec the receipt was made on")
    ap.add_argument("--shape", default="", help="its shape keywords, as given to remat receipt")
    ap.add_argument("--steps", type=int, default=5, help="measured steps after the warm-up (default 5)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args(argv)

    from remat.measure.run import prepare_arm, warm_up
    from remat.memory import profiler_step_peak
    from remat.receipt.model import Receipt
    from remat.wrap.arm import PlanArm
    from remat.workload.loader import load_workload, parse_shape

    receipt = Receipt.load(args.receipt)
    plan = receipt.plan.plan
    d = receipt.decision
    if plan is None or str(d.status) != "ship":
        print(json.dumps({"error": "the receipt ships no plan"}))
        return 2
    loaded = load_workload(args.workload, parse_shape(args.shape))
    prepared = prepare_arm(loaded, PlanArm("shipped", plan))
    try:
        nxt = warm_up(prepared.step, WARMUP)
        peaks = [profiler_step_peak(prepared.step, nxt + i) for i in range(args.steps)]
    finally:
        prepared.close()
    budget, effective = d.budget_bytes, d.effective_budget_bytes
    out = {"instrument": "torch.profiler allocator events (remat.memory.profiler_step_peak)",
           "plan": plan.planner.format(), "boundaries": len(plan.boundaries), "step_indices": [nxt + i for i in range(args.steps)],
           "peaks_bytes": peaks, "max_peak_bytes": max(peaks), "budget_bytes": budget,
           "effective_budget_bytes": effective, "receipt_shipped_peak_bytes": d.shipped_peak_bytes,
           "within_budget": None if budget is None else max(peaks) <= budget,
           "within_effective_budget": None if effective is None else max(peaks) <= effective}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
