"""A torchtitan-style job for benchmarks/job_launches.py: a Llama-like decoder (RMSNorm, rotary attention,
SwiGLU feed-forward), FSDP2 per transformer block then the root (torchtitan's order), ``remat.auto`` after
the sharding on every rank, then three training steps.

    torchrun --nproc-per-node N benchmarks/llama_job.py OUT_DIR [--budget 70%]

Each rank writes ``OUT_DIR/rank<R>.json``: its plan digest and losses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import remat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from auto_fsdp2 import train_step  # noqa: E402  the examples' step: loss, backward, AdamW step, zero_grad
from auto_plain_loop import loss_fn  # noqa: E402  next-token cross-entropy over (B, T, vocab) logits


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:   # x: (B, H, T, hd)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:   # x: (B, T, d)
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False), \
            nn.Linear(d, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.attention, self.feed_forward = Attention(d, heads), FeedForward(d, 4 * d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(d, heads) for i in range(layers)})
        self.norm, self.output = RMSNorm(d), nn.Linear(d, vocab, bias=False)
        hd = d // heads
        freqs = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(seq).float(), freqs)               # (T, hd / 2)
        self.register_buffer("cos", angles.cos(), persistent=False)   # (T, hd / 2)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:   # (B, T) -> (B, T, vocab)
        h = self.tok_embeddings(tokens)
        t = tokens.shape[1]
        for layer in self.layers.values():
            h = layer(h, self.cos[:t], self.sin[:t])
        return self.output(self.norm(h))


def main(out: Path, budget: str) -> None:
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Llama()
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    tokens = [torch.randint(0, 256, (4, 129), generator=g) for _ in range(3)]
    batches = [(b[:, :-1], b[:, 1:]) for b in tokens]
    handle = remat.auto(model, batches[0], budget=budget, loss_fn=loss_fn, optimizer=opt, use_cache=False)
    losses = [train_step(model, opt, batch) for batch in batches]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "plan_digest": handle.report.plan_digest,
                                                      "boundaries": list(handle.report.boundaries),
                                                      "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget", default="70%")
    a = ap.parse_args()
    main(Path(a.out), a.budget)
