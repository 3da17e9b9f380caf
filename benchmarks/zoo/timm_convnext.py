"""timm `convnext_atto` (random init; depthwise 7x7 conv, LayerNorm2d, GELU MLP, layer scale),
AdamW. timm's ConvNeXt blocks sit in `stages.N.blocks` (nn.Sequential).

Peak: 3.4 M parameters with num_classes=100 (4 x 13 MiB with gradients and Adam state); at
batch_size=8, image_size=128 the blocks' 4x-expanded MLP activations dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 8, image_size: int = 128, num_classes: int = 100, *, device="cpu",
          dtype=torch.float32):
    timm = zc.import_timm()
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=num_classes)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                                   device=device, dtype=dtype, seed=3100, optimizer=zc.adamw)
