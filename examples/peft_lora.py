"""A LoRA fine-tune (PEFT) of a GPT-2 built from a config (random init, no download), in a plain
loop, with ``remat.integrations.transformers.enable`` instead of ``gradient_checkpointing_enable()``.

    pip install -e '.[integrations]'
    python examples/peft_lora.py            # GPT-2 small's shape; --size tiny for a quick run

With LoRA most parameters are frozen, so the step's peak is activations: where the checkpoints
go is most of what decides it.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from remat.integrations.transformers import enable

SIZES = {"tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, batch=4, seq=64),
         "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, batch=4, seq=512)}


def build(size: str, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    c = SIZES[size]
    cfg = GPT2Config(n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"], vocab_size=c["vocab_size"],
                     n_positions=max(c["seq"], 64), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = get_peft_model(GPT2LMHeadModel(cfg), LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                                            fan_in_fan_out=True, lora_dropout=0.05))
    model.train()
    return model


def batches(size: str, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    c = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, c["vocab_size"], (c["batch"], c["seq"]), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


@dataclasses.dataclass
class Result:
    losses: list[float]
    report: object | None
    trainable: dict[str, torch.Tensor]     # the LoRA weights after the last step


def main(size: str = "tiny", steps: int = 3, budget: str = "60%", plan: bool = True, seed: int = 0,
         cache_dir: str | None = None, **auto_kwargs) -> Result:
    model = build(size, seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data = batches(size, steps, seed)
    handle = enable(model, data[0], budget=budget, optimizer=opt, cache_dir=cache_dir, **auto_kwargs) if plan else None
    losses = []
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return Result(losses=losses, report=handle.report if handle else None, trainable=trainable)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--budget", default="60%")
    a = ap.parse_args()
    res = main(a.size, budget=a.budget)
    print(res.report.summary())
    print("losses:", res.losses)
