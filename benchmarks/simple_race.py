#!/usr/bin/env python
"""remat's shipped plan against the best simple eager plan that fits (issue 42's "Done when").

    PYTHONPATH=src .venv/bin/python benchmarks/simple_race.py                  # gpt2, qwen2moe, unet; 90/70/50%
    PYTHONPATH=src .venv/bin/python benchmarks/simple_race.py --models gpt2 --shares 0.7 --rounds 20 --stability 5

Per model (small configs of hold-out models nobody here wrote: HF GPT-2, HF Qwen2-MoE, a diffusers UNet):

1. The unplanned step's peak by torch.profiler (``remat.memory.profiler_step_peak``, a fresh build after one
   warm-up step); each budget is a share of it (90%, 70%, 50%).
2. remat: profile once, then ``plan_for_device(..., "optimal", race=TimeRaceSettings())`` per budget: the
   closed loop *with* its time race (NOTE [time race] in src/remat/closed_loop.py), i.e. what ``remat plan`` and
   ``remat.auto`` ship. Each budget plans on a copy of the profile (the race's calibration stays per budget).
3. The simple plans: every plan of ``all``, ``uniform:K``, ``first-k:K``, ``checkpoint_sequential:K`` (the
   baseline families, one per set of boundaries); each one's peak by torch.profiler like the unplanned
   step's; those whose peak is within the budget itself (no reserve: they get 5% more room than remat's
   plan, which must stay under budget x 0.95 by remat's own instrument) are the simple plans that fit.
4. One interleaved round-robin (NOTE [interleaved timing]) of the unplanned step, remat's shipped plan and
   every simple plan that fits, ``--rounds`` timed rounds after 2 warm-up rounds. The best simple plan is
   the fitting one of least p50 (picked on the same rounds, so the pick favours the simple side). The
   figure is remat / best simple: the median of the per-round ratios with a paired bootstrap 95% interval
   (rounds resampled, 2000 resamples, seed 0); "resolved slower" when the interval is above 1.
5. ``--stability N``: on the first model at the first share, profile and plan N more times from scratch
   (the race included) and count distinct shipped plans.

Writes benchmarks/results/simple_race.json and prints a Markdown table (pasted into benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from remat.closed_loop import TimeRaceSettings, _key, _simple_plans, plan_for_device
from remat.measure import Arm, prepare_arm, time_round_robin
from remat.memory import profiler_step_peak
from remat.plan import Plan
from remat.profile import profile_workload
from remat.workload import load_workload
from remat.wrap import PlanArm

HERE = Path(__file__).resolve().parent
ZOO = HERE / "zoo"
MODELS = {
    "gpt2": (f"{ZOO / 'hf_gpt2.py'}:build", {"batch_size": 4, "seq_len": 128, "n_layer": 4, "n_embd": 128}),
    "qwen2moe": (f"{Path(__file__).resolve()}:build_qwen2_moe", {"batch_size": 8, "seq_len": 128}),
    "unet": (f"{ZOO / 'diffusers_unet2d.py'}:build", {"batch_size": 2, "sample_size": 32}),
}


def build_qwen2_moe(batch_size: int = 8, seq_len: int = 128, *, device="cpu", dtype=torch.float32):
    """HF Qwen2-MoE, small: 4 routed experts (top 2) and a shared expert per layer, 4 layers; random init."""
    sys.path.insert(0, str(ZOO / "extra"))
    import _h
    return _h.causal("Qwen2MoeForCausalLM", "Qwen2MoeConfig", batch_size, seq_len, 1024, device, dtype,
                     hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                     shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=256)


def profiler_peak(loaded, plan: Plan | None) -> int:
    """torch.profiler's whole-step peak (bytes) of ``plan`` on a fresh build, after one warm-up step."""
    prepared = prepare_arm(loaded, PlanArm("p", plan) if plan is not None else Arm("unplanned"))
    try:
        prepared.step.run(0)
        return profiler_step_peak(prepared.step, 1)
    finally:
        prepared.close()


