"""torchvision `VisionTransformer`: the vit_b_16 code (class, EncoderBlock, MLPBlock) at a reduced config.

vit_b_16 itself (86 M parameters, 12 x 768) is parameter-bound at any image size a 2-core CPU
can step quickly: 4 x 330 MiB of weights, gradients and Adam state against a few MiB of
activations at 64 px. The same classes at hidden_dim=192, 6 layers, patch 8 on 64 px images
(64 patches + class token, 1.9 M parameters) put activations first: at batch_size=32 the
per-layer attention maps (B, 3 heads, 65, 65) and MLP activations (B, 65, 768) kept for
backward dominate the peak. `build(vit_b_16=1)` builds the real vit_b_16 at image_size.
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


def build(batch_size: int = 32, image_size: int = 64, num_layers: int = 6, hidden_dim: int = 192,
          vit_b_16: int = 0, num_classes: int = 100, *, device="cpu", dtype=torch.float32):
    tv = import_torchvision()
    if vit_b_16:
        model = tv.models.vit_b_16(weights=None, image_size=image_size, num_classes=num_classes)
    else:
        model = tv.models.VisionTransformer(image_size=image_size, patch_size=8, num_layers=num_layers,
                                            num_heads=3, hidden_dim=hidden_dim, mlp_dim=4 * hidden_dim,
                                            num_classes=num_classes)
    return zc.image_classification(model, batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                                   device=device, dtype=dtype, seed=1300, optimizer=zc.adamw)
