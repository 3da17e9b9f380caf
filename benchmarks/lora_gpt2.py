"""A LoRA GPT-2 fine-tune step: remat.auto at a budget against gradient_checkpointing_enable() (issue 15).

Three arms on fresh models with the same init and the same batches: no checkpointing, Hugging
Face's ``gradient_checkpointing_enable()`` (non-reentrant, every block), and ``remat.auto`` at each
budget (``gc``: a budget whose effective part, less remat's 5% reserve, is the measured peak of the
Hugging Face arm: the same memory, at what cost?; or
``70%`` of the unplanned peak, or bytes). Peaks are measured with one arm resident at a time
(NOTE [solo peaks]); step times interleaved round-robin with all arms resident, order rotated
each round, warm steps only, device-correct clock (remat.clock). The first step's loss of every
arm is compared with the unplanned arm's (same seed).

    python benchmarks/lora_gpt2.py --size small --device cuda --out benchmarks/results/lora_gpt2.json
    python benchmarks/lora_gpt2.py --size tiny --device cpu          # the same code, seconds on a CPU
"""

from __future__ import annotations

import argparse
import gc
import math
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "examples"), str(ROOT / "benchmarks" / "zoo")]

import remat  # noqa: E402
from remat.clock import StepClock  # noqa: E402
from remat.units import fmt_bytes  # noqa: E402

