"""PyTorch's own `nn.TransformerEncoder` (pre-norm: norm_first=True, GELU, dropout 0.1) with a
`src_key_padding_mask`, token classification, AdamW.

The layers live in `encoder.layers` (nn.ModuleList). enable_nested_tensor is off: with a
padding mask in training the fast path is not taken anyway, and nested tensors would change
the saved tensors between runs.

Peak: 0.8 M parameters (4 x 3.2 MiB with gradients and Adam state); at batch_size=16,
seq_len=128 the per-layer attention maps (16 x 4 x 128 x 128) and the 4x MLP activations dominate.
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


class TokenTagger(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layer: int, n_tags: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.1,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.head = nn.Linear(d_model, n_tags)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=pad)   # (B, T, d); pad: (B, T) True = padding
        return self.head(h)                                             # (B, T, n_tags)

    # remat's pipeline engine (NOTE [pipeline stages] in remat/distributed/pipeline.py): without a padding
    # mask, forward(ids) == pipeline_head(encoder.layers[n-1](...encoder.layers[0](pipeline_embed(ids))))
    def pipeline_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def pipeline_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder.norm(h))


def build(batch_size: int = 16, seq_len: int = 128, n_layer: int = 4, d_model: int = 128, vocab: int = 1024,
          n_tags: int = 32, *, device="cpu", dtype=torch.float32):
    model = TokenTagger(vocab, d_model, n_layer, n_tags).to(device=device, dtype=dtype)

    def batch(step: int):
        g = zc.generator(step, 4100)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=g)
        pad = torch.arange(seq_len)[None, :] >= lengths[:, None]
        tags = torch.randint(0, n_tags, (batch_size, seq_len), generator=g).masked_fill(pad, -100)
        return ids.to(device), pad.to(device), tags.to(device)

    def loss(model, batch):
        ids, pad, tags = batch
        return F.cross_entropy(model(ids, pad).flatten(0, 1).float(), tags.flatten(), ignore_index=-100)

    return zc.remat.Workload(model=model, batch=batch, loss=loss, optimizer=zc.adamw)


def build_pipeline(batch_size: int = 16, seq_len: int = 128, n_layer: int = 4, d_model: int = 128, vocab: int = 1024,
                   n_tags: int = 32, *, device="cpu", dtype=torch.float32):
    """The same model for remat's pipeline engine: batches of (ids, tags), every sequence full length (the
    engine passes one tensor between stages, so no per-sample padding mask rides along)."""
    model = TokenTagger(vocab, d_model, n_layer, n_tags).to(device=device, dtype=dtype)

    def batch(step: int):
        g = zc.generator(step, 4100)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        tags = torch.randint(0, n_tags, (batch_size, seq_len), generator=g)
        return ids.to(device), tags.to(device)

    def loss(model, batch):
        ids, tags = batch
        return F.cross_entropy(model(ids).flatten(0, 1).float(), tags.flatten())

    return zc.remat.Workload(model=model, batch=batch, loss=loss, optimizer=zc.adamw)
