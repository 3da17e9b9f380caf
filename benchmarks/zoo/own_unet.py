"""A BatchNorm U-Net written the way people write them: `Down` and `Up` stages, each a distinct
class with children (not nn.ModuleList/nn.Sequential of repeated blocks), skip connections,
per-pixel segmentation loss, AdamW. (Issue 11: its natural blocks are Down/Up, and only single
Conv/BN/ReLU layers were ever considered.)

Peak: 0.47 M parameters (4 x 1.8 MiB with gradients and Adam state); at batch_size=8,
image_size=128 the full-resolution feature maps (8 x 16 x 128 x 128 floats = 8 MiB each,
several per stage incl. BatchNorm's saved inputs) dominate.
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


class DoubleConv(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.conv = DoubleConv(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))          # (B, c_out, H/2, W/2)


class Up(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_in // 2, 2, stride=2)
        self.conv = DoubleConv(c_in // 2 + c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))   # (B, c_out, 2H, 2W)


class UNet(nn.Module):
    def __init__(self, width: int, n_classes: int) -> None:
        super().__init__()
        w = width
        self.inc = DoubleConv(3, w)
        self.down1 = Down(w, 2 * w)
        self.down2 = Down(2 * w, 4 * w)
        self.down3 = Down(4 * w, 8 * w)
        self.up1 = Up(8 * w, 4 * w)
        self.up2 = Up(4 * w, 2 * w)
        self.up3 = Up(2 * w, w)
        self.outc = nn.Conv2d(w, n_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        y = self.up3(self.up2(self.up1(x4, x3), x2), x1)
        return self.outc(y)                     # (B, n_classes, H, W)


def build(batch_size: int = 8, image_size: int = 128, width: int = 16, n_classes: int = 4, *, device="cpu",
          dtype=torch.float32):
    model = UNet(width, n_classes).to(device=device, dtype=dtype)

    def batch(step: int):
        g = zc.generator(step, 5100)
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(0, n_classes, (batch_size, image_size, image_size), generator=g)
        return x.to(device=device, dtype=dtype), y.to(device)

    def loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    return zc.remat.Workload(model=model, batch=batch, loss=loss, optimizer=zc.adamw)
