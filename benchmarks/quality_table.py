#!/usr/bin/env python
"""Render issue 14's plan-quality table from compare.py JSON files (measures nothing).

    PYTHONPATH=src .venv/bin/python benchmarks/quality_table.py out1.json [out2.json ...]

Per workload and budget B (a share of the control's peak): remat's shipped plan (``remat
optimal@B``, through the closed loop) against the fastest *fitting* baseline (measured peak <= B)
of the same interleaved run: p50 ratio, overhead ratio (remat's overhead over the control /
the baseline's, when the baseline's is positive), the 95% paired bootstrap interval of the p50
difference (remat.frontier.p50_difference, NOTE [resolved differences]), predicted/measured step
time (control p50 + the plan's modelled replay ms, over the measured p50) and measured/predicted
peak. *frontier ships*: what remat's frontier decision (remat.frontier.decide, NOTE [ship
decision] and NOTE [resolved differences]) ships at B from the measured plans remat itself
makes (none, all, uniform:2, sqrt, selective, first-k@*, optimal@*; torch's checkpoint_sequential
arms are the baseline, not remat's), with its p50 ratio to the fastest fitting baseline. Per
workload also the lowest measured baseline peak and remat's measured floor plan. Geometric
means over every row with a ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from remat.frontier import FrontierPoint, decide, p50_difference
from remat.frontier.model import unresolved_why
from remat.plan.spec import PlannerSpec

REMAT_PLANS = ("none", "all", "uniform:2", "sqrt", "sac-matmuls")   # + first-k@* and remat optimal@*


def _planner(label: str) -> PlannerSpec:
    """An arm's label as a planner spec: ``sac-matmuls`` is selective, ``remat optimal@X`` is optimal@X."""
    return PlannerSpec.parse("selective" if label == "sac-matmuls" else label.removeprefix("remat "))


ship_ratios: list[float] = []


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def rows_of(w: dict) -> tuple[list[str], list[float], list[float]]:
    arms = {a["label"]: a for a in w["arms"]}
    ctrl_peak, ctrl_p50 = w["control_peak_bytes"], w["control_p50_ms"]
    lines: list[str] = []
    p50_ratios: list[float] = []
    ovh_ratios: list[float] = []
    base = [a for a in arms.values() if a["kind"] == "baseline" and a.get("p50_ms") is not None
            and a.get("peak_bytes") is not None]
    for name, limit in w["budgets"].items():
        r = arms.get(f"remat optimal@{name}")
        fits = [a for a in base if a["peak_bytes"] <= limit]
        best = min(fits, key=lambda a: a["p50_ms"], default=None)
        if r is None or r.get("p50_ms") is None:
            why = (r or {}).get("skipped") or "not run"
            lines.append(f"| {w['workload']} | {name} | {why} | | {best['label'] if best else '-'} | | | | | | |")
            continue
        pred_step = ctrl_p50 + r["extra"]["predicted_overhead_ms"]
        pred_peak = r["extra"]["predicted_peak_bytes"]
        cells = [w["workload"], name, f"{r['peak_bytes'] / ctrl_peak:.0%}", _pct(r["overhead_pct"])]
        if best is None:
            cells += ["no baseline fits", "-", "-", "-"]
        else:
            ratio = r["p50_ms"] / best["p50_ms"]
            p50_ratios.append(ratio)
            ovh = (r["overhead_pct"] / best["overhead_pct"]) if best["overhead_pct"] > 0 else None
            if ovh is not None and ovh > 0:
                ovh_ratios.append(ovh)
            d = p50_difference(r["step_ms"], best["step_ms"])
            verdict = "resolved" if d.resolved else unresolved_why(d.low_ms, d.high_ms, d.samples)
            cells += [f"{best['label']} ({best['peak_bytes'] / ctrl_peak:.0%}) {_pct(best['overhead_pct'])}",
                      f"**{ratio:.2f}**", "-" if ovh is None else f"{ovh:.2f}",
                      f"{d.diff_ms:+.0f} ms [{d.low_ms:+.0f}, {d.high_ms:+.0f}] {verdict}"]
        cells += [f"{pred_step / r['p50_ms']:.2f}", f"{r['peak_bytes'] / pred_peak:.3f}"]
        own = [FrontierPoint(plan=a["label"], planner=_planner(a["label"]), peak_bytes=a["peak_bytes"], p50_ms=a["p50_ms"],
                             step_ms=a["step_ms"], boundaries=a["boundaries"])
               for a in arms.values() if a.get("p50_ms") is not None and a.get("peak_bytes") is not None
               and (a["label"] in REMAT_PLANS or a["label"].startswith(("first-k@", "remat optimal@")))]
        _, shipped = decide(own, budget_bytes=limit, reserve=0.0)
        if shipped is None or best is None:
            cells.append("-" if shipped is None else shipped.plan)
        else:
            ship_ratios.append(shipped.p50_ms / best["p50_ms"])
            cells.append(f"{shipped.plan}: **{shipped.p50_ms / best['p50_ms']:.2f}**")
        lines.append("| " + " | ".join(cells) + " |")
    low = min(base, key=lambda a: a["peak_bytes"], default=None)
    floor = arms.get("remat floor")
    floor_txt = (f"remat floor {floor['peak_bytes'] / ctrl_peak:.0%} measured "
                 f"(predicted {floor['extra']['predicted_peak_bytes'] / ctrl_peak:.0%}; {len(floor['boundaries'])} "
                 f"boundaries)" if floor and floor.get("peak_bytes") else "remat floor not measured")
    if low is not None:
        lines.append(f"| {w['workload']} | lowest baseline peak | {low['peak_bytes'] / ctrl_peak:.0%} ({low['label']}) "
                     f"| | {floor_txt} | | | | | | |")
    return lines, p50_ratios, ovh_ratios


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Render the plan-quality table from compare.py JSON files.")
    ap.add_argument("paths", nargs="+", type=Path, help="compare.py --json outputs")
    paths = ap.parse_args(argv).paths
    for p in paths:
        if not p.is_file():
            ap.error(f"{p}: no such file")
    head = ("| workload | budget | remat peak | remat ovh | fastest fitting baseline (peak) ovh | p50 ratio | ovh ratio "
            "| remat - baseline p50, 95% CI | pred/meas step | meas/pred peak | frontier ships: p50 ratio |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    p50s: list[float] = []
    ovhs: list[float] = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        for w in data["workloads"]:
            if "error" in w:
                out.append(f"| {w['workload']} | error: {w['error'][:120]} | | | | | | | | | |")
                continue
            lines, a, b = rows_of(w)
            out += lines
            p50s += a
            ovhs += b
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")  # noqa: E731
    out.append("")
    out.append(f"Geometric mean of the p50 ratios: {gm(p50s):.2f} over {len(p50s)} rows; of the overhead ratios "
               f"(rows where both overheads are positive): {gm(ovhs):.2f} over {len(ovhs)} rows; of the frontier's "
               f"shipped plan's p50 ratios: {gm(ship_ratios):.2f} over {len(ship_ratios)} rows.")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
