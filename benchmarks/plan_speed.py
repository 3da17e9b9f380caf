"""Planning time of the optimal planner on 100 candidates (issue 3 goal: under 1 s).

    .venv/bin/python benchmarks/plan_speed.py

Synthetic reports from the test suite's generator: 25 blocks x (block + 3 children) = 100
candidates x 2 modes, 200 peak rows, and a flat 100-block chain; budgets from loose to near
the floor. CPU time of this process (HiGHS single-threaded), median of 3.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat.plan import make_plan  # noqa: E402
from tests.test_plan import chain_report  # noqa: E402


def main() -> None:
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


if __name__ == "__main__":
    main()
