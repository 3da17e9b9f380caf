"""A decoder whose blocks apply an in-place `relu_` *between* modules (`f = a(x).relu_(); b(f)`),
as in torchvision's ReLU(inplace=True) ResNets written by hand, AdamW. (Issue 11: the in-place
op allocates nothing, was counted in `b`'s window, `b` was flagged "writes in place into one
of its inputs", and the flag excluded the whole block, so nothing could be planned.)

Peak: 0.56 M parameters (4 x 2.1 MiB with gradients and Adam state); at batch_size=32,
seq_len=128 the per-block activations (32 x 128 x 512 floats = 8 MiB per hidden layer) dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.a(self.norm(x)).relu_()        # in place, between self.a and self.b: (B, T, 4d)
        return x + self.b(f)


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)                     # (B, T, vocab)


def build(batch_size: int = 32, seq_len: int = 128, n_layer: int = 4, d_model: int = 128, vocab: int = 256,
          *, device="cpu", dtype=torch.float32):
    model = Decoder(vocab, d_model, n_layer).to(device=device, dtype=dtype)

    def batch(step: int):
        g = zc.generator(step, 5200)
        x = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        return x.to(device), x.roll(-1, 1).to(device)

    def loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    return zc.remat.Workload(model=model, batch=batch, loss=loss, optimizer=zc.adamw)