def bootstrap_ratio(a: list[float], b: list[float], *, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Median of a_i / b_i over paired rounds and its percentile-bootstrap 95% interval (rounds resampled)."""
    r = np.asarray(a) / np.asarray(b)
    rng = np.random.default_rng(seed)
    meds = np.median(r[rng.integers(0, r.size, size=(n, r.size))], axis=1)
    return float(np.median(r)), float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def race_one(loaded, report, share: float, unplanned_peak: int, rounds: int,
             race: TimeRaceSettings | None = None) -> dict[str, Any]:
    budget = int(unplanned_peak * share)
    load_before = os.getloadavg()   # (1, 5, 15 min): how busy the shared machine was
    started = time.strftime("%H:%M:%S", time.gmtime())
    t0 = time.perf_counter()
    shipped = plan_for_device(loaded, copy.deepcopy(report), "optimal", budget_bytes=budget, capacity_bytes=None,
                              reserve=0.05, steps=1, race=race or TimeRaceSettings()).plan
    plan_s = time.perf_counter() - t0
    shipped_peak = profiler_peak(loaded, shipped)
    simples = {}
    for p in _simple_plans(report, dict(budget_bytes=budget, reserve=0.05)):
        if _key(p) == _key(shipped):
            continue
        peak = profiler_peak(loaded, p)
        if peak <= budget:
            simples[p.planner.format()] = (p, peak)
    arms = [Arm("unplanned"), PlanArm("remat", shipped), *(PlanArm(name, p) for name, (p, _) in simples.items())]
    runners = [prepare_arm(loaded, a) for a in arms]
    try:
        t = time_round_robin(runners, warmup=2, steps=rounds)
    finally:
        for r in reversed(runners):
            r.close()
    p50 = {label: float(np.median(ms)) for label, ms in t.step_ms.items()}
    shipped_simple = shipped.time_race is not None and shipped.time_race.shipped_simple
    candidates = list(simples) + (["remat"] if shipped_simple else [])
    row: dict[str, Any] = dict(share=share, budget_bytes=budget, plan_seconds=round(plan_s, 1), shipped=shipped.planner.format(),
                               boundaries=[f"{b.module}:{b.mode.value}" for b in shipped.boundaries],
                               shipped_peak_bytes=shipped_peak, fits=shipped_peak <= budget,
                               race=shipped.time_race.describe() if shipped.time_race else None,
                               small=shipped.small_boundaries.describe() if shipped.small_boundaries else None,
                               unplanned_ms=p50["unplanned"], remat_ms=p50["remat"], simple_fitting=len(simples),
                               rounds=rounds, started_utc=started, finished_utc=time.strftime("%H:%M:%S", time.gmtime()),
                               load_before=[round(x, 2) for x in load_before],
                               load_after=[round(x, 2) for x in os.getloadavg()])
    if not candidates:
        row.update(best_simple=None)
        return row
    best = min(candidates, key=lambda name: p50[name])
    ratio, low, high = bootstrap_ratio(t.step_ms["remat"], t.step_ms[best]) if best != "remat" else (1.0, 1.0, 1.0)
    row.update(best_simple=best if best != "remat" else shipped.planner.format(), best_simple_ms=p50[best],
               best_simple_peak_bytes=simples[best][1] if best in simples else shipped_peak,
               ratio=ratio, low=low, high=high, resolved_slower=low > 1.0, resolved_faster=high < 1.0)
    return row


def stability(spec: str, shape: dict[str, Any], share: float, runs: int,
              race: TimeRaceSettings | None = None) -> dict[str, Any]:
    """Profile and plan ``runs`` times from scratch (the race included): the distinct shipped plans."""
    keys = []
    for _ in range(runs):
        loaded = load_workload(spec, shape)
        report = profile_workload(loaded)
        budget = int(report.baseline_peak_bytes * share)
        plan = plan_for_device(loaded, report, "optimal", budget_bytes=budget, capacity_bytes=None, reserve=0.05,
                               steps=1, race=race or TimeRaceSettings()).plan
        keys.append(f"{plan.planner}: " + ", ".join(f"{b.module}:{b.mode.value}" for b in plan.boundaries))
    return dict(share=share, runs=runs, distinct=len(set(keys)), plans=keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2,qwen2moe,unet")
    ap.add_argument("--shares", default="0.9,0.7,0.5")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--stability", type=int, default=0, help="extra from-scratch plans on the first model and share")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "simple_race.json")
    ap.add_argument("--race-rounds", type=int, default=None,
                    help="timed rounds of remat's own time race (default: TimeRaceSettings's, 6)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    race = TimeRaceSettings() if args.race_rounds is None else TimeRaceSettings(rounds=args.race_rounds)
    shares = [float(s) for s in args.shares.split(",")]
    out: dict[str, Any] = dict(command=" ".join(sys.argv), torch=torch.__version__, threads=1, rounds=args.rounds,
                               race_rounds=race.rounds, models={})
    ratios = []
    for name in args.models.split(","):
        spec, shape = MODELS[name]
        loaded = load_workload(spec, shape)
        unplanned = profiler_peak(loaded, None)
        report = profile_workload(loaded)
        rows = []
        for share in shares:
            try:
                row = race_one(loaded, report, share, unplanned, args.rounds, race)
            except Exception as exc:   # a benchmark row that failed says why, and the others still run
                row = dict(share=share, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            rows.append(row)
            if row.get("best_simple"):
                ratios.append(row["ratio"])
            print(json.dumps({name: row}), flush=True)
        out["models"][name] = dict(spec=spec, shape=shape, unplanned_profiler_peak_bytes=unplanned, rows=rows)
    out["geomean_ratio"] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    if args.stability:
        name = args.models.split(",")[0]
        out["stability"] = dict(model=name, **stability(*MODELS[name], shares[0], args.stability, race))
        print(json.dumps(out["stability"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(markdown(out))
    return 0


def markdown(out: dict[str, Any]) -> str:
    lines = ["| model | share | shipped (boundaries) | profiler peak / budget | best simple that fits | remat / best simple (95% CI) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, m in out["models"].items():
        for r in m["rows"]:
            if "error" in r:
                lines.append(f"| {name} | {r['share']:.0%} | failed: {r['error'][:80]} | | | | |")
                continue
            peak = f"{r['shipped_peak_bytes'] / 2**20:.2f} / {r['budget_bytes'] / 2**20:.2f} MiB"
            if not r.get("best_simple"):
                lines.append(f"| {name} | {r['share']:.0%} | {r['shipped']} ({len(r['boundaries'])}) | {peak} | none fits | | |")
                continue
            verdict = "resolved slower" if r["resolved_slower"] else "resolved faster" if r["resolved_faster"] else "tie"
            lines.append(f"| {name} | {r['share']:.0%} | {r['shipped']} ({len(r['boundaries'])}) | {peak} | {r['best_simple']} "
                         f"| {r['ratio']:.3f} ({r['low']:.3f}-{r['high']:.3f}) | {verdict} |")
    if out.get("geomean_ratio"):
        lines.append(f"\ngeometric mean of remat / best simple: {out['geomean_ratio']:.3f}")
    if "stability" in out:
        s = out["stability"]
        lines.append(f"\nstability: {s['model']} at {s['share']:.0%}, {s['runs']} from-scratch plans, {s['distinct']} distinct")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
