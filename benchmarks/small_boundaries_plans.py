#!/usr/bin/env python
"""optimal's plan with and without NOTE [small boundaries] (src/remat/plan/planners.py) on one profile of a
simple_race.py model, at 90/70/50% of its unplanned peak: which boundaries the rule leaves out and what that
costs in predicted added time. One profile, no measurement of the plans (that is simple_race.py's job).

    PYTHONPATH=src python benchmarks/small_boundaries_plans.py unet > benchmarks/results/small_boundaries_unet_plans.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simple_race import MODELS  # noqa: E402

from remat.plan import make_plan, planners  # noqa: E402
from remat.profile import profile_workload  # noqa: E402
from remat.workload import load_workload  # noqa: E402


def main(name: str) -> None:
    torch.set_num_threads(1)
    spec, shape = MODELS[name]
    rep = profile_workload(load_workload(spec, shape))
    for share in (0.9, 0.7, 0.5):
        budget = int(rep.baseline_peak_bytes * share)
        ruled = make_plan(rep, "optimal", budget_bytes=budget)
        share_then, planners.SMALL_BOUNDARY_PEAK_SHARE = planners.SMALL_BOUNDARY_PEAK_SHARE, 0.0   # the rule off
        try:
            unruled = make_plan(rep, "optimal", budget_bytes=budget)
        finally:
            planners.SMALL_BOUNDARY_PEAK_SHARE = share_then
        print(json.dumps(dict(
            model=name, share=share,
            rule=[f"{b.module}:{b.mode.value}" for b in ruled.boundaries], rule_ms=round(ruled.predicted_overhead_ms, 2),
            norule=[f"{b.module}:{b.mode.value}" for b in unruled.boundaries],
            norule_ms=round(unruled.predicted_overhead_ms, 2),
            small=ruled.small_boundaries.describe() if ruled.small_boundaries else None)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "unet")
