#!/usr/bin/env python
"""Is remat's floor at or below every baseline's peak? (issue 14; measures peaks only, no timing)

    PYTHONPATH=src .venv/bin/python benchmarks/floor_check.py gpt mlp cnn [--zoo tv_resnet18]

Per workload (compare.py's shapes): profile, then measure, one arm alone under the CPU
live-tensor tracker, the peak of remat's ``floor`` plan and of remat's own baseline plans
(``all``, ``sqrt``, ``checkpoint_sequential:K`` for K = 2..n where the chain allows it,
``first-k:n``), and print each as a share of the control's peak.
"""

from __future__ import annotations

import sys

import torch

from remat.errors import PlanError
from remat.measure import measure_arm_peak
from remat.wrap import PlanArm
from remat.plan import make_plan
from remat.profile import profile_workload
from remat.workload import load_workload

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from compare import FULL, ZOO_SPECS  # noqa: E402

ZOO_DIR = __import__("pathlib").Path(__file__).resolve().parent / "zoo"


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    for name in argv:
        spec = ZOO_SPECS.get(name) or (str(ZOO_DIR / f"{name}.py") + ":build" if (ZOO_DIR / f"{name}.py").exists() else name)
        loaded = load_workload(spec, FULL.get(name, {}))
        report = profile_workload(loaded, measure_replays=False)
        ctrl = report.baseline_peak_bytes
        segs = [c.name for c in report.candidates if c.members]
        print(f"{name}: control {ctrl / 2**20:.1f} MiB, {len(report.candidates)} candidates ({len(segs)} segments)",
              flush=True)
        n = len([c for c in report.candidates if not c.members and c.parent is None])
        specs = ["floor", "all", "sqrt", f"first-k:{n}"] + [f"checkpoint_sequential:{k}" for k in range(2, n + 1)]
        for s in specs:
            try:
                plan = make_plan(report, s)
            except PlanError as exc:
                print(f"  {s:26s} not applicable: {exc.message[:90]}", flush=True)
                continue
            peak = measure_arm_peak(loaded, PlanArm(s, plan), warmup=1).peak_bytes
            print(f"  {s:26s} measured {peak / ctrl:6.1%}  predicted {plan.predicted_peak_bytes / ctrl:6.1%}  "
                  f"{[b.module for b in plan.boundaries]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
