"""Hugging Face `ViTForImageClassification` from a small `ViTConfig` (pre-norm encoder, GELU,
dropout 0), AdamW.

attn_implementation="sdpa" (the transformers default).

Peak: 1.9 M parameters (4 x 7.4 MiB with gradients and Adam state); at batch_size=32,
image_size=64, patch 8 (64 patches + CLS) the per-layer activations (32 x 65 x 768 in the MLP)
dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 32, image_size: int = 64, n_layer: int = 6, hidden_size: int = 192,
          num_classes: int = 100, *, device="cpu", dtype=torch.float32):
    transformers = zc.import_transformers()
    config = transformers.ViTConfig(image_size=image_size, patch_size=8, hidden_size=hidden_size,
                                    num_hidden_layers=n_layer, num_attention_heads=3,
                                    intermediate_size=4 * hidden_size, num_labels=num_classes,
                                    attn_implementation="sdpa")
    model = transformers.ViTForImageClassification(config).to(device=device, dtype=dtype)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = zc.generator(step, 2500)
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(0, num_classes, (batch_size,), generator=g)
        return {"pixel_values": x.to(device=device, dtype=dtype), "labels": y.to(device)}

    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
