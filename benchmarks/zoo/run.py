"""Run ``remat receipt`` on every zoo model (and the built-ins) and tabulate what happened (issue 11).

    .venv/bin/python benchmarks/zoo/run.py                 # every model (make zoo)
    .venv/bin/python benchmarks/zoo/run.py hf_gpt2 own_unet  # a few
    .venv/bin/python benchmarks/zoo/run.py --timeout 300 --out out/zoo

Per model, in sequence (2 cores: never in parallel), each through the CLI in a subprocess with
a timeout so a hang costs one row, not the run:

1. *probe*: ``remat plan --planner all --out OUT/<model>/probe`` (profile + apply every
   candidate + measure). From it: the control peak (``profile.json``
   ``baseline_peak_bytes``, the unmodified step's measured peak), the candidates found, and
   the *floor* (below).
2. *receipt*: ``remat receipt --budget <(floor + control) / 2 bytes> --out OUT/<model>/receipt``
   with remat's default settings.
3. *check*: ``remat check --quick`` on the receipt, when one was written.
4. *hazards*: for every hazard kind the profile reports (RNG aside), the candidate is planned
   *unguarded* and verified: it must fail (exit 1), or the hazard was a false alarm.

The floor is the lowest peak remat demonstrably reaches: the measured peak of ``--planner
all`` when that ran and lowered the peak; otherwise the cost model's predicted floor
(``remat.plan.peak_floor`` on the probe's profile). Both are recorded. Should the probe fail,
the receipt still runs, at 75% of the control peak (or ``75%`` when no control peak is known).

Writes ``benchmarks/zoo/results.json`` (every figure, the command lines, exit codes and the
last lines of stderr on failure) and ``benchmarks/ZOO.md`` (the table). Exit code: 0 when no
stage of any model crashed (exit 3 or a timeout), else 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from remat.frontier.model import OverheadInterval, short_overhead

ROOT = Path(__file__).resolve().parents[2]
ZOO = Path(__file__).resolve().parent
REMAT = [sys.executable, "-m", "remat.cli.main"] if not (ROOT / ".venv/bin/remat").exists() \
    else [str(ROOT / ".venv/bin/remat")]
MIB = 1 << 20
PROFILER_STEPS = 5   # later steps torch.profiler measures the shipped plan on (issue 28's column)

TOOLS = {"run.py", "profiler_peak.py"}   # the runner's own scripts, not models
# (name, workload spec, shape text): zoo files first, then the built-ins at their defaults
MODELS: list[tuple[str, str, str]] = [
    *[(p.stem, f"benchmarks/zoo/{p.name}:build", "") for p in sorted(ZOO.glob("*.py"))
      if not p.name.startswith("_") and p.name not in TOOLS],
    ("builtin_gpt", "gpt", ""), ("builtin_cnn", "cnn", ""), ("builtin_mlp", "mlp", ""),
]


def mib(n: int | None) -> str:
    return "–" if n is None else f"{n / MIB:.1f}"


def run_cli(args: list[str], timeout: float, log: Path) -> dict[str, Any]:
    """One remat command: exit code (None on timeout), wall seconds, the stderr tail."""
    cmd = [*REMAT, *args]
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"})
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)   # its own session: the command and anything it started
            proc.wait()
            rc = None
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip() and "done " not in ln]
    return {"command": "remat " + " ".join(shlex.quote(a) for a in args), "exit_code": rc,
            "timed_out": rc is None, "wall_s": round(wall, 1), "log": str(log.relative_to(ROOT) if log.is_relative_to(ROOT) else log),
            "tail": lines[-25:] if rc not in (0,) else lines[-6:]}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def predicted_floor(profile: dict[str, Any]) -> int | None:
    try:
        from remat.plan import peak_floor
        from remat.profile import ProfileReport
        return int(peak_floor(ProfileReport.from_json(profile)))
    except Exception:  # noqa: BLE001 - a figure for the table; the probe's own failure is recorded
        return None


def probe_figures(probe_dir: Path) -> dict[str, Any]:
    profile = read_json(probe_dir / "profile.json")
    plan = read_json(probe_dir / "plan.json")
    out: dict[str, Any] = {"control_peak_bytes": None, "candidates": None, "candidate_names": [],
                           "hazardous_candidates": [], "profile_excluded": {}, "predicted_floor_bytes": None,
                           "all_measured_peak_bytes": None, "all_boundaries": None, "all_excluded": []}
    if profile is not None:
        out["control_peak_bytes"] = profile.get("baseline_peak_bytes")
        cands = profile.get("candidates", [])
        out["candidates"] = len(cands)
        out["candidate_names"] = [f"{c['name']} ({c['class_name']})" for c in cands]
        out["hazardous_candidates"] = [{"module": c["name"], "hazards": [f"{h['kind']}: {h['detail']}" for h in
                                                                          c.get("hazards", [])]}
                                       for c in cands if c.get("hazards")]
        out["profile_excluded"] = profile.get("excluded", {})
        out["predicted_floor_bytes"] = predicted_floor(profile)
    if plan is not None:
        out["all_measured_peak_bytes"] = plan.get("measured_peak_bytes")
        out["all_boundaries"] = len(plan.get("boundaries", []))
        out["all_excluded"] = [f"{e['module']}: {e['reason']}" for e in plan.get("excluded", [])]
    return out


def choose_budget(fig: dict[str, Any]) -> tuple[str, int | None, str]:
    """(--budget text, floor bytes, which floor) at halfway between the floor and the control peak."""
    control = fig["control_peak_bytes"]
    if control is None:
        return "75%", None, "no probe: 75% of the control peak"
    measured, predicted = fig["all_measured_peak_bytes"], fig["predicted_floor_bytes"]
    if measured is not None and measured < control:
        floor, which = measured, "measured peak of --planner all"
    elif predicted is not None:
        floor, which = predicted, "predicted floor (--planner all did not lower the measured peak)"
    else:
        return str(int(control * 0.75)), None, "no floor: 75% of the control peak"
    return str((floor + control) // 2), floor, which


def receipt_figures(receipt: dict[str, Any]) -> dict[str, Any]:
    d = receipt.get("decision", {})
    target = receipt.get("traces", {}).get("target") or {}
    ver = receipt.get("verification")
    plan_rec = receipt.get("plan", {})
    shipped = d.get("shipped_peak_bytes")
    limit = d.get("effective_budget_bytes")
    hazards = [f"{h.get('module')}: {h.get('kind')} {h.get('detail', '')}".strip() for h in (ver or {}).get("hazards", [])]
    return {
        "status": d.get("status"), "shipped_plan": d.get("shipped"),
        "boundaries": [{"module": b["module"], "class": b.get("class_name"), "mode": b["mode"],
                        "guarded": b.get("guarded"), "measured_saving_bytes": b.get("measured_saving_bytes")}
                       for b in plan_rec.get("boundaries", [])] if d.get("status") == "ship" else [],
        "control_peak_bytes": d.get("control_peak_bytes"), "blocking_phase": target.get("peak_phase"),
        "categories_at_peak": target.get("categories_at_peak"),
        "budget_bytes": d.get("budget_bytes"), "effective_budget_bytes": limit, "shipped_peak_bytes": shipped,
        "clears": d.get("clears"), "under_budget": None if shipped is None else shipped <= d.get("budget_bytes", 0),
        "overhead_pct": d.get("overhead_pct"), "overhead_interval": d.get("overhead_interval"),
        "verified": d.get("verified"),
        "verify_failures": (ver or {}).get("failures", [])[:5], "hazards": hazards,
        "rejected": [f"{r['plan']}: {r['decision']} ({r['reason']})" for r in d.get("rejected", [])],
        "why": d.get("why", []), "closed_loop_note": plan_rec.get("note", ""),
    }


def overhead_cell(pct: float | None, interval: dict[str, Any] | None) -> str:
    """The receipt's overhead for a table cell, with its interval (NOTE [overhead intervals] in
    remat/frontier/model.py): a difference inside the noise says so, never a bare -18%."""
    if pct is None:
        return "–"
    if interval is None:
        return f"{pct:+.0f}% (no interval)"
    return short_overhead(pct, OverheadInterval.from_json(interval))


def run_check(spec: str, rdir: Path, timeout: float, log: Path) -> dict[str, Any]:
    # remat check never imports the workload a receipt names: name it (the same spec) explicitly
    return run_cli(["check", str(rdir / "receipt.json"), "--quick", "--workload", spec], timeout, log)


def profiler_peak(spec: str, shape: str, rdir: Path, timeout: float, log: Path) -> dict[str, Any] | None:
    """torch.profiler's max peak of the shipped plan over later steps (``profiler_peak.py``); None: no figure."""
    out = rdir / "profiler_peak.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ZOO / "profiler_peak.py"), str(rdir / "receipt.json"), "--workload", spec,
           "--steps", str(PROFILER_STEPS), "--json", str(out), *(["--shape", shape] if shape else [])]
    try:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), timeout=timeout, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    return read_json(out) or {"error": f"no result; see {_shown(log)}"}


