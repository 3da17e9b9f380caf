#!/usr/bin/env python
"""remat vs torch.compile's budget, side by side, on the hold-out zoo models (issue 42 item 4).

    PYTHONPATH=src .venv/bin/python benchmarks/compile_table.py                 # gpt2, qwen2moe, unet at 70/50%
    PYTHONPATH=src .venv/bin/python benchmarks/compile_table.py --smoke         # tiny gpt2 + qwen2moe, 50%, no RESULTS.md
    PYTHONPATH=src .venv/bin/python benchmarks/compile_table.py --render a.json,b.json   # runs made side by side, one table

The models and their small configs are simple_race.py's (``MODELS``: HF GPT-2, HF Qwen2-MoE, a diffusers
UNet). Per model: the unplanned eager step's peak by torch.profiler (``simple_race.profiler_peak``), and
per share of it one ``compile_check.one`` (one ``run_frontier(..., compile=CompileSpec())``: eager none and
optimal, their compiled twins, torch's ``activation_memory_budget`` bisected to the same peak, all timed in
ONE interleaved round-robin; NOTE [budget aimed at a peak], NOTE [compiled closed loop]). The table cell per
(model, share):

  none+compile      the compiled unplanned step: its p50 (the reference of every ratio)
  torch budget@R    R found, its compiled peak (torch.profiler's CPU allocator events), p50 ratio
  remat compiled    optimal+compile: its peak (same instrument), p50 ratio, boundaries
  eager optimal     for reference: its peak by torch.profiler on a fresh build, p50 ratio

Ratios: the median over the interleaved rounds of arm_i / (none+compile)_i, with a paired percentile
bootstrap 95% interval (``simple_race.bootstrap_ratio``). A model that fails to build or compile is a row
that says so with its error. Writes benchmarks/results/compile_table.json and the RESULTS.md block
between ``<!-- compile-table -->`` markers.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")   # a 2-core CPU box (compile_check.py's rule)

import compile_check  # noqa: E402
import simple_race  # noqa: E402
import torch  # noqa: E402

from remat.profile import profile_workload  # noqa: E402
from remat.workload import load_workload  # noqa: E402

MIB = 2 ** 20
# --smoke: the same three models, tiny (a GPT-2 and a Qwen2-MoE of 1 layer, a UNet on 16x16 latents)
SMOKE = {
    "gpt2": {"batch_size": 2, "seq_len": 32, "n_layer": 1, "n_embd": 64},
    "qwen2moe": {"batch_size": 2, "seq_len": 32},
    "unet": {"batch_size": 1, "sample_size": 16},
}


def _ratio(p: dict | None, ctrl: dict | None) -> dict | None:
    """``p``'s paired p50 ratio to the compiled control over the interleaved rounds, with its 95% interval."""
    if p is None or ctrl is None or not p.get("step_ms") or len(p["step_ms"]) != len(ctrl.get("step_ms") or []):
        return None
    r, lo, hi = simple_race.bootstrap_ratio(p["step_ms"], ctrl["step_ms"])
    return {"ratio": r, "low": lo, "high": hi, "rounds": len(p["step_ms"])}


def cell(name: str, shape: dict, share: int, *, base: int, loaded, report, steps: int, tries: int, log) -> dict:
    keep: dict = {}
    row = compile_check.one(name, shape, share, device="cpu", dtype="float32", steps=steps, tries=tries,
                            verify=False, log=log, base_peak_bytes=base, loaded=loaded, report=copy.deepcopy(report),
                            keep=keep)
    pts = {p["plan"]: p for p in row["points"]}
    ctrl = pts.get("none+compile")
    row["model"] = name
    row["eager_unplanned_profiler_peak_bytes"] = base
    row["ratios"] = {label: _ratio(pts.get(label), ctrl)
                     for label in {"optimal", "none", "optimal+compile", row.get("torch_arm") or ""} - {""}}
    plan = keep["frontier"].plans.get("optimal")
    if plan is not None and pts.get("optimal", {}).get("peak_bytes") is not None:
        # the eager reference's peak by the budget's own instrument: torch.profiler on a fresh build
        row["eager_optimal_profiler_peak_bytes"] = simple_race.profiler_peak(loaded, plan)
    return row


def run_model(name: str, shape: dict, shares: list[int], *, steps: int, tries: int, log) -> list[dict]:
    spec = simple_race.MODELS[name][0]
    t0 = time.perf_counter()
    try:
        loaded = load_workload(spec, shape)
        base = simple_race.profiler_peak(loaded, None)
        report = profile_workload(loaded)
    except Exception as exc:  # noqa: BLE001 - a model that does not build is a row, not a silent gap
        return [{"model": name, "shape": shape, "budget_pct": s, "crash": f"{type(exc).__name__}: {exc}"[:400]}
                for s in shares]
    log(f"[{name}] eager unplanned peak {base / MIB:.2f} MiB (torch.profiler), {time.perf_counter() - t0:.0f} s")
    rows = []
    for share in shares:
        try:
            rows.append(cell(name, shape, share, base=base, loaded=loaded, report=report, steps=steps, tries=tries,
                             log=log))
        except Exception as exc:  # noqa: BLE001 - e.g. inductor fails on this model on CPU: the row says so
            rows.append({"model": name, "shape": shape, "budget_pct": share,
                         "eager_unplanned_profiler_peak_bytes": base, "crash": f"{type(exc).__name__}: {exc}"[:400]})
    return rows


