"""``cnn``: a small ResNet (BatchNorm, residual blocks) on random images, classification."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..contract import Workload
from . import check_sizes


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers: list[nn.Module] = []
        c = widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                layers.append(BasicBlock(c, w, stride=2 if (j == 0 and i > 0) else 1))
                c = w
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))  # (B, C, H', W')
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build(batch_size: int = 16, image_size: int = 32, width: int = 32, blocks_per_stage: int = 2,
          num_classes: int = 10, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Workload:
    check_sizes("cnn", batch_size=batch_size, image_size=image_size, width=width, blocks_per_stage=blocks_per_stage,
                num_classes=num_classes)
    model = ResNet((width, 2 * width, 4 * width), blocks_per_stage, num_classes).to(device=device, dtype=dtype)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + step)
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(0, num_classes, (batch_size,), generator=g)
        return x.to(device=device, dtype=dtype), y.to(device)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    return Workload(model=model, batch=batch, loss=loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
