"""A segment whose input waits in host memory (mode ``full-host-input``; NOTE [segment input on the host]
in remat/wrap/offload.py), against the same segment in ``full``, on the CPU.

The model is ``tests/test_offload_segment.py``'s at larger sizes: ``--blocks`` linked blocks
(Linear(D, D) -> GELU, or ReLU for block 1 with ``--relu``: the case where the input stays on the
device because ReLU saves it) and a head Linear(D, V). The segment is ``blocks[2:4]``; its input is
block 1's output, (B, D) float32.

1. ``bytes``: live device bytes at the end of the forward and the whole-step peak (the live-tensor
   tracker), the host pool's peak, for the unplanned step, ``full`` and ``full-host-input``.
2. ``time``: the three steps (forward + backward, no optimizer) interleaved round by round, p50 ms;
   the added time of ``full-host-input`` over ``full`` against the cost model's price of the copies at
   this machine's measured bandwidth (NOTE [link bandwidth]), and the input's round trip alone (the
   wrapper's offload + load, p50 of 50), which a shared machine's step noise would otherwise hide.

    PYTHONPATH=src python benchmarks/segment_input.py [--relu]    # prints a Markdown table
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from remat.clock import p50
from remat.memory.tracker import LiveTensorTracker
from remat.plan import Plan
from remat.plan.model import Boundary
from remat.plan.offload import measured_pricing
from remat.profile.fingerprint import fingerprint
from remat.types import CheckpointMode, MemCategory
from remat.wrap import apply

SEGMENT = "blocks[2:4]"


def _model(n: int, d: int, v: int, relu: bool) -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU() if relu and i == 1 else nn.GELU())
                             for i in range(n)])
    return nn.Sequential(blocks, nn.Linear(d, v))


def _planned(args: argparse.Namespace, mode: CheckpointMode | None):
    model = _model(args.blocks, args.width, args.head, args.relu)
    # the Sequential root names its children "0" (the blocks) and "1" (the head)
    segment = SEGMENT.replace("blocks", "0")
    boundaries = [] if mode is None else [Boundary(module=segment, mode=mode, saved_bytes=0, replay_ms=0.0)]
    plan = Plan(planner="all", budget_bytes=None, reserve=0.0, boundaries=boundaries, excluded=[],
                predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=0, baseline_step_ms=0.0,
                fingerprint=fingerprint(model))
    return model, apply(model, plan)


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)


def bench_bytes(args: argparse.Namespace, x: torch.Tensor) -> dict[str, dict[str, int]]:
    out = {}
    for label, mode in (("unplanned", None), ("full", CheckpointMode.FULL),
                        ("full-host-input", CheckpointMode.FULL_HOST_INPUT)):
        model, handle = _planned(args, mode)
        _step(model, x)   # warm: the pool's buffer exists from here on
        handle.host_pool.reset_peak()
        with LiveTensorTracker() as t:
            t.track(model.parameters(), MemCategory.PARAMETERS)
            t.track([x], MemCategory.BATCH)
            loss = model(x).square().mean()
            fwd_end = t.live_bytes
            loss.backward()
        out[label] = {"fwd_end": fwd_end, "peak": t.peak_bytes, "host": handle.host_pool.peak_bytes}
    return out


def bench_time(args: argparse.Namespace, x: torch.Tensor) -> dict[str, float]:
    arms = {label: _planned(args, mode)[0] for label, mode in
            (("unplanned", None), ("full", CheckpointMode.FULL), ("full-host-input", CheckpointMode.FULL_HOST_INPUT))}
    for model in arms.values():
        _step(model, x)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.rounds):
        for label, model in arms.items():
            t0 = time.perf_counter()
            _step(model, x)
            times[label].append((time.perf_counter() - t0) * 1e3)
    return {k: p50(v) for k, v in times.items()}


def bench_copies(args: argparse.Namespace, rounds: int = 50) -> float:
    """p50 ms of one input's round trip as the wrapper makes it: to a pooled host buffer and back
    (``HostInput.offload`` then ``load``), the added work of ``full-host-input`` over ``full``."""
    from remat.wrap.offload import HostInput, HostPool, _RegionOffload
    x = torch.randn(args.batch, args.width)
    pool, times = HostPool(), []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        box = HostInput(x, _RegionOffload(pool, set()))
        box.offload()
        box.load()
        if i:   # the first round allocates the pool's buffer
            times.append((time.perf_counter() - t0) * 1e3)
        del box
    return p50(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--head", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--relu", action="store_true", help="block 1 ends in ReLU, which holds the segment's input")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    input_bytes = args.batch * args.width * 4
    b = bench_bytes(args, x)
    print(f"segment {SEGMENT}, input {input_bytes} bytes (hand count: {args.batch} x {args.width} x 4)"
          + (", block 1 ends in ReLU" if args.relu else ""))
    print("\n| arm | live at end of forward, bytes | whole-step peak, bytes | host pool peak, bytes |")
    print("|---|---|---|---|")
    for label, r in b.items():
        print(f"| {label} | {r['fwd_end']:,} | {r['peak']:,} | {r['host']:,} |")
    print(f"\nfull - full-host-input at the end of the forward: {b['full']['fwd_end'] - b['full-host-input']['fwd_end']:,} bytes; "
          f"whole-step peak: {b['full']['peak'] - b['full-host-input']['peak']:,} bytes")
    t = bench_time(args, x)
    pricing = measured_pricing("cpu")
    priced = pricing.added_ms(input_bytes, 0.0)
    print(f"\n| arm | step p50 ms ({args.rounds} interleaved rounds, forward + backward) |")
    print("|---|---|")
    for label, ms in t.items():
        print(f"| {label} | {ms:.1f} |")
    copies = bench_copies(args)
    print(f"\none input's round trip to the host and back (offload + load, pooled buffer, p50 of 50): {copies:.2f} ms")
    print(f"\nfull-host-input - full: {t['full-host-input'] - t['full']:+.2f} ms; the cost model prices the copies at "
          f"{priced:.2f} ms ({pricing.d2h_bytes_per_ms / 1e6:.2f} GB/s to the host, "
          f"{pricing.h2d_bytes_per_ms / 1e6:.2f} GB/s back, {pricing.source})")


if __name__ == "__main__":
    main()