def hazard_candidates(probe_dir: Path) -> dict[str, str]:
    """One candidate per reported hazard kind other than RNG (kind -> module), from the probe's profile.

    RNG use is not re-checked here: every receipt's verification already runs the
    RNG-preservation-off negative control, which must fail.
    """
    prof = read_json(probe_dir / "profile.json") or {}
    out: dict[str, str] = {}
    # a segment's hazards are its members' (NOTE [segments]), and `--planner all` plans the
    # top-level modules, not segments: confirm a hazard on a module
    for c in sorted(prof.get("candidates", []), key=lambda c: (c.get("order", 0))):
        if c["name"] in prof.get("excluded", {}) or c.get("members"):
            continue
        for h in c.get("hazards", []):
            if h["kind"] != "rng":
                out.setdefault(h["kind"], c["name"])
    return out


def confirm_hazards(base: list[str], probe_dir: Path, out_dir: Path, timeout: float) -> list[dict[str, Any]]:
    """Issue 11: every reported hazard must make an *unguarded* plan of its candidate fail verification.

    Per hazard kind: ``remat plan --candidates M --planner all --allow-hazards --no-measure`` (M
    checkpointed unguarded), then ``remat verify`` on that plan: exit 1 confirms the hazard; exit 0
    (the unguarded replay verifies) means the hazard was a false alarm, which fails the zoo.
    """
    rows = []
    for kind, module in hazard_candidates(probe_dir).items():
        hdir = out_dir / f"hazard-{kind}"
        plan = run_cli(["plan", *base, "--candidates", module, "--planner", "all", "--allow-hazards",
                        "--no-measure", "--out", str(hdir)], timeout, out_dir / f"hazard-{kind}-plan.log")
        verify = run_cli(["verify", *base, "--plan", str(hdir / "plan.json"), "--steps", "2", "--seeds", "1",
                          "--timing-steps", "0", "--out", str(hdir / "verify")], timeout,
                         out_dir / f"hazard-{kind}-verify.log") if plan["exit_code"] == 0 else None
        confirmed = verify is not None and verify["exit_code"] == 1
        # an empty plan checkpoints nothing: its passing verify says nothing about the hazard
        planned = bool((read_json(hdir / "plan.json") or {}).get("boundaries"))
        rows.append({"kind": kind, "module": module, "plan": plan, "verify": verify, "confirmed": confirmed,
                     "false_alarm": planned and verify is not None and verify["exit_code"] == 0,
                     "unconfirmable": None if planned else "the unguarded plan of the candidate is empty"})
    return rows


