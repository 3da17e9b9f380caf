"""torchvision `efficientnet_b0` (random init; MBConv with SiLU(inplace=True), squeeze-excitation,
BatchNorm and stochastic depth, which draws random numbers in forward), SGD with momentum.

Peak: 4.1 M parameters with num_classes=100 (3 x 16 MiB); at batch_size=8, image_size=128
the expanded depthwise activations (up to 6x the channels) dominate the peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402
from _torchvision_cpu import import_torchvision  # noqa: E402


def build(batch_size: int = 8, image_size: int = 128, num_classes: int = 100, *, device="cpu",
          dtype=torch.float32):
    tv = import_torchvision()
    model = tv.models.efficientnet_b0(weights=None, num_classes=num_classes)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                                   device=device, dtype=dtype, seed=1400)
