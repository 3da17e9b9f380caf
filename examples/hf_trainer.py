"""Hugging Face ``Trainer`` with ``RematTrainerCallback``: remat plans on the first training batch,
with the Trainer's own optimizer, and writes the plan and its peaks into the Trainer's log.

    pip install -e '.[integrations]'
    python examples/hf_trainer.py --size tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import torch

from remat.integrations.transformers import RematTrainerCallback

SIZES = {"tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, batch=4, seq=64),
         "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, batch=4, seq=512)}


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences, the same for the same seed; labels = inputs (causal LM)."""

    def __init__(self, n: int, vocab: int, seq: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


@dataclasses.dataclass
class Result:
    losses: list[float]                 # the Trainer's logged loss per step
    log_history: list[dict]
    report: object | None
    params: dict[str, torch.Tensor]     # after the last step


def main(size: str = "tiny", steps: int = 3, budget: str = "60%", plan: bool = True, seed: int = 0,
         cache_dir: str | None = None, **auto_kwargs) -> Result:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    c = SIZES[size]
    cfg = GPT2Config(n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"], vocab_size=c["vocab_size"],
                     n_positions=max(c["seq"], 64), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    callback = RematTrainerCallback(budget=budget, cache_dir=cache_dir, **auto_kwargs) if plan else None
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=c["batch"],
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=seed,
                                 use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(c["batch"] * steps, c["vocab_size"],
                                                                             c["seq"], seed),
                          callbacks=[callback] if callback else [])
        trainer.train()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Result(losses=losses, log_history=history, report=callback.handle.report if callback else None,
                  params=params)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--budget", default="60%")
    a = ap.parse_args()
    res = main(a.size, budget=a.budget)
    print(res.report.summary())
    print("losses:", res.losses)
