"""How far the *unplanned* step's gradients move between eager and torch.compile (issue 16's noise floor).

Two correct programs, one seed: the workload's step run eagerly and compiled (inductor), two steps
(forward, backward, optimizer), and per parameter max|g_eager - g_compiled| / max|g_eager|. Where
this is above verify's compiled tolerance (float32 rtol 1e-4), no compiled plan can be told apart
from its compiled control at that tolerance (RESULTS.md, "torch.compile on the zoo": tv_resnet50).

    .venv/bin/python benchmarks/compile_noise.py benchmarks/zoo/tv_resnet50.py:build
Prints one JSON object: per step the median, the worst three parameters and their relative differences.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from remat.workload import load_workload
from remat.workload.contract import TrainingStep


def gradients(spec: str, compiled: bool, steps: int) -> list[dict[str, torch.Tensor]]:
    loaded = load_workload(spec, {})
    torch.manual_seed(0)
    model = loaded.workload.model
    if compiled:
        model.compile()
    step = TrainingStep(loaded.workload)
    out = []
    for k in range(steps):
        step.optimizer.zero_grad(set_to_none=True)
        step.backward(step.forward(step.batch(k)))
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        step.optimizer_step()
    return out


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "benchmarks/zoo/tv_resnet50.py:build"
    eager, compiled = gradients(spec, False, 2), gradients(spec, True, 2)
    rows = []
    for k, (e, c) in enumerate(zip(eager, compiled)):
        rel = sorted((float((e[n] - c[n]).abs().max() / e[n].abs().max().clamp_min(1e-30)), n) for n in e)
        rows.append({"step": k, "median_rel": statistics.median(r for r, _ in rel),
                     "worst": [{"param": n, "rel": r} for r, n in rel[-3:]]})
    print(json.dumps({"workload": spec, "torch": torch.__version__, "steps": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
