"""Fresh torchrun launches of remat.auto jobs, counted: how many run to the end with one plan digest on
every rank (NOTE [dry runs in a job] in src/remat/profile/shared.py, NOTE [job faults] in
src/remat/autoplan/job.py).

    python benchmarks/job_launches.py --job fsdp2 --nproc 2 --launches 20 [--one-core]

``--job fsdp2``: examples/auto_fsdp2.py --no-cache; ``--job llama``: benchmarks/llama_job.py (torchtitan's
order: FSDP2 per block, then the root). ``--one-core`` pins every rank to CPU 0 (``taskset -c 0``): the
ranks then share one core, so their timings differ launch to launch (run it beside other work).
Prints one line per launch and the count; ``--json`` writes them; ``--src`` runs another revision's remat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"fsdp2": [str(ROOT / "examples" / "auto_fsdp2.py"), "--no-cache", "--out"],
        "llama": [str(ROOT / "benchmarks" / "llama_job.py")]}


def launch(job: str, nproc: int, one_core: bool, src: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*(["taskset", "-c", "0"] if one_core else []), sys.executable, "-m", "torch.distributed.run",
               "--standalone", "--nproc-per-node", str(nproc), *JOBS[job], tmp]
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        t0 = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    digests = {r["plan_digest"] for r in ranks}
    ok = proc.returncode == 0 and len(ranks) == nproc and len(digests) == 1
    tail = "" if ok else (proc.stderr.strip().splitlines() or [""])[-1][:200]
    return {"ok": ok, "rc": proc.returncode, "ranks": len(ranks), "digests": len(digests),
            "seconds": round(time.monotonic() - t0, 1), "error": tail}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", choices=sorted(JOBS), default="fsdp2")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--one-core", action="store_true")
    ap.add_argument("--src", type=Path, default=ROOT / "src",
                    help="remat's source to run (e.g. an older revision's, from `git archive REV src`)")
    ap.add_argument("--json")
    a = ap.parse_args()
    runs = []
    for i in range(a.launches):
        r = launch(a.job, a.nproc, a.one_core, a.src)
        runs.append(r)
        print(f"{a.job} x{a.nproc} launch {i + 1}: {'ok' if r['ok'] else 'FAILED'} rc={r['rc']} "
              f"ranks={r['ranks']} digests={r['digests']} {r['seconds']} s {r['error']}", flush=True)
    print(f"{a.job} x{a.nproc}{' one core' if a.one_core else ''}: {sum(r['ok'] for r in runs)} of {len(runs)} "
          "launches ran to the end with one digest")
    if a.json:
        Path(a.json).write_text(json.dumps({"job": a.job, "nproc": a.nproc, "one_core": a.one_core, "runs": runs}))


if __name__ == "__main__":
    main()
