"""torchvision `resnet18` (random init, ReLU(inplace=True) between modules), SGD with momentum.

Peak: at batch_size=8, image_size=128 the activations kept for backward outnumber the
weights + gradients + momentum (11.7 M parameters, 3 x 44.6 MiB); at image_size=64 the
parameter state dominates and checkpointing has little to save.
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
    model = tv.models.resnet18(weights=None, num_classes=num_classes)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                                   device=device, dtype=dtype, seed=1100)
