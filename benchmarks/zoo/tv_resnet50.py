"""torchvision `resnet50` (random init; Bottleneck blocks, ReLU(inplace=True)), SGD with momentum.

Peak: 23.7 M parameters with num_classes=100 (3 x 90 MiB of weights, gradients and momentum);
at batch_size=8, image_size=96 the activations saved for backward (about 320 MiB, the
bottlenecks' 4x-expanded feature maps) are the larger share; at image_size=64 the parameter
state dominates. The slowest zoo model (about 0.8 s a step on 2 cores).
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


def build(batch_size: int = 8, image_size: int = 96, num_classes: int = 100, *, device="cpu",
          dtype=torch.float32):
    tv = import_torchvision()
    model = tv.models.resnet50(weights=None, num_classes=num_classes)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                                   device=device, dtype=dtype, seed=1200)
