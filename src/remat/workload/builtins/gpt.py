"""``gpt``: a decoder-only transformer (nanoGPT layout) with dropout, next-token loss."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ...errors import ShapeError
from ..contract import Workload
from . import check_sizes


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # NOTE [pipeline stages] (remat.distributed.pipeline.engine): forward = pipeline_head(blocks(pipeline_embed(idx)))
    def pipeline_embed(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def pipeline_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.pipeline_embed(idx)
        for block in self.h:
            x = block(x)
        return self.pipeline_head(x)


def build(batch_size: int = 8, seq_len: int = 128, n_layer: int = 6, d_model: int = 256,
          n_head: int = 4, vocab: int = 1024, dropout: float = 0.1, *,
          device: str = "cpu", dtype: torch.dtype = torch.float32) -> Workload:
    check_sizes("gpt", batch_size=batch_size, seq_len=seq_len, n_layer=n_layer, d_model=d_model, n_head=n_head,
                vocab=vocab)
    if d_model % n_head:   # the heads split d_model evenly (CausalSelfAttention's view), else an assert deep inside
        raise ShapeError(f"workload 'gpt': d_model={d_model} is not a multiple of n_head={n_head}",
                         tip=f"pass a d_model divisible by n_head, e.g. --shape d_model={n_head * max(1, d_model // n_head)}")
    if not 0.0 <= dropout < 1.0:
        raise ShapeError(f"workload 'gpt': dropout={dropout!r} must lie in [0, 1)", tip="e.g. --shape dropout=0.1")
    model = GPT(vocab, seq_len, n_layer, d_model, n_head, dropout).to(device=device, dtype=dtype)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        return x[:, :-1].to(device), x[:, 1:].to(device)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return Workload(model=model, batch=batch, loss=loss,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1))
