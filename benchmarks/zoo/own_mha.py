"""A query-over-memory model using `nn.MultiheadAttention(q, k, v)` with three *distinct* tensors
(separate q/k/v projections feed it), AdamW. (Issue 11: with saved_tensors_hooks active MHA
takes a different internal branch than without, so a checkpointed block replayed under hooks
failed with a CheckpointError, shapes differ, in the receipt's trace-with-plan stage.)

Peak: 0.57 M parameters (4 x 2.2 MiB with gradients and Adam state); at batch_size=32,
seq_len=128 the per-block attention weights (32 x 128 x 128, averaged over heads, plus the
per-head maps) and MLP activations dominate.
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


class CrossBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a, _ = self.attn(self.q(h), self.k(h), self.v(h))   # three different tensors: (B, T, d) each
        x = x + a
        return x + self.mlp(x)


class MHAModel(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(CrossBlock(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def build(batch_size: int = 32, seq_len: int = 128, n_layer: int = 4, d_model: int = 128, vocab: int = 256,
          *, device="cpu", dtype=torch.float32):
    model = MHAModel(vocab, d_model, n_layer).to(device=device, dtype=dtype)

    def batch(step: int):
        g = zc.generator(step, 5300)
        x = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        return x.to(device), x.roll(-1, 1).to(device)

    def loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    return zc.remat.Workload(model=model, batch=batch, loss=loss, optimizer=zc.adamw)
