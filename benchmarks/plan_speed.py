"""Planning speed: the planner alone, a first ``remat.auto``, ``remat plan``, and a fresh-process cache hit.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_speed.py planner
    PYTHONPATH=src .venv/bin/python benchmarks/plan_speed.py auto --n-layer 8 [--n-layer 32]
    PYTHONPATH=src .venv/bin/python benchmarks/plan_speed.py plan-gpt --n-layer 32
    PYTHONPATH=src .venv/bin/python benchmarks/plan_speed.py cache-hit

``planner``: synthetic reports from the test suite's generator (25 blocks x (block + 3 children)
= 100 candidates x 2 modes, 200 peak rows, and a flat 100-block chain), budgets from loose to
near the floor; CPU time of this process (HiGHS single-threaded), median of 3.

``auto`` / ``plan-gpt``: wall time of a first ``remat.auto`` on the zoo's HF Llama (cache off,
budget 60%) or of ``remat plan --workload gpt --budget 60%`` (its library call, ``plan_from_args``,
in this process: imports and process start not counted), divided by the warm unplanned step of
the same model measured in this process just before (median of 5 warm steps after 2 untimed):
*step-equivalents*. Both also print each progress stage's wall time in steps (a stage runs
until the next one reports).

``cache-hit``: a fresh process that has imported torch and built the model (the user's) times
``import remat`` plus a ``remat.auto`` that hits the plan cache (the entry stored by a first
process), twice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "zoo"))


def planner() -> None:
    from remat.plan import make_plan
    from tests.test_plan import chain_report
    print("| report | budget (share of baseline peak) | median CPU s | max CPU s |")
    print("|---|---|---|---|")
    for label, rep in (("25 blocks x 4 (100 candidates)", chain_report(25, 3)), ("flat chain of 100", chain_report(100, 0))):
        make_plan(rep, "optimal", budget_bytes=rep.baseline_peak_bytes)  # imports out of the timing
        for frac in (0.9, 0.7, 0.45, 0.3):
            times = []
            for _ in range(3):
                t0 = time.process_time()
                try:
                    make_plan(rep, "optimal", budget_bytes=int(rep.baseline_peak_bytes * frac), reserve=0.05)
                except Exception as exc:  # infeasible budgets are data points here
                    print(f"| {label} | {frac:.0%} | {type(exc).__name__} | |")
                    break
                times.append(time.process_time() - t0)
            else:
                print(f"| {label} | {frac:.0%} | {statistics.median(times):.3f} | {max(times):.3f} |")


def warm_step_s(workload) -> float:  # noqa: ANN001
    """Median of 5 warm unplanned steps (s), after 2 untimed, on a TrainingStep of ``workload``."""
    from remat.workload import TrainingStep
    step = TrainingStep(workload)
    for i in range(2):
        step.run(i)
    times = []
    for i in range(5):
        t0 = time.perf_counter()
        step.run(10 + i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StageClock:
    """A ProgressFn that adds up the wall time of each stage label (until the next label reports)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._label: str | None = None
        self._since = time.perf_counter()

    def __call__(self, what: str | None, done: int = 0, total: int = 0) -> None:
        now = time.perf_counter()
        if self._label is not None:
            self.seconds[self._label] = self.seconds.get(self._label, 0.0) + now - self._since
        self._label, self._since = what, now


def auto(n_layers: list[int], budget: str) -> None:
    import hf_llama

    import remat
    print("| HF Llama layers | warm step s | first remat.auto s | step-equivalents | boundaries |")
    print("|---|---|---|---|---|")
    for n in n_layers:
        wl = hf_llama.build(n_layer=n)
        step_s = warm_step_s(wl)
        clock = StageClock()
        t0 = time.perf_counter()
        handle = remat.auto(wl.model, wl.batch(0), budget=budget, use_cache=False, progress=clock)
        wall = time.perf_counter() - t0
        clock(None)
        print(f"| {n} | {step_s:.3f} | {wall:.1f} | {wall / step_s:.1f} | {len(handle.report.boundaries)} |", flush=True)
        for label, s in clock.seconds.items():
            print(f"|   {label} | | {s:.1f} | {s / step_s:.1f} | |", flush=True)


def plan_gpt(n_layers: list[int], budget: str) -> None:
    """``remat plan`` as its CLI runs it (``plan_from_args``, the library call ``remat plan`` makes), in this
    process, with each progress stage's wall time; imports and the CLI's process start are not counted."""
    import argparse as _argparse
    from remat.cli.cmd_plan import add_parser, plan_from_args
    from remat.workload import load_workload
    print("| gpt n_layer | warm step s | `remat plan` s | step-equivalents | boundaries |")
    print("|---|---|---|---|---|")
    for n in n_layers:
        step_s = warm_step_s(load_workload("gpt", {"n_layer": n}).workload)
        with tempfile.TemporaryDirectory() as out:
            ap = _argparse.ArgumentParser()
            add_parser(ap.add_subparsers())
            args = ap.parse_args(["plan", "--workload", "gpt", "--shape", f"n_layer={n}", "--budget", budget,
                                  "--out", str(Path(out) / "plan.json")])
            clock = StageClock()
            t0 = time.perf_counter()
            _, result = plan_from_args(args, clock)
            wall = time.perf_counter() - t0
            clock(None)
        plan = getattr(result, "plan", result)
        print(f"| {n} | {step_s:.3f} | {wall:.1f} | {wall / step_s:.1f} | {len(plan.boundaries)} |", flush=True)
        for label, s in clock.seconds.items():
            print(f"|   {label} | | {s:.1f} | {s / step_s:.1f} | |", flush=True)


_HIT = """
import sys, time
sys.path.insert(0, {zoo!r})
import torch, hf_llama
wl = hf_llama.build(n_layer={n})
t0 = time.perf_counter()
import remat
t1 = time.perf_counter()
h = remat.auto(wl.model, wl.batch(0), budget="60%", cache_dir={cache!r})
t2 = time.perf_counter()
print(f"{{t1 - t0:.3f}} {{t2 - t1:.3f}} {{h.report.cache.value}}")
"""


def cache_hit(n: int) -> None:
    print("| process | import remat s | remat.auto s | cache | import + auto s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as cache:
        code = _HIT.format(zoo=str(ROOT / "benchmarks" / "zoo"), n=n, cache=cache)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}   # a user's bytecode cache
        env["PYTHONPATH"] = str(ROOT / "src")
        for i in range(3):
            out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
            imp, call, status = out.stdout.split()[-3:]
            print(f"| {i + 1} | {imp} | {call} | {status} | {float(imp) + float(call):.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["planner", "auto", "plan-gpt", "cache-hit"])
    ap.add_argument("--n-layer", type=int, action="append", help="model depth (repeatable)")
    ap.add_argument("--budget", default="60%")
    args = ap.parse_args()
    if args.what == "planner":
        planner()
    elif args.what == "auto":
        auto(args.n_layer or [8], args.budget)
    elif args.what == "plan-gpt":
        plan_gpt(args.n_layer or [32], args.budget)
    else:
        cache_hit((args.n_layer or [2])[0])


if __name__ == "__main__":
    main()
