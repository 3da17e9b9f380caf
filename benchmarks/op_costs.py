#!/usr/bin/env python
"""The two per-op figures of the ``cpu`` device model that no FLOP or byte count holds (src/remat/simulate/
devices.py): NOTE [attention scores] and NOTE [SAC op cost]. One CPU thread, min over interleaved rounds.

1. Attention: CPU flash attention (``scaled_dot_product_attention``) at the diffusers UNet's shapes (heads of
   dim 4 and 8, as the zoo's UNet runs them) and at wide heads; per shape its GFLOP/s, and the time per query x key
   score beyond its FLOPs at the model's fp32 peak: (ms - FLOPs / peak) / scores.
2. SAC: a region of N tiny pointwise ops (their kernels cost next to nothing), forward + backward, plain and under
   FULL and each op-level mode (remat's own dry-run wrapper), interleaved: (mode - plain) / ops.

    PYTHONPATH=src python benchmarks/op_costs.py > benchmarks/results/op_costs.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.flop_counter import sdpa_flop_count

from remat.profile.dryrun import _wrap
from remat.simulate.devices import DEVICE_MODELS
from remat.types import CheckpointMode

SHAPES = [((2, 8, 1024, 4), (2, 8, 1024, 4)), ((2, 8, 1024, 4), (2, 8, 16, 4)), ((2, 8, 256, 8), (2, 8, 256, 8)),
          ((2, 8, 256, 8), (2, 8, 16, 8)), ((2, 8, 1024, 40), (2, 8, 1024, 40)), ((4, 12, 128, 64), (4, 12, 128, 64)),
          ((2, 8, 64, 160), (2, 8, 64, 160))]
ROUNDS = 9


def best_s(fn, rounds: int = ROUNDS) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def attention() -> list[dict]:
    peak = DEVICE_MODELS["cpu"].peak_flops["float32"]
    rows = []
    for qs, ks in SHAPES:
        q, k, v = torch.randn(qs), torch.randn(ks), torch.randn(ks)
        s = best_s(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        scores = qs[0] * qs[1] * qs[2] * ks[2]
        rows.append(dict(q=qs, k=ks, ms=round(s * 1e3, 4), gflops=round(flops / s / 1e9, 1), scores=scores,
                         ns_per_score_beyond_flops=round((s - flops / peak) / scores * 1e9, 3)))
    return rows


class Tiny(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * 1.0001 + 0.0001   # two ops
        return x


def sac(n: int) -> dict[str, float]:
    modes = [None, CheckpointMode.FULL, CheckpointMode.SELECTIVE, CheckpointMode.SAVE_ATTENTION,
             CheckpointMode.RECOMPUTE_POINTWISE]
    arms = {}
    for mode in modes:
        m = Tiny(n)
        if mode is not None:
            _wrap(m, mode)
        arms[mode] = m
    x = torch.randn(16, requires_grad=True)
    times: dict = {mode: [] for mode in modes}
    for _ in range(ROUNDS + 1):
        for mode, m in arms.items():
            t = time.perf_counter()
            m(x).sum().backward()
            times[mode].append(time.perf_counter() - t)
    plain = min(times[None][1:])
    return {mode.value: round((min(times[mode][1:]) - plain) / (2 * n) * 1e6, 2) for mode in modes if mode is not None}


def main() -> int:
    torch.set_num_threads(1)
    out = dict(command=" ".join(sys.argv), torch=torch.__version__, load=os.getloadavg(),
               attention=attention(), sac_us_per_op={str(n): sac(n) for n in (50, 200)})
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