# --fast: no batch-capacity search, 4 frontier plans with 3 timed steps each, 2 seeds x 2 steps of verification
FAST = ["--no-capacity", "--frontier-steps", "3", "--plans", "none,all,uniform:2,optimal",
        "--verify-seeds", "2", "--verify-steps", "2"]


def run_model(name: str, spec: str, shape: str, out_root: Path, timeout: float, fast: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = ["--workload", spec] + (["--shape", shape] if shape else [])
    row: dict[str, Any] = {"model": name, "workload": spec, "shape": shape, "commit": git_commit()}
    probe_dir = out_root / name / "probe"
    row["probe"] = run_cli(["plan", *base, "--planner", "all", "--out", str(probe_dir)], timeout,
                           out_root / name / "probe.log")
    try:
        fig = probe_figures(probe_dir if row["probe"]["exit_code"] in (0, 1) else Path("/nonexistent"))
    except (KeyError, TypeError, AttributeError) as exc:
        fig = probe_figures(Path("/nonexistent"))
        row["runner_error"] = f"reading the probe: {type(exc).__name__}: {exc}"
    row.update(fig)
    budget, floor, which = choose_budget(fig)
    row.update(budget=budget, floor_bytes=floor, floor_source=which)
    rdir = out_root / name / "receipt"
    row["receipt"] = run_cli(["receipt", *base, "--budget", budget, *(FAST if fast else []), "--out", str(rdir)],
                             timeout,
                             out_root / name / "receipt.log")
    receipt = read_json(rdir / "receipt.json") if row["receipt"]["exit_code"] in (0, 1) else None
    try:
        row["result"] = receipt_figures(receipt) if receipt is not None else None
    except (KeyError, TypeError, AttributeError) as exc:   # the receipt's layout moved: keep the row
        row["result"] = None
        row["runner_error"] = f"reading receipt.json: {type(exc).__name__}: {exc}"
    if receipt is not None:
        row["check"] = run_check(spec, rdir, timeout, out_root / name / "check.log")
        shipped = (row["result"] or {}).get("status") == "ship"   # nothing shipped: no plan to re-measure
        row["profiler"] = profiler_peak(spec, shape, rdir, timeout, out_root / name / "profiler_peak.log") \
            if shipped else None
    row["hazard_checks"] = confirm_hazards(base, probe_dir, out_root / name, timeout)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row["verdict"] = verdict(row)
    return row


def verdict(row: dict[str, Any]) -> str:
    """pass: a plan shipped under budget and verified, or exit 2 (typed refusal); otherwise what failed."""
    for stage in ("probe", "receipt", "check"):
        r = row.get(stage)
        if r is None:
            continue
        if r["timed_out"]:
            return f"{stage}: timed out"
        if r["exit_code"] == 3:
            return f"{stage}: crash (exit 3)"
    rc = row["receipt"]["exit_code"]
    res = row.get("result")
    if rc == 2:
        return "refused (exit 2)"
    if res is None:
        return f"receipt: exit {rc}, no receipt"
    if res["status"] != "ship":
        return "nothing ships (exit 1)"
    if res["boundaries"] and res["verified"] is not True:
        return "shipped but not verified"
    if res["under_budget"] is False:
        return "shipped over budget"
    prof = row.get("profiler") or {}
    if prof.get("within_budget") is False:
        return "profiler peak over budget"
    if row.get("check") and row["check"]["exit_code"] != 0:
        return f"check --quick: exit {row['check']['exit_code']}"
    alarms = [h["kind"] for h in row.get("hazard_checks", []) if h["false_alarm"]]
    if alarms:
        return f"false alarm: {', '.join(alarms)} (unguarded plan verifies)"
    unconfirmed = [h["kind"] for h in row.get("hazard_checks", []) if not h["confirmed"]]
    if unconfirmed:
        return f"hazard not confirmed: {', '.join(unconfirmed)}"
    return "pass"


def short_error(r: dict[str, Any] | None) -> str:
    if not r or r["exit_code"] == 0:
        return ""
    if r["timed_out"]:
        return "timed out"
    tail = [ln.strip() for ln in r["tail"] if ln.strip()]
    errs = [ln for ln in tail if "Error" in ln or "error" in ln or "Exception" in ln]
    return (errs[-1] if errs else (tail[-1] if tail else ""))[:240]


def git_commit() -> str:
    """The commit the zoo ran on (``unknown`` outside a git checkout), so a table names its code."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _shown(p: Path) -> str:
    """``p`` relative to the repository when it lies inside it."""
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def profiler_cell(prof: dict[str, Any] | None) -> str:
    if not prof:
        return "–"
    if "error" in prof:
        return "error"
    mark = {True: "yes", False: "**NO**", None: "?"}[prof.get("within_budget")]
    return f"{mib(prof['max_peak_bytes'])} ({mark})"


def _commits(rows: list[dict[str, Any]]) -> str:
    """The commit(s) the rows ran on: one, or each with the models a later re-run replaced."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(r.get("commit") or git_commit(), []).append(r["model"])
    if len(by) == 1:
        return next(iter(by))
    first, *rest = sorted(by, key=lambda c: -len(by[c]))
    return first + "".join(f"; {', '.join(by[c])} at {c}" for c in rest)


def write_markdown(rows: list[dict[str, Any]], path: Path, command: str, started: str, total_s: float,
                   results: Path = ZOO / "results.json") -> None:
    n_pass = sum(r["verdict"] == "pass" for r in rows)
    alarms = sum(h["false_alarm"] for r in rows for h in r.get("hazard_checks", []))
    confirmed = sum(h["confirmed"] for r in rows for h in r.get("hazard_checks", []))
    crashes = sum("crash" in r["verdict"] or "timed out" in r["verdict"] for r in rows)
    refused = sum(r["verdict"] in ("nothing ships (exit 1)", "refused (exit 2)") for r in rows)
    lines = [
        "# The zoo: remat receipt on models it was not written against (issue 11)",
        "",
        f"Generated by `{command}` on {started} ({total_s / 60:.1f} min, 2 CPU cores; CPU peaks: the live-tensor tracker "
        f"before b5d6693, remat's allocator counter from it on), "
        f"remat at commit {_commits(rows)}.",
        "Do not edit by hand. Figures in MiB; the budget is halfway between the floor (the measured peak of",
        "`remat plan --planner all`, or the predicted floor where `all` did not lower the peak) and the control peak.",
        f"Every figure and the full stderr tail of each failure are in `{_shown(results)}`.",
        "",
        f"**{n_pass} / {len(rows)} pass** (shipped under budget and verified); "
        f"{refused} refused with a typed reason (nothing ships, exit 1, or refused, exit 2: see Failures); "
        f"{crashes} crashed or timed out; {alarms} false alarms ({confirmed} reported hazards confirmed by a "
        f"failing unguarded verify); torch.profiler's peak of the shipped plan over {PROFILER_STEPS} later steps "
        f"(after 2 warm-up steps, on a fresh build: `benchmarks/zoo/profiler_peak.py`) is within the budget on "
        f"{sum((r.get('profiler') or {}).get('within_budget') is True for r in rows)} of "
        f"{sum(bool(r.get('profiler')) for r in rows)} shipped plans. The overhead is the receipt's interleaved p50 "
        "against the control, `(noise)` where its 95% interval holds zero, `(unresolved, n=3)` where the "
        "interval excludes zero but 3 rounds (a --fast receipt's) cannot pass the sign test, which needs 6 "
        "all one way (NOTE [overhead intervals] in src/remat/frontier/model.py), `(no interval)` for rows "
        "run before receipts recorded one.",
        "",
        "| model | verdict | exit (plan/receipt/check) | control peak | blocking phase | candidates | floor | budget "
        "| shipped peak | profiler peak, later steps (≤ budget) | boundaries shipped (mode) | overhead | verify "
        "| hazards | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        res = r.get("result") or {}
        exits = "/".join("–" if r.get(s) is None else ("T" if r[s]["timed_out"] else str(r[s]["exit_code"]))
                         for s in ("probe", "receipt", "check"))
        bounds = ", ".join(f"`{b['module']}` ({b['mode']}{', guarded' if b.get('guarded') else ''})"
                           for b in res.get("boundaries", []))
        if res.get("status") == "ship" and not bounds:
            bounds = "none (control fits)"
        nb = len(res.get("boundaries", []))
        if nb > 6:
            bounds = ", ".join(f"`{b['module']}` ({b['mode']})" for b in res["boundaries"][:5]) + f", … ({nb} in all)"
        ver = {True: "pass", False: "FAIL", None: "–"}[res.get("verified")]
        kinds: dict[str, int] = {}
        for c in r.get("hazardous_candidates", []):
            for h in c["hazards"]:
                kinds[h.split(":", 1)[0]] = kinds.get(h.split(":", 1)[0], 0) + 1
        flagged = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
        haz = "; ".join(res.get("hazards", [])[:3]) or (f"verify: none; profile: {flagged}" if flagged else "–")
        checks = [f"{h['kind']} ({h['module']}): " + ("confirmed, unguarded verify fails" if h["confirmed"] else
                                                      "FALSE ALARM" if h["false_alarm"] else "not confirmed")
                  for h in r.get("hazard_checks", [])]
        if checks:
            haz += "; " + "; ".join(checks)
        ov = overhead_cell(res.get("overhead_pct"), res.get("overhead_interval"))
        lines.append(
            f"| {r['model']} | {r['verdict']} | {exits} | {mib(res.get('control_peak_bytes') or r.get('control_peak_bytes'))} "
            f"| {res.get('blocking_phase') or '–'} | {r.get('candidates') if r.get('candidates') is not None else '–'} "
            f"| {mib(r.get('floor_bytes'))} | {mib(res.get('budget_bytes'))} | {mib(res.get('shipped_peak_bytes'))} "
            f"| {profiler_cell(r.get('profiler'))} | {bounds or '–'} | {ov} | {ver} | {haz} | {r['wall_s']:.0f} |")
    lines += ["", "## Failures", ""]
    for r in rows:
        if r["verdict"] == "pass":
            continue
        lines.append(f"### {r['model']}: {r['verdict']}")
        lines.append("")
        for stage in ("probe", "receipt", "check"):
            s = r.get(stage)
            if s and s["exit_code"] != 0:
                lines += [f"`{s['command']}` -> exit {'timeout' if s['timed_out'] else s['exit_code']}", "", "```",
                          *s["tail"][-12:], "```", ""]
        res = r.get("result") or {}
        for w in res.get("why", [])[:3]:
            lines.append(f"- {w}")
        for f in res.get("verify_failures", [])[:3]:
            lines.append(f"- verify: {f}")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def recheck(args: argparse.Namespace) -> int:
    data = json.loads(args.results.read_text())
    for row in data["rows"]:
        if row.get("check") is not None:
            rdir = args.out / row["model"] / "receipt"
            row["check"] = run_check(row["workload"], rdir, args.timeout, args.out / row["model"] / "check.log")
            row["verdict"] = verdict(row)
    data["command"] += " (check stage: python benchmarks/zoo/run.py --recheck)"
    args.results.write_text(json.dumps(data, indent=1))
    write_markdown(data["rows"], args.markdown, data["command"], data["started"], total_s=sum(r["wall_s"] for r in data["rows"]),
                   results=args.results)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", help="model names (default: all); e.g. hf_gpt2 builtin_cnn")
    ap.add_argument("--timeout", type=float, default=600.0, help="per command, seconds (default 600)")
    ap.add_argument("--out", type=Path, default=ROOT / "out/zoo", help="receipts and logs (default out/zoo)")
    ap.add_argument("--fast", action="store_true",
                    help="receipts with " + " ".join(FAST) + " (the same stages and verification, less timing)")
    ap.add_argument("--render", action="store_true", help="only rewrite the table from --results")
    ap.add_argument("--recheck", action="store_true",
                    help="only re-run remat check --quick on the receipts in --results and rewrite the table")
    ap.add_argument("--results", type=Path, default=ZOO / "results.json")
    ap.add_argument("--markdown", type=Path, default=ROOT / "benchmarks/ZOO.md")
    ap.add_argument("--extra", type=Path, action="append", default=[],
                    help="a folder of more factory files (<name>.py with build(...)), each run as model <name>: "
                         "models the zoo was not shown (write --results/--markdown elsewhere then)")
    args = ap.parse_args(argv)
    extra = [(p.stem, f"{p.resolve()}:build", "") for d in args.extra for p in sorted(d.glob("*.py"))
             if not p.name.startswith("_")]
    known = {m[0]: m for m in [*MODELS, *extra]}
    unknown = [m for m in args.models if m not in known]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(known)}")
    todo = [known[m] for m in args.models] if args.models else (extra or MODELS)
    if args.recheck:
        return recheck(args)
    if args.render:
        data = json.loads(args.results.read_text())
        write_markdown(data["rows"], args.markdown, data["command"], data["started"], total_s=sum(r["wall_s"] for r in data["rows"]),
                       results=args.results)
        return 0
    command = "python benchmarks/zoo/run.py" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("zoo", total=len(todo))
        for name, spec, shape in todo:
            bar.update(task, description=f"zoo: {name}")
            row = run_model(name, spec, shape, args.out, args.timeout, args.fast)
            rows.append(row)
            console.print(f"{name}: {row['verdict']} ({row['wall_s']:.0f} s)"
                          + (f"  {short_error(row['receipt']) or short_error(row['probe'])}"
                             if row["verdict"] != "pass" else ""), highlight=False)
            bar.advance(task)
            # written after every model, so an interrupted run keeps what it measured
            args.results.write_text(json.dumps({"command": command, "started": started, "rows": rows}, indent=1))
            write_markdown(rows, args.markdown, command, started, time.perf_counter() - t0, results=args.results)
    crashed = [r["model"] for r in rows if "crash" in r["verdict"] or "timed out" in r["verdict"]]
    console.print(f"{sum(r['verdict'] == 'pass' for r in rows)}/{len(rows)} pass; crashes: {crashed or 'none'}; "
                  f"wrote {args.markdown} and {args.results}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
