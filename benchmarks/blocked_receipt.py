"""Issue 40's receipt figures: ``remat receipt --device-memory`` on a step that does not fit, and ``remat check``.

For each model (the built-in GPT, the built-in ResNet with BatchNorm, the zoo's Hugging Face Llama) and
each ratio R (the unplanned step's warm peak, remat's CPU live-tensor count, over the capacity):

- ``remat receipt --device-memory <capacity>`` (no budget: fit the device), with its wall time and exit code;
  what it records: the refused allocation, the batches profiled, the verified batch, the shipped plan,
  its measured peak and whether equivalence passed (NOTE [blocked receipt]);
- ``remat check`` on that receipt (both shapes re-run under the capacity): its exit code and wall time;
- the negative control of the gate: ``remat check --device-memory`` 4 MiB under the shipped peak must fail;
- ``--steps`` training steps of a fresh build with the shipped plan applied (``remat.apply``), batches 1..N,
  each under the enforced capacity and measured by torch.profiler: the worst over the capacity.

    PYTHONPATH=src python benchmarks/blocked_receipt.py --ratio 1.6 --ratio 3 --steps 20 --out results.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from fixtures.blocked_models import profiler_step_peak, train_step  # noqa: E402

import remat  # noqa: E402
from remat.closed_loop import measure_plan  # noqa: E402
from remat.receipt import load_receipt  # noqa: E402
from remat.workload import load_workload  # noqa: E402

MiB = 2 ** 20
MODELS = {   # name -> (workload spec, target shape)
    "gpt": ("gpt", "batch_size=32,seq_len=128,n_layer=4,d_model=128,n_head=4,vocab=512,dropout=0.0"),
    "cnn": ("cnn", "batch_size=64,image_size=32,width=32"),
    "hf_llama": (str(ROOT / "benchmarks/zoo/hf_llama.py") + ":build", "batch_size=16,seq_len=128"),
}


def _shape(text: str) -> dict:
    from remat.workload import parse_shape
    return parse_shape(text)


def _remat(*args: str) -> tuple[int, float, str]:
    """(exit code, wall seconds, last lines of output) of one remat command, in a fresh process."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "remat", *args], capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    return p.returncode, time.perf_counter() - t, "\n".join((p.stdout + p.stderr).splitlines()[-6:])


def later_steps(spec: str, shape: dict, plan: remat.Plan, capacity: int, steps: int) -> list[int]:
    """torch.profiler peaks of steps 1..N of a fresh build with ``plan`` applied, under the enforced capacity."""
    wl = load_workload(spec, shape).workload
    remat.apply(wl.model, plan)
    opt = (wl.optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(wl.model.parameters())
    peaks = []
    with remat.CpuCapacity(capacity, wl.model, opt):
        for i in range(1, steps + 1):
            peaks.append(profiler_step_peak(wl.model, opt, wl.batch(i), wl.loss))
    return peaks


def run(name: str, ratio: float, steps: int, out: Path) -> dict:
    spec, shape_text = MODELS[name]
    shape = _shape(shape_text)
    unplanned = measure_plan(load_workload(spec, shape), None, steps=0).peak_bytes
    capacity = int(unplanned / ratio)
    row: dict = {"model": name, "ratio": ratio, "unplanned_bytes": unplanned, "capacity_bytes": capacity}
    folder = out / f"{name}-{ratio:g}"
    rc, secs, tail = _remat("receipt", "--workload", spec, "--shape", shape_text, "--device-memory", str(capacity),
                            "--out", str(folder))
    row.update(receipt_rc=rc, receipt_seconds=secs)
    if rc != 0:
        row["receipt_said"] = tail
        return row
    r = load_receipt(folder / "receipt.json")
    blocked = r.blocked
    row.update(blocked=None if blocked is None else blocked.describe(), shipped=r.decision.shipped,
               boundaries=len(r.decision.boundaries), shipped_peak_over_capacity=r.decision.shipped_peak_bytes / capacity,
               verified=r.verification.passed if r.verification else None,
               verified_batch=None if blocked is None else blocked.verified_batch)
    # a file workload is named to check explicitly: its spec is a path, which the check's policy never takes from
    # the receipt (NOTE [workload spec policy])
    named = ("--workload", spec)
    rc, secs, tail = _remat("check", str(folder / "receipt.json"), *named)
    row.update(check_rc=rc, check_seconds=secs)
    smaller = str(r.decision.shipped_peak_bytes - 4 * MiB)
    rc, _, tail = _remat("check", str(folder / "receipt.json"), *named, "--device-memory", smaller, "--budget", smaller)
    row.update(check_smaller_device_rc=rc)
    assert r.plan.plan is not None
    peaks = later_steps(spec, shape, r.plan.plan, capacity, steps)
    row.update(steps=len(peaks), worst_later_peak_over_capacity=max(peaks) / capacity)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, action="append", help="unplanned peak over the capacity (repeatable)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work", type=Path, default=Path("out/blocked-receipts"), help="where the receipts go")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("models", nargs="*", default=list(MODELS))
    args = ap.parse_args()
    rows = []
    for ratio in args.ratio or [1.6]:
        for name in args.models:
            row = run(name, ratio, args.steps, args.work)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
