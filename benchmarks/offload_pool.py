"""The host buffer pool's effect on offload copies (NOTE [host buffer pool] in remat/wrap/offload.py).

Two measurements on the CPU (the GPU's is ``offload_pool`` in ``benchmarks/gpu_check.py``):

1. ``copies``: the device -> host copy of one step's saved tensors (``--tensors`` of ``--mib`` MiB
   each) into host buffers taken from a pool that reuses them, against one that allocates a
   buffer per saved tensor (``HostPool(reuse=False)``, the behaviour before the pool), interleaved
   round by round; p50 ms per step's copies and the bandwidth that gives.
2. ``step``: a training step whose every block is offloaded (forward + backward), pool on
   against pool off, interleaved; p50 ms, and the host allocations per step.

    PYTHONPATH=src python benchmarks/offload_pool.py            # prints a Markdown table
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from remat.clock import p50
from remat.plan import Plan
from remat.plan.model import Boundary
from remat.profile.fingerprint import fingerprint
from remat.types import CheckpointMode
from remat.wrap import apply
from remat.wrap.offload import HostPool, _RegionOffload


def _copy_round(pool: HostPool, tensors: list[torch.Tensor]) -> float:
    """ms to pack (copy to host buffers) every tensor, as one offloaded region's forward does; then released."""
    region = _RegionOffload(pool, set())
    t0 = time.perf_counter()
    packed = [region.pack(t) for t in tensors]
    ms = (time.perf_counter() - t0) * 1e3
    del packed   # autograd frees the handles after backward: the buffers go back to the pool
    return ms


def bench_copies(n: int, mib: int, rounds: int) -> dict[str, float]:
    tensors = [torch.randn(mib * 2 ** 20 // 4) for _ in range(n)]
    pools = {"pool": HostPool(), "per-tensor": HostPool(reuse=False)}
    times: dict[str, list[float]] = {k: [] for k in pools}
    for name, pool in pools.items():   # one warm-up round each
        _copy_round(pool, tensors)
    for _ in range(rounds):
        for name, pool in pools.items():
            times[name].append(_copy_round(pool, tensors))
    nbytes = n * mib * 2 ** 20
    out = {}
    for name in pools:
        ms = p50(times[name])
        out[f"{name} ms"] = ms
        out[f"{name} GB/s"] = nbytes / ms / 1e6
        out[f"{name} allocations"] = pools[name].allocations
    return out


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def _offloaded(n_blocks: int, d: int, h: int, reuse: bool) -> tuple[nn.Module, HostPool]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(d, h) for _ in range(n_blocks)])
    plan = Plan(planner="all", budget_bytes=None, reserve=0.0,
                boundaries=[Boundary(module=str(i), mode=CheckpointMode.OFFLOAD, saved_bytes=0, replay_ms=0.0)
                            for i in range(n_blocks)],
                excluded=[], predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=0,
                baseline_step_ms=0.0, fingerprint=fingerprint(model))
    handle = apply(model, plan)
    handle.host_pool.reuse = reuse
    return model, handle.host_pool


def bench_step(batch: int, d: int, h: int, n_blocks: int, rounds: int) -> dict[str, float]:
    arms = {"pool": _offloaded(n_blocks, d, h, True), "per-tensor": _offloaded(n_blocks, d, h, False)}
    x = torch.randn(batch, d)
    times: dict[str, list[float]] = {k: [] for k in arms}

    def step(model: nn.Module) -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        return (time.perf_counter() - t0) * 1e3
    for model, _ in arms.values():
        step(model)
    allocs = {k: pool.allocations for k, (_, pool) in arms.items()}
    for _ in range(rounds):
        for name, (model, _) in arms.items():
            times[name].append(step(model))
    out = {}
    for name, (_, pool) in arms.items():
        out[f"{name} ms"] = p50(times[name])
        out[f"{name} allocations/step"] = (pool.allocations - allocs[name]) / rounds
        out[f"{name} host MiB/step"] = pool.peak_bytes / 2 ** 20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--mib", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    c = bench_copies(args.tensors, args.mib, args.rounds)
    s = bench_step(batch=1024, d=256, h=1024, n_blocks=6, rounds=args.rounds)
    print(f"torch {torch.__version__}, {args.threads} thread(s), p50 of {args.rounds} interleaved rounds")
    print("| measurement | pooled (reused buffers) | per saved tensor (no reuse) | pooled / per tensor |")
    print("|---|---|---|---|")
    print(f"| copies: {args.tensors} x {args.mib} MiB to host, ms | {c['pool ms']:.2f} | {c['per-tensor ms']:.2f} | "
          f"{c['pool ms'] / c['per-tensor ms']:.2f} |")
    print(f"| copies: bandwidth, GB/s | {c['pool GB/s']:.2f} | {c['per-tensor GB/s']:.2f} | |")
    print(f"| copies: host buffers allocated (all rounds) | {c['pool allocations']} | {c['per-tensor allocations']} | |")
    print(f"| step (6 offloaded blocks, batch 1024 x 256, hidden 1024), ms | {s['pool ms']:.1f} | "
          f"{s['per-tensor ms']:.1f} | {s['pool ms'] / s['per-tensor ms']:.2f} |")
    print(f"| step: host buffers allocated per step | {s['pool allocations/step']:.0f} | "
          f"{s['per-tensor allocations/step']:.0f} | |")
    print(f"| step: host bytes held at peak, MiB | {s['pool host MiB/step']:.1f} | {s['per-tensor host MiB/step']:.1f} | |")


if __name__ == "__main__":
    main()
