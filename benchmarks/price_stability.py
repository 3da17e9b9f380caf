#!/usr/bin/env python
"""Do two profiles of one step give the same plan? NOTE [prices from counts] (src/remat/profile/prices.py) against
the rule before it (each replay's timed price, snapped: NOTE [stable prices]), on the same profiles.

Profiles a simple_race.py model ``--profiles`` times from scratch. Each profile is priced both ways: as remat
prices it (counted: a factor times each candidate's recorded work) and with the work dropped (timed). Prints, per
rule, how many distinct ``optimal`` plans the profiles give at 90/70/50% of the unplanned peak, and how far the
timed prices of each (candidate, mode) moved between profiles (max / min over the profiles).

    PYTHONPATH=src python benchmarks/price_stability.py unet --profiles 3 > benchmarks/results/price_stability_unet.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simple_race import MODELS  # noqa: E402

import remat.profile.step as profile_step  # noqa: E402
from remat.plan import make_plan  # noqa: E402
from remat.profile import profile_workload  # noqa: E402
from remat.profile.prices import sane_replay_prices  # noqa: E402
from remat.workload import load_workload  # noqa: E402

SHARES = (0.9, 0.7, 0.5)


def one_profile(name: str):
    """(counted report, timed report): one profile, priced both ways."""
    before = {}

    def capture(report):   # the profile's measured prices, before either rule
        before["report"] = copy.deepcopy(report)
        sane_replay_prices(report)
    profile_step.sane_replay_prices = capture
    try:
        spec, shape = MODELS[name]
        counted = profile_workload(load_workload(spec, shape))
    finally:
        profile_step.sane_replay_prices = sane_replay_prices
    raw = before["report"]
    timed = copy.deepcopy(raw)
    for c in timed.candidates:
        c.replay_work = {}
    sane_replay_prices(timed)
    return counted, timed, raw


def plan_key(report, share: float) -> str:
    p = make_plan(report, "optimal", budget_bytes=int(report.baseline_peak_bytes * share))
    return ", ".join(f"{b.module}:{b.mode.value}" for b in p.boundaries)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--profiles", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = []
    for i in range(args.profiles):
        t0 = time.time()
        counted, timed, raw = one_profile(args.model)
        runs.append(dict(counted={s: plan_key(counted, s) for s in SHARES}, timed={s: plan_key(timed, s) for s in SHARES},
                         raw={f"{c.name}:{m.value}": ms for c in raw.candidates for m, ms in c.replay_ms.items()
                              if m.value != "keep" and m in c.replay_spread_ms},
                         factor=counted.replay_calibration,
                         seconds=round(time.time() - t0, 1), load=os.getloadavg()[0]))
        print(json.dumps(dict(profile=i, seconds=runs[-1]["seconds"], load=runs[-1]["load"])), file=sys.stderr, flush=True)
    arms = set.intersection(*(set(r["raw"]) for r in runs))
    moved = sorted(max(r["raw"][a] for r in runs) / min(r["raw"][a] for r in runs) for a in arms
                   if min(r["raw"][a] for r in runs) > 0)
    out = dict(command=" ".join(sys.argv), model=args.model, profiles=args.profiles,
               distinct={rule: {f"{s:.0%}": len({r[rule][s] for r in runs}) for s in SHARES} for rule in ("counted", "timed")},
               timed_price_moves=dict(arms=len(moved), moved_over_10pct=sum(m > 1.1 for m in moved),
                                      median=round(statistics.median(moved), 3),
                                      p90=round(moved[int(0.9 * (len(moved) - 1))], 3), max=round(moved[-1], 3)),
               factors=[r["factor"] for r in runs], seconds=[r["seconds"] for r in runs], loads=[r["load"] for r in runs],
               plans=[dict(counted=r["counted"], timed=r["timed"]) for r in runs])
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
