"""``mlp``: a deep residual MLP chain whose hidden widths are uneven, regression loss.

Uneven widths make per-block saved bytes differ (1x..4x ``width``), so a uniform
segmentation is not the cheapest one: the case remat's planner exists for.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..contract import Workload
from . import check_sizes

# Hidden width multipliers, cycled over depth: blocks save 1x, 4x, 2x, 8x... bytes.
_MULTIPLIERS = (1, 4, 2, 8, 1, 2)


class ResidualMLPBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            ResidualMLPBlock(width, width * _MULTIPLIERS[i % len(_MULTIPLIERS)]) for i in range(depth))
        self.head = nn.Linear(width, d_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(batch_size: int = 256, width: int = 256, depth: int = 12, d_in: int = 64, *,
          device: str = "cpu", dtype: torch.dtype = torch.float32) -> Workload:
    check_sizes("mlp", batch_size=batch_size, width=width, depth=depth, d_in=d_in)
    model = ResidualMLP(d_in, width, depth).to(device=device, dtype=dtype)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(3000 + step)
        x = torch.randn(batch_size, d_in, generator=g)
        return x.to(device=device, dtype=dtype), torch.sin(x).to(device=device, dtype=dtype)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).float(), y.float())

    return Workload(model=model, batch=batch, loss=loss)
