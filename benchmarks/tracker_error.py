"""How far the CPU live-tensor tracker reads under torch.profiler's allocator events, per step kind.

    .venv/bin/python benchmarks/tracker_error.py

Whole warm steps, unplanned and with every block of the model's longest block list checkpointed
(torch.utils.checkpoint, non-reentrant), each read by both instruments on the same build:
tracker / profiler - 1. The figures are NOTE [peaks at the edge] (src/remat/memory/reference.py).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.measure import Arm
from remat.measure.run import prepare_arm, warm_up
from remat.memory import measure_step_peak, profiler_step_peak
from remat.workload import load_workload

TINY_GPT = {"batch_size": 2, "seq_len": 16, "n_layer": 2, "d_model": 32, "n_head": 2, "vocab": 64}
CASES = [("gpt", {**TINY_GPT, "batch_size": 4, "seq_len": 64}), ("gpt", TINY_GPT),
         ("mlp", {"batch_size": 8, "width": 32, "depth": 4, "d_in": 8}),
         ("cnn", {"batch_size": 4, "image_size": 8, "width": 8, "blocks_per_stage": 1}), ("cnn", {}), ("gpt", {})]


class EveryBlock(Arm):
    """Every block of the model's longest ModuleList / Sequential checkpointed."""

    def prepare(self, fresh):  # noqa: ANN001, ANN201
        lists = [m for m in fresh.workload.model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
        for block in max(lists, key=len):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        return None


def main() -> None:
    for spec, shape in CASES:
        loaded = load_workload(spec, shape)
        for arm in (Arm("unplanned"), EveryBlock("every block")):
            prepared = prepare_arm(loaded, arm)
            warm_up(prepared.step, 2)
            tracked = measure_step_peak(prepared.step, 2).peak_bytes
            profiled = profiler_step_peak(prepared.step, 3)
            prepared.close()
            print(f"{spec} {shape} {arm.label}: tracker {tracked} B, profiler {profiled} B, "
                  f"tracker/profiler - 1 = {tracked / profiled - 1:+.3%}", flush=True)


if __name__ == "__main__":
    main()