SIZES = {"tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, batch=4, seq=64),
         "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, batch=8, seq=1024)}


def import_hf():
    try:
        from _torchvision_cpu import import_torchvision   # only where torchvision's wheel does not match torch
        import_torchvision()
    except ImportError:
        pass
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    return LoraConfig, get_peft_model, GPT2Config, GPT2LMHeadModel


def build(size: str, device: str, seed: int = 0):
    LoraConfig, get_peft_model, GPT2Config, GPT2LMHeadModel = import_hf()
    c = SIZES[size]
    cfg = GPT2Config(n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"], vocab_size=c["vocab_size"],
                     n_positions=max(c["seq"], 64), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    # use_cache=False in every arm: gradient_checkpointing_enable() forces it, and with the default
    # (True) each layer's keys and values are returned and held to the end of the step (~1 GiB at
    # GPT-2 small, batch 8 x 1024), which no checkpoint can free: compare like with like
    cfg.use_cache = False
    model = get_peft_model(GPT2LMHeadModel(cfg), LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                                            fan_in_fan_out=True, lora_dropout=0.05)).to(device)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def batch_for(size: str, device: str, step: int) -> dict:
    c = SIZES[size]
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, c["vocab_size"], (c["batch"], c["seq"]), generator=g).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class Arm:
    def __init__(self, name: str, size: str, device: str, budget=None, cache: str | None = None) -> None:
        self.name, self.size, self.device = name, size, device
        self.model, self.opt = build(size, device)
        self.report = None
        if name == "hf-gradient-checkpointing":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif name.startswith("remat"):
            h = remat.auto(self.model, batch_for(size, device, 0), budget=budget, optimizer=self.opt,
                           cache_dir=cache, measure_replays=False)
            self.report = h.report

    def step(self, i: int) -> float:
        loss = self.model(**batch_for(self.size, self.device, i)).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def solo_peak(arm: Arm) -> tuple[int, float]:
    """(peak bytes of one warm step, that step's loss): CUDA allocator, or remat's CPU tracker."""
    for i in range(2):
        arm.step(i)
    if arm.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = arm.step(2)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), loss
    from remat.memory.measure import measure_step_peak
    from remat.workload import TrainingStep, Workload
    step = TrainingStep(Workload(model=arm.model, batch=lambda i: batch_for(arm.size, arm.device, i),
                                 loss=lambda m, b: m(**b).loss))
    step.optimizer = arm.opt
    m = measure_step_peak(step, 2)
    return m.peak_bytes, m.loss


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budgets", default="gc,70%", help="comma list: gc (the HF arm's peak), N%%, or bytes")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)
    cache = tempfile.mkdtemp(prefix="remat-bench-")
    peaks, losses, reports, plan_s = {}, {}, {}, {}
    for name in ("none", "hf-gradient-checkpointing"):
        arm = Arm(name, a.size, a.device)
        peaks[name], losses[name] = solo_peak(arm)
        del arm
        free()
    budgets = {}
    for b in a.budgets.split(","):
        # gc: the budget whose effective part (less remat's default 5% reserve) is the HF arm's peak
        budgets[f"remat@{b}"] = math.ceil(peaks["hf-gradient-checkpointing"] / 0.95) if b == "gc" else b
    refused = {}
    for name, budget in list(budgets.items()):
        t0 = time.perf_counter()
        try:
            arm = Arm(name, a.size, a.device, budget, cache)
        except remat.BudgetError as exc:   # a budget under remat's floor: say so, measure the rest
            refused[name] = exc.message
            del budgets[name]
            free()
            continue
        plan_s[name] = time.perf_counter() - t0
        reports[name] = arm.report
        peaks[name], losses[name] = solo_peak(arm)
        del arm
        free()

    # interleaved timing: every arm resident (remat arms from the plan cache), rotated order
    arms = [Arm("none", a.size, a.device), Arm("hf-gradient-checkpointing", a.size, a.device)]
    arms += [Arm(n, a.size, a.device, b, cache) for n, b in budgets.items()]
    clock = StepClock(torch.device(a.device))
    times: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for r in range(a.warmup + a.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            _, ms = clock.time(arm.step, r)
            if r >= a.warmup:
                times[arm.name].append(ms)
    p50 = {n: statistics.median(t) for n, t in times.items()}
    rows = []
    for n in times:
        rep = reports.get(n)
        rows.append({"arm": n, "peak_bytes": peaks[n], "p50_ms": p50[n], "overhead": p50[n] / p50["none"] - 1.0,
                     "first_loss": losses[n], "loss_equal_to_none": losses[n] == losses["none"],
                     "budget_bytes": rep.budget_bytes if rep else None,
                     "boundaries": list(rep.boundaries) if rep else None,
                     "predicted_peak_bytes": rep.predicted_peak_bytes if rep else None,
                     "auto_measured_peak_bytes": rep.measured_peak_bytes if rep else None,
                     "plan_seconds": plan_s.get(n)})
    meta = {"size": a.size, "shape": SIZES[a.size], "device": a.device,
            "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "rounds": a.rounds, "warmup": a.warmup,
            "memory_source": "cuda-allocator" if a.device.startswith("cuda") else "cpu-live-tensors"}
    def n_boundaries(row: dict) -> str:
        if row["boundaries"] is not None:
            return str(len(row["boundaries"]))
        return f"all {SIZES[a.size]['n_layer']} blocks" if row["arm"].startswith("hf") else "0"

    print(f"LoRA GPT-2 ({a.size}: {SIZES[a.size]}) on {meta['device_name']}, torch {torch.__version__}, "
          f"{a.rounds} interleaved rounds")
    print("| arm | peak | vs none | step p50 (ms) | overhead | budget | boundaries | first loss = none |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {fmt_bytes(row['peak_bytes'])} | {row['peak_bytes'] / peaks['none']:.2f}x | "
              f"{row['p50_ms']:.2f} | {row['overhead'] * 100:+.1f}% | "
              f"{fmt_bytes(row['budget_bytes']) if row['budget_bytes'] else '-'} | "
              f"{n_boundaries(row)} | "
              f"{row['loss_equal_to_none']} |")
    for row in rows:
        if row["boundaries"]:
            print(f"{row['arm']}: plan {row['plan_seconds']:.1f} s; {', '.join(row['boundaries'])}")
    for name, why in refused.items():
        print(f"{name}: refused: {why}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows, "refused": refused}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