def _pct(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


def markdown(rows: list[dict], command: str, rounds: int) -> str:
    out = ["## remat vs torch.compile's budget (issue 42 item 4)", "",
           f"`{command}` on {platform.node()} ({os.cpu_count()} CPUs, shared), torch {torch.__version__}, "
           f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, float32, CPU. Budget = share of the "
           "unplanned eager step's peak by torch.profiler, no reserve. Per cell one interleaved round-robin "
           f"({rounds} timed rounds after 2 warm-up) of eager none/optimal, none+compile, optimal+compile and torch's "
           "budget arm. Times: median over rounds of arm / none+compile with a paired bootstrap 95% interval "
           "(< 1: faster than the compiled unplanned step). Peaks: compiled arms by torch.profiler's CPU allocator "
           "events (`cpu-profiler-allocator`), the eager reference by torch.profiler on a fresh build.", "",
           "| model | budget | none+compile: peak MiB / p50 ms; eager unplanned's p50 ratio | torch budget@R: R, peak MiB, p50 ratio | "
           "remat optimal+compile: peak MiB, p50 ratio (boundaries) | eager optimal (reference): peak MiB, p50 ratio "
           "| remat / torch's arm that fits, paired | budget tries (R: MiB, * fits) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['model']} | {r['budget_pct']}%"
        if "crash" in r:
            out.append(f"{head} | FAILED: {r['crash'][:200]} | | | | | |")
            continue
        pts = {p["plan"]: p for p in r["points"]}
        ctrl, ta, ra, ea = (pts.get("none+compile"), pts.get(r["torch_arm"] or ""), pts.get(r["remat_arm"] or ""),
                            pts.get("optimal"))
        ratios = r["ratios"]
        mib = lambda b: "-" if b is None else f"{b / MIB:.1f}"  # noqa: E731
        ctrl_c = "-" if ctrl is None else (f"{mib(ctrl['peak_bytes'])} ({ctrl['peak_bytes'] / r['eager_unplanned_profiler_peak_bytes']:.0%} of eager) / "
                                           f"{ctrl['p50_ms'] or 0:.1f}; eager unplanned {_pct(ratios.get('none'))}")
        if ta is None:
            torch_c = "none fits"
        else:
            ratio = ta["plan"].split("@")[-1] if "@" in ta["plan"] else "1 (default)"
            torch_c = f"{ratio}, {mib(ta['peak_bytes'])}{'' if ta['fits'] else ' (over)'}, {_pct(ratios.get(ta['plan']))}"
        if ra is None or ra["peak_bytes"] is None:
            remat_c = "-" if ra is None else f"{ra['decision']}: {(ra['reason'] or '')[:80]}"
        else:
            remat_c = (f"{mib(ra['peak_bytes'])}{'' if ra['fits'] else ' (over)'}, {_pct(ratios.get(ra['plan']))} "
                       f"({len(ra['boundaries'])}: {', '.join(map(str, ra['boundaries']))})")
        eager_c = "-" if ea is None or ea["peak_bytes"] is None else (
            f"{mib(r.get('eager_optimal_profiler_peak_bytes'))}, {_pct(ratios.get('optimal'))}")
        vs_torch = "-" if ta is None else (f"compiled {_pct(_ratio(ra, ta))}; eager {_pct(_ratio(ea, ta))}")
        tries = ", ".join(f"{t['ratio']:g}: " + ("-" if t["peak_bytes"] is None else f"{t['peak_bytes'] / MIB:.1f}")
                          + ("*" if t["fits"] else "") for t in r["budget_search"])
        out.append(f"{head} = {r['budget_bytes'] / MIB:.1f} MiB | {ctrl_c} | {torch_c} | {remat_c} | {eager_c} | {vs_torch} | {tries} |")
    out += ["", "Per-point figures (every round's time, each peak's instrument, the boundaries by name) in "
            "the JSON each command wrote (`--json`; default `benchmarks/results/compile_table.json`).", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,qwen2moe,unet")
    ap.add_argument("--shares", default="70,50", help="percent of the unplanned eager peak (torch.profiler)")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved timed rounds per cell")
    ap.add_argument("--tries", type=int, default=4, help="most recompiles for torch's budget bisection")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, the last share, 3 rounds, 2 tries, gpt2 and qwen2moe unless --models; no RESULTS.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--render", default=None,
                    help="comma-separated JSONs of earlier runs (e.g. one per model, run side by side): write their "
                         "rows as one table to RESULTS.md, measure nothing")
    args = ap.parse_args(argv)
    if args.render:
        runs = [json.loads(Path(f).read_text()) for f in args.render.split(",")]
        merged = [r for run in runs for r in run["rows"]]
        text = markdown(merged, "; ".join(run["command"] for run in runs), min(run["rounds"] for run in runs))
        if not args.no_write:
            compile_check.write_results(text, marker="compile-table")
        print(text)
        return 0
    torch.set_num_threads(1)   # simple_race.py's rule: one thread, so two shared cores time the arms alike
    if args.smoke:   # a few minutes: the UNet compiles for minutes even tiny, so it joins only when named
        args.shares, args.rounds, args.tries = args.shares.split(",")[-1], 3, 2
        if args.models == ap.get_default("models"):
            args.models = "gpt2,qwen2moe"
    shares = [int(s) for s in args.shares.split(",")]
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    command = "python benchmarks/compile_table.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows: list[dict] = []
    result = {"command": command.strip(), "torch": torch.__version__, "rounds": args.rounds, "rows": rows}
    out = args.json or HERE / "results" / ("compile_table_smoke.json" if args.smoke else "compile_table.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        shape = SMOKE[name] if args.smoke else simple_race.MODELS[name][1]
        rows.extend(run_model(name, shape, shares, steps=args.rounds, tries=args.tries, log=log))
        # after every model: a long run that is stopped keeps what it measured
        out.write_text(json.dumps(result, indent=1, default=str))
        if not (args.smoke or args.no_write):
            compile_check.write_results(markdown(rows, result["command"], args.rounds), marker="compile-table")
    print(markdown(rows, result["command"], args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
