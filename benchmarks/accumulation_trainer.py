"""A Hugging Face Trainer with gradient accumulation and ``RematTrainerCallback``: every optimizer step's
peak by torch.profiler against the plan's budget (NOTE [accumulated step] in src/remat/workload/contract.py).

    python benchmarks/accumulation_trainer.py --accumulation 4 --budget 70% [--steps 12]
    PYTHONPATH=/tmp/old/src python benchmarks/accumulation_trainer.py ...   # an older remat, the same run

A step's peak is the largest over its micro-batches (``Trainer.training_step``: forward and backward) and its
optimizer step (``torch.optim.AdamW.step``), each read as the bytes live at its start (parameters,
gradients, optimizer state, each storage once) plus torch.profiler's peak over it. Prints one line per
optimizer step and the count over the budget, from step 2 (the callback plans inside step 1's first
micro-batch, so that step also holds remat's own copies).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path += [str(ROOT / "examples"), str(ROOT / "benchmarks" / "zoo")]   # after PYTHONPATH: --src runs stay as given

try:
    from _torchvision_cpu import import_torchvision   # only where torchvision's wheel does not match torch
    import_torchvision()   # before anything imports transformers (examples/hf_trainer.py does)
except ImportError:
    pass

from hf_trainer import RandomTokens  # noqa: E402
from remat.memory import profiler_memory_peak  # noqa: E402

CONFIG = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, batch=4, seq=128)


def _live_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> int:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if opt is not None:
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class StepPeaks:
    """Per optimizer step: the peak of each micro-batch and of the optimizer step (bytes)."""

    def __init__(self) -> None:
        self.current: list[int] = []
        self.steps: list[int] = []
        self.model: torch.nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None

    def measured(self, fn, *args, **kwargs):   # noqa: ANN001, ANN201
        start = _live_bytes(self.model, self.opt) if self.model is not None else 0
        out: dict = {}
        peak = profiler_memory_peak(lambda: out.setdefault("value", fn(*args, **kwargs)))
        self.current.append(start + peak.peak_delta_bytes)
        return out["value"]

    def end_step(self) -> None:
        self.steps.append(max(self.current))
        self.current = []


def run(accumulation: int, budget: str, steps: int, seed: int = 0) -> tuple[list[int], object]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from remat.integrations.transformers import RematTrainerCallback   # after the shim: it subclasses TrainerCallback
    c = CONFIG
    cfg = GPT2Config(n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"], vocab_size=c["vocab_size"],
                     n_positions=c["seq"], bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    peaks = StepPeaks()
    callback = RematTrainerCallback(budget=budget, use_cache=False)
    plain_step = Trainer.training_step
    plain_opt_step = torch.optim.AdamW.step

    def training_step(self, *args, **kwargs):   # noqa: ANN001, ANN202
        peaks.model = self.model
        peaks.opt = getattr(self.optimizer, "optimizer", self.optimizer)   # accelerate wraps the torch optimizer
        return peaks.measured(plain_step, self, *args, **kwargs)

    def opt_step(self, *args, **kwargs):   # noqa: ANN001, ANN202
        if self is not peaks.opt:   # remat.auto's copies, planning inside the first micro-batch
            return plain_opt_step(self, *args, **kwargs)
        out = peaks.measured(plain_opt_step, self, *args, **kwargs)
        peaks.end_step()
        return out

    Trainer.training_step, torch.optim.AdamW.step = training_step, opt_step
    try:
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=c["batch"],
                                     gradient_accumulation_steps=accumulation, learning_rate=1e-3, logging_steps=1,
                                     save_strategy="no", report_to=[], seed=seed, use_cpu=True, disable_tqdm=True,
                                     dataloader_num_workers=0)
            data = RandomTokens(c["batch"] * steps * accumulation, c["vocab_size"], c["seq"], seed)
            Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    finally:
        Trainer.training_step, torch.optim.AdamW.step = plain_step, plain_opt_step
    return peaks.steps, callback.handle.report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--budget", default="70%")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    steps, report = run(a.accumulation, a.budget, a.steps)
    budget = report.budget_bytes
    for i, p in enumerate(steps):
        print(f"step {i + 1}: peak {p} B, {p / budget:.3f} of the budget {budget} B")
    later = steps[1:]   # step 1's first micro-batch holds remat.auto's own planning (the callback plans there)
    over = sum(p > budget for p in later)
    print(f"accumulation {a.accumulation}, budget {a.budget}: {over} of {len(later)} optimizer steps after the first "
          f"over the budget (max {max(later) / budget:.3f}); plan {list(report.boundaries)}")


if __name__ == "__main__":
    main()
