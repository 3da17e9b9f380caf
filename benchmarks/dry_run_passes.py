"""Dry-run passes: how many forward + backward passes the mode dry runs take, with the failed passes
narrowed down as ``remat`` does (NOTE [suspect first] in ``src/remat/profile/dryrun.py``) against each
entry of a failed pass retried alone (the rule before suspect-first retries), on the built-in gpt.

    PYTHONPATH=src .venv/bin/python benchmarks/dry_run_passes.py --n-layer 8 32
    PYTHONPATH=src .venv/bin/python benchmarks/dry_run_passes.py --tiny --n-layer 4 --forward-times split

``--forward-times``: ``profiled`` (as a profile reads them), ``agree`` (every identical block in one
group) or ``split`` (every forward-time check disagrees: what noisy sub-ms times of tiny blocks did in
CI, so identical blocks dry-run apart). ``--tiny``: the test suite's tiny gpt sizes. Every candidate
of one profile (segments too) is dry-run by each rule, interleaved, ``--rounds`` times; the failures
each rule finds are printed beside its passes and must be the same.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY_GPT = {"batch_size": 2, "seq_len": 16, "d_model": 32, "n_head": 2, "vocab": 64}   # tests/conftest.py TINY["gpt"]


def _each_alone(runner, assignment, error, kin=None):
    """Every entry of a failed pass retried alone."""
    return [(n, m, e) for n, m in assignment.items() if (e := runner.attempt({n: m})) is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, nargs="+", default=[8])
    p.add_argument("--forward-times", choices=["profiled", "agree", "split"], default="profiled")
    p.add_argument("--tiny", action="store_true", help="the test suite's tiny gpt sizes")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    import remat.profile.shared as shared
    from remat.profile import dryrun, resolve_candidates
    from remat.profile.step import profile_step
    from remat.workload import TrainingStep, load_workload

    if args.forward_times != "profiled":
        agree = args.forward_times == "agree"
        shared.forward_times_agree = lambda a_ms, b_ms: agree
    rules = [("suspect-first", dryrun._isolate), ("each-alone", _each_alone)]
    print("| n_layer | rule | passes | s | failures |\n|---|---|---|---|---|")
    for n in args.n_layer:
        overrides = {**(TINY_GPT if args.tiny else {}), "n_layer": n}
        step = TrainingStep(load_workload("gpt", overrides).workload)
        report = profile_step(step, resolve_candidates(step.workload.model, None), segments=True)
        for _ in range(args.rounds):
            for label, rule in rules:
                dryrun._isolate = rule
                stats: dict = {}
                t0 = time.perf_counter()
                failures = dryrun.dry_run_modes(step, report.candidates, 10, stats=stats)
                wall = time.perf_counter() - t0
                found = sum(len(v) for v in failures.values())
                print(f"| {n} | {label} | {stats['passes']} | {wall:.1f} | {found} |", flush=True)


if __name__ == "__main__":
    main()
