"""timm `vit_tiny_patch16_224` architecture (192 wide, 12 blocks, 3 heads, fused qkv, attention via
F.scaled_dot_product_attention) at img_size=64 with patch 8, AdamW.

Peak: 5.5 M parameters (4 x 21 MiB with gradients and Adam state); at batch_size=16,
image_size=64 (64 patches + CLS) the twelve blocks' MLP activations (16 x 65 x 768, about 300 MiB in all) and
attention inputs dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 16, image_size: int = 64, num_classes: int = 100, *, device="cpu",
          dtype=torch.float32):
    timm = zc.import_timm()
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=image_size, patch_size=8,
                              num_classes=num_classes)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                                   device=device, dtype=dtype, seed=3200, optimizer=zc.adamw)
