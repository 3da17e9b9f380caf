"""remat's compiled plans against torch.compile's activation_memory_budget aimed at the same peak (issue 16).

For each workload and budget (a share of the control's eager profiled peak, no reserve), one
``run_frontier(..., compile=CompileSpec())`` measures, in ONE interleaved round-robin:

  none, optimal                 eager (the closed-loop optimal plan at the budget)
  none+compile                  the control, torch.compile of the model (NOTE [compiled arms])
  optimal+compile               optimal planned again through the closed loop on the compiled
                                step's peak (NOTE [compiled closed loop]), compiled
  torch-budget@R                the unplanned model compiled with activation_memory_budget = R, R
                                bisected for the largest ratio whose measured compiled peak fits
                                (NOTE [budget aimed at a peak]; every try is kept)

and ships the cheapest that fits (NOTE [ship decision]). Then the compiled remat plan is verified
against the compiled control (``verify_plan(..., compile=...)``, COMPILED_TOLERANCES).

Peaks: eager points by the CPU live-tensor tracker (or the CUDA allocator); compiled points by
torch.profiler's CPU allocator events (``cpu-profiler-allocator``) or the CUDA allocator. Each
point names its instrument.

    .venv/bin/python benchmarks/compile_check.py                       # CPU: gpt + mlp at 70% and 55%, RESULTS.md section
    .venv/bin/python benchmarks/compile_check.py --device cuda --gpt2-small   # GPU: GPT-2-small, bf16, 70%, 2 tries
    .venv/bin/python benchmarks/compile_check.py --smoke               # tiny shapes, a minute or two, no RESULTS.md

Prints one JSON object (all runs) on stdout's last line; writes benchmarks/results/compile_check.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

if "cuda" not in " ".join(sys.argv):   # a 2-core CPU box: one compile thread; a GPU host keeps inductor's default
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from remat.frontier import FrontierSettings, p50_difference, run_frontier  # noqa: E402
from remat.measure import CompileSpec  # noqa: E402
from remat.plan import make_plan  # noqa: E402
from remat.plan.spec import PlannerKind  # noqa: E402
from remat.profile import profile_workload  # noqa: E402
from remat.verify import verify_plan  # noqa: E402
from remat.workload import load_workload  # noqa: E402

HERE = Path(__file__).resolve().parent
MIB = 2 ** 20

SHAPES = {   # compare.py's shapes (benchmarks/RESULTS.md "Frontier and anchors"), gpt without dropout as before
    "gpt": {"batch_size": 8, "seq_len": 128, "n_layer": 4, "dropout": 0.0},
    "mlp": {"batch_size": 2048, "width": 128},
    # the zoo's Hugging Face models at their factories' shapes: GPT-2 keeps HF's dropout 0.1, which
    # verify --compile compares with random ops in program order (NOTE [compiled arms], *Random numbers*)
    "benchmarks/zoo/hf_gpt2.py:build": {},
    "benchmarks/zoo/hf_llama.py:build": {},
}
SMOKE = {
    "gpt": {"batch_size": 2, "seq_len": 32, "n_layer": 2, "d_model": 32, "n_head": 2, "vocab": 64, "dropout": 0.0},
    "mlp": {"batch_size": 256, "width": 64, "depth": 4, "d_in": 8},
}
# GPT-2 small (124 M parameters: 12 layers, d_model 768, 12 heads, vocab 50304), batch 8 x 1024
GPT2_SMALL = {"gpt": {"batch_size": 8, "seq_len": 1024, "n_layer": 12, "d_model": 768, "n_head": 12,
                      "vocab": 50304, "dropout": 0.0}}


def one(spec: str, shape: dict, pct: int | str, *, device: str, dtype: str, steps: int, tries: int,
        verify: bool, log, base_peak_bytes: int | None = None, loaded=None, report=None,
        keep: dict | None = None) -> dict[str, Any]:  # noqa: ANN001
    """``pct``: a share of the control's eager profiled peak, or "mid": halfway between remat's
    predicted floor and that peak (``make zoo``'s rule, so every model has a budget remat can meet).
    ``base_peak_bytes``: the eager peak the share is of, when the caller measured it another way
    (compile_table.py: torch.profiler's); ``loaded``/``report``: reuse the caller's build and profile;
    ``keep``: gets the frontier result under "frontier" (its plans, for the caller's own measurements)."""
    t0 = time.perf_counter()
    loaded = loaded if loaded is not None else load_workload(spec, shape, device=device, dtype=dtype)
    report = report if report is not None else profile_workload(loaded)
    if base_peak_bytes is not None:
        budget = int(base_peak_bytes * int(pct) / 100)
    elif pct == "mid":
        floor = make_plan(report, "floor").predicted_peak_bytes
        budget = (floor + report.baseline_peak_bytes) // 2
        pct = round(100 * budget / report.baseline_peak_bytes)
    else:
        budget = int(report.baseline_peak_bytes * int(pct) / 100)
    log(f"[{spec} {pct}%] frontier --compile, budget {budget / MIB:.2f} MiB")
    seen: set[str] = set()

    def progress(what: str, done: int, total: int) -> None:
        if what not in seen:
            seen.add(what)
            log(f"[{spec} {pct}%]   {what} ({time.perf_counter() - t0:.0f} s)")
    fr = run_frontier(loaded, FrontierSettings(budget_bytes=budget, reserve=0.0, plans="none,optimal", steps=steps,
                                               warmup=2, capacity_key=None, compile=CompileSpec(),
                                               budget_tries=tries), report=report, progress=progress)
    if keep is not None:
        keep["frontier"] = fr
    points = {p.plan: p for p in fr.points}
    torch_arm = next((p for p in fr.points if p.planner.kind is PlannerKind.TORCH_BUDGET), None)
    if torch_arm is None and points.get("none+compile") is not None and points["none+compile"].fits:
        torch_arm = points["none+compile"]   # torch's default budget (1.0) already fits
    remat_arm = points.get("optimal+compile")
    row: dict[str, Any] = {
        "workload": spec, "shape": shape, "budget_pct": pct, "budget_bytes": budget, "device": device, "dtype": dtype,
        "control_eager_peak_bytes": report.baseline_peak_bytes,
        "shipped": fr.shipped.plan if fr.shipped else None,
        "points": [{k: getattr(p, k) for k in ("plan", "peak_bytes", "memory_source", "p50_ms", "p95_ms", "fits",
                                                "decision", "reason", "compile_s", "boundaries", "step_ms")}
                   | {"decision": p.decision.value} for p in fr.points],
        "budget_search": [t.to_json() for t in fr.budget_search],
        "torch_arm": None if torch_arm is None else torch_arm.plan,
        "remat_arm": None if remat_arm is None else remat_arm.plan,
    }
    if torch_arm is not None and remat_arm is not None and remat_arm.step_ms and torch_arm.step_ms:
        d = p50_difference(remat_arm.step_ms, torch_arm.step_ms)
        row["remat_vs_torch"] = {"ratio": remat_arm.p50_ms / torch_arm.p50_ms, "diff_ms": d.diff_ms,
                                 "ci_ms": [d.low_ms, d.high_ms], "resolved": d.resolved}
    if verify and remat_arm is not None and remat_arm.peak_bytes is not None:
        plan = fr.plans.get(remat_arm.plan)   # the very plan the frontier measured (compiled closed loop)
        if plan is not None:
            log(f"[{spec} {pct}%] verify --compile of {remat_arm.plan}")
            v = verify_plan(loaded, plan, steps=2, seeds=1, timing_steps=0, compile=CompileSpec())
            row["verify"] = {"passed": v.passed, "failures": v.failures[:3],
                             "max_grad_rel": max((s.grad_max_rel for s in v.per_step), default=None),
                             "negative_controls": {n.name: n.rejected for n in v.negative_controls},
                             "tolerance_float32_rtol": v.tolerances["float32"].rtol}
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def cell_of(p: dict | None, *, why: bool = False) -> str:
    """A point's "peak MiB / p50 ms" table cell; ``why``: an unmeasured point shows its decision and reason."""
    if p is None or (p["peak_bytes"] is None and not why):
        return "-"
    if p["peak_bytes"] is None:
        return f"{p['decision']}: {p['reason'][:80]}"
    peak = f"{p['peak_bytes'] / MIB:.2f}" + ("" if p["fits"] else " (over)")
    return f"{peak} / {p['p50_ms']:.1f}" if p["p50_ms"] else peak


def markdown(rows: list[dict], command: str) -> str:
    out = ["## torch.compile: remat's compiled plans vs torch's budget aimed at the peak (issue 16)", "",
           f"`{command}` on {platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}, "
           f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. One interleaved run per row "
           "(eager none/optimal, their compiled twins, torch's budget arm); budget = share of the control's eager "
           "profiled peak, no reserve. **Peak instruments**: eager points `cpu-live-tensors`; compiled points "
           "`cpu-profiler-allocator` (torch.profiler's CPU allocator events over one warm step, plus the step's "
           "starting state; the tracker cannot see inside compiled graphs). p50 of the warm whole step (ms).", "",
           "| workload | budget | remat compiled plan: peak MiB / p50 | torch budget arm that fits: ratio, peak MiB / p50 "
           "| remat / torch p50 (95% CI of diff, ms) | shipped | verify (compiled control) | budget tries (ratio: MiB) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pts = {p["plan"]: p for p in r["points"]}
        ra, ta = pts.get(r["remat_arm"] or ""), pts.get(r["torch_arm"] or "")

        torch_cell = "none fits" if ta is None else f"{ta['plan']}: {cell_of(ta)}"
        cmp_ = r.get("remat_vs_torch")
        cmp_cell = "-" if cmp_ is None else (f"{cmp_['ratio']:.2f} ({cmp_['ci_ms'][0]:+.1f}..{cmp_['ci_ms'][1]:+.1f}"
                                            f"{', resolved' if cmp_['resolved'] else ', not resolved'})")
        v = r.get("verify")
        vcell = "-" if v is None else ("error" if "error" in v else
                                       f"{'pass' if v['passed'] else 'FAIL'} (max grad rel {v['max_grad_rel']:.1e}; "
                                       f"perturbed rejected: {v['negative_controls'].get('perturbed_gradient')})")
        tries = ", ".join(f"{t['ratio']:g}: " + ("-" if t["peak_bytes"] is None else f"{t['peak_bytes'] / MIB:.1f}")
                          + ("*" if t["fits"] else "") for t in r["budget_search"])
        out.append(f"| {r['workload']} | {r['budget_pct']}% = {r['budget_bytes'] / MIB:.2f} MiB | "
                   f"{r['remat_arm'] or '-'}: {cell_of(ra)} | {torch_cell} | {cmp_cell} | {r['shipped'] or 'none'} | "
                   f"{vcell} | {tries} |")
    out += ["", "Budget tries: `*` = the measured compiled peak fits; ratio 1 is the compiled control (torch's "
            "default). Per-point figures, with each instrument, in `benchmarks/results/compile_check.json`.", ""]
    return "\n".join(out)


def zoo_markdown(rows: list[dict], command: str) -> str:
    """One line per zoo model: what frontier --compile shipped, remat's compiled plan, torch's arm, verify."""
    out = ["## torch.compile on the zoo (issue 16)", "",
           f"`{command}` on {platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}, "
           f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Each model at its factory's shape, "
           "budget = share of the control's eager profiled peak (`mid`: halfway between remat's predicted floor and "
           "that peak, `make zoo`'s rule), no reserve; the same interleaved frontier as above. "
           "Peaks of compiled points by `cpu-profiler-allocator`; p50 of the warm whole step (ms).", "",
           "| model | budget | shipped | remat compiled plan: peak MiB / p50 (boundaries) | torch arm that fits: peak MiB / p50 "
           "| none+compile peak MiB | verify (compiled control) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        name = Path(r["workload"].split(":")[0]).stem
        if "crash" in r:
            out.append(f"| {name} | {r['budget_pct']}% | CRASH: {r['crash'][:120]} | | | | |")
            continue
        pts = {p["plan"]: p for p in r["points"]}
        ra, ta, ctrl = pts.get(r["remat_arm"] or ""), pts.get(r["torch_arm"] or ""), pts.get("none+compile")
        v = r.get("verify")
        vcell = "-" if v is None else ("error" if "error" in v else (
            f"{'pass' if v['passed'] else 'FAIL: ' + '; '.join(v['failures'])[:120]} (perturbed rejected: "
            f"{v['negative_controls'].get('perturbed_gradient')})"))
        remat = "-" if ra is None else f"{cell_of(ra, why=True)} ({len(ra['boundaries'])})"
        torch_cell = "none fits" if ta is None else f"{ta['plan']}: {cell_of(ta, why=True)}"
        ctrl_cell = "-" if ctrl is None or ctrl["peak_bytes"] is None else f"{ctrl['peak_bytes'] / MIB:.1f}"
        out.append(f"| {name} | {r['budget_pct']}% = {r['budget_bytes'] / MIB:.1f} MiB | {r['shipped'] or 'none'} | {remat} | "
                   f"{torch_cell} | {ctrl_cell} | {vcell} |")
    return "\n".join(out + [""])


def write_results(section: str, marker: str = "compile-check") -> None:
    path = HERE / "RESULTS.md"
    text = path.read_text() if path.exists() else ""
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default float32 (bfloat16 with --gpt2-small on CUDA)")
    ap.add_argument("--workloads", default="gpt,mlp",
                    help="gpt, mlp, benchmarks/zoo/hf_gpt2.py:build, benchmarks/zoo/hf_llama.py:build")
    ap.add_argument("--json", type=Path, default=None, help="write the JSON here (default benchmarks/results/)")
    ap.add_argument("--budgets", default="70,55",
                    help="shares of the control's peak, or mid (halfway between remat's floor and the peak)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tries", type=int, default=5, help="most recompiles for torch's budget (default 5)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; no RESULTS.md")
    ap.add_argument("--gpt2-small", action="store_true", help="gpt at GPT-2-small shape, 70%% only, no verify")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--zoo", action="store_true",
                    help="every benchmarks/zoo model at its factory's shape (RESULTS.md 'torch.compile on the zoo')")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"error": "CUDA requested but not available"}))
        return 2
    shapes = GPT2_SMALL if args.gpt2_small else SMOKE if args.smoke else SHAPES
    budgets = [70] if args.gpt2_small and args.budgets == "70,55" else [
        b if b == "mid" else int(b) for b in args.budgets.split(",")]
    if args.gpt2_small and args.tries == 5:
        args.tries = 2   # each try is a recompile of a 12-layer model: keep the GPU run to a few minutes
    dtype = args.dtype or ("bfloat16" if args.gpt2_small and args.device.startswith("cuda") else "float32")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows: list[dict] = []
    command = "python benchmarks/compile_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command.strip(), "torch": torch.__version__, "rows": rows}
    name = "compile_check" + ("_zoo" if args.zoo else "") + ("_smoke" if args.smoke else "") + ("" if args.device == "cpu" else "_cuda")
    out = args.json or HERE / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.zoo:   # every zoo model at its factory's shape: does the compiled path work on models we did not write?
        shapes = {f"benchmarks/zoo/{p.name}:build": {} for p in sorted((HERE / "zoo").glob("*.py"))
                  if not p.name.startswith("_") and p.name != "run.py"}
        args.workloads = ",".join(shapes)
    for spec in args.workloads.split(","):
        if spec not in shapes:
            continue
        for pct in budgets:
            try:
                rows.append(one(spec, shapes[spec], pct, device=args.device, dtype=dtype, steps=args.steps,
                                tries=args.tries, verify=not (args.no_verify or args.gpt2_small), log=log))
            except Exception as exc:  # noqa: BLE001 - with --zoo a model that crashes is a row, not the end
                if not args.zoo:
                    raise
                rows.append({"workload": spec, "budget_pct": pct, "crash": f"{type(exc).__name__}: {exc}"[:300]})
            # after every row: a long run that is stopped keeps what it measured
            out.write_text(json.dumps(result, indent=1, default=str))
            if args.zoo and not args.no_write:
                write_results(zoo_markdown(rows, result["command"]), marker="compile-zoo")
            elif not (args.smoke or args.no_write or args.device != "cpu"):
                write_results(markdown(rows, result["command"]))
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
