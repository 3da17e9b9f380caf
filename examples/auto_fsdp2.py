"""remat.auto in a torchrun job, after FSDP2's ``fully_shard`` (or DDP): the budget is per device.

    torchrun --nproc-per-node 2 examples/auto_fsdp2.py                  # FSDP2 per block, budget 60%
    torchrun --nproc-per-node 2 examples/auto_fsdp2.py --engine ddp     # DDP
    torchrun --nproc-per-node 2 examples/auto_fsdp2.py --no-plan        # the same job without remat

``remat.auto`` goes after the wrapping, inside the initialised process group: every rank profiles the
step as the job runs it (sharded parameters, gradients and optimizer state, all-gathers,
reduce-scatters, DDP's buckets), the ranks reduce what they measured and agree on one plan, and every
rank applies it (``report.plan_digest`` is the same on every rank). ``--out DIR`` writes one JSON per
rank: the losses, the plan digest and the step's peak read by torch.profiler, which
tests/test_examples.py compares with the same job run ``--no-plan``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import remat
from auto_plain_loop import TinyLM, loss_fn

# activations dominate at these shapes (a job plans per device: a shard of the weights, all of the activations)
SIZES = {"tiny": dict(vocab=64, d=32, layers=2, batch=8, seq=64),     # the test's (at 75%: 60% is below its floor)
         "base": dict(vocab=64, d=32, layers=4, batch=8, seq=64),
         "small": dict(vocab=1024, d=256, layers=6, batch=8, seq=256)}


def shard(model: TinyLM, engine: str, granularity: str) -> nn.Module:
    """FSDP2 per block (``block``) or per block's sub-module (``module``: attention, MLP), then the root; or DDP."""
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        for unit in ([block] if granularity == "block" else [block.attn, block.mlp]):
            fully_shard(unit)
    fully_shard(model)
    return model


def step_peak_bytes(model: nn.Module, opt: torch.optim.Optimizer, batch) -> tuple[float, int]:
    """One training step; its loss and peak bytes: what is live at its start (this rank's parameter shards,
    gradients, optimizer state, counted by hand) plus the peak of torch.profiler's allocator events in it."""
    from remat.memory import profiler_memory_peak
    local = [getattr(t, "_local_tensor", t) for t in (*model.parameters(), *model.buffers(),
                                                     *(v for s in opt.state.values() for v in s.values()))
             if isinstance(t, torch.Tensor)]
    start = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in local}.values())
    out: dict[str, float] = {}
    peak = profiler_memory_peak(lambda: out.setdefault("loss", train_step(model, opt, batch)))
    return out["loss"], start + peak.peak_delta_bytes


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> float:
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def main(size: str = "tiny", steps: int = 3, budget: str = "60%", plan: bool = True, engine: str = "fsdp2",
         granularity: str = "block", seed: int = 0, **auto_kwargs) -> dict:
    rank = dist.get_rank()
    cfg = SIZES[size]
    torch.manual_seed(seed)                       # the same initial weights on every rank
    model = shard(TinyLM(cfg["vocab"], cfg["d"], cfg["layers"]), engine, granularity)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed * 1000 + rank)   # each rank its own data
    tokens = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(steps)]
    batches = [(b[:, :-1], b[:, 1:]) for b in tokens]
    torch.manual_seed(seed + rank)                # dropout: a stream per rank, as a job would have

    report = None
    if plan:   # after fully_shard / DDP, before the loop; the budget is per device
        report = remat.auto(model, batches[0], budget=budget, loss_fn=loss_fn, optimizer=opt, **auto_kwargs).report
    losses, peaks = [], []
    for batch in batches:
        loss, peak = step_peak_bytes(model, opt, batch)
        losses.append(loss)
        peaks.append(peak)
    return {"rank": rank, "world_size": dist.get_world_size(), "engine": engine, "losses": losses,
            "peak_bytes": max(peaks[1:] or peaks),   # warm steps: the optimizer state exists
            "plan_digest": report.plan_digest if report else None,
            "boundaries": list(report.boundaries) if report else None,
            "budget_bytes": report.budget_bytes if report else None,
            "measured_peak_bytes": report.measured_peak_bytes if report else None,   # remat's, the fullest rank's
            "baseline_peak_bytes": report.baseline_peak_bytes if report else None,
            "memory_source": report.memory_source if report else None,
            "summary": report.summary() if report else None}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="fsdp2", choices=["fsdp2", "ddp"])
    ap.add_argument("--shard", default="block", choices=["block", "module"],
                    help="FSDP2 units: each block, or each block's attention and MLP")
    ap.add_argument("--size", default="base", choices=sorted(SIZES))
    ap.add_argument("--budget", default="60%")
    ap.add_argument("--no-plan", action="store_true")
    ap.add_argument("--no-cache", action="store_true", help="plan afresh (use_cache=False)")
    ap.add_argument("--out", help="a directory for one JSON per rank")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    try:
        res = main(a.size, budget=a.budget, plan=not a.no_plan, engine=a.engine, granularity=a.shard,
                   use_cache=not a.no_cache, measure_replays=False)
    finally:
        dist.destroy_process_group()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"rank{res['rank']}.json").write_text(json.dumps(res, indent=1))
    if res["rank"] == 0 or os.environ.get("REMAT_EXAMPLE_ALL_RANKS"):
        print(res["summary"] or "no plan", f"\nrank {res['rank']}: losses {res['losses']}, peak {res['peak_bytes']} B")
