"""remat.auto in a plain PyTorch training loop.

    python examples/auto_plain_loop.py                 # a small model, budget 60% of its peak
    python examples/auto_plain_loop.py --no-plan       # the same run without remat

The test suite runs ``main(size="tiny")`` for three steps, with and without the plan, and checks
that the losses are equal and the measured peak is under the budget (tests/test_examples.py).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

import remat

SIZES = {"tiny": dict(vocab=64, d=32, layers=2, batch=4, seq=32),
         "small": dict(vocab=1024, d=256, layers=6, batch=8, seq=256)}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (B, T, d)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (B, T) token ids -> (B, T, vocab) logits
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@dataclasses.dataclass
class Result:
    losses: list[float]
    report: "remat.AutoReport | None"


def main(size: str = "tiny", steps: int = 3, budget: str = "60%", plan: bool = True, seed: int = 0,
         cache_dir: str | None = None, **auto_kwargs) -> Result:
    cfg = SIZES[size]
    torch.manual_seed(seed)
    model = TinyLM(cfg["vocab"], cfg["d"], cfg["layers"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(steps)]
    batches = [(b[:, :-1], b[:, 1:]) for b in batches]

    handle = None
    if plan:   # the whole integration: one call before the loop
        handle = remat.auto(model, batches[0], budget=budget, loss_fn=loss_fn, optimizer=opt,
                            cache_dir=cache_dir, **auto_kwargs)
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return Result(losses=losses, report=handle.report if handle else None)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--budget", default="60%")
    ap.add_argument("--no-plan", action="store_true")
    a = ap.parse_args()
    res = main(a.size, budget=a.budget, plan=not a.no_plan)
    if res.report is not None:
        print(res.report.summary())
    print("losses:", res.losses)
