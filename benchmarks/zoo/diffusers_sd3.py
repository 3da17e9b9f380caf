"""diffusers `SD3Transformer2DModel` (Stable Diffusion 3's MMDiT, small): `JointTransformerBlock`s
with an image and a text stream, each with its own adaptive LayerNorm and the twin feed-forwards
`ff`/`ff_context`, joint attention over both, a patch embedding, the flow-matching velocity loss,
AdamW.

Peak: at batch_size=4, sample_size=32, patch_size=2 (256 image tokens + 32 text tokens, width 64)
the per-block attention inputs and feed-forward activations (4 x 288 x 256 floats in each MLP)
dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn import functional as F

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 4, sample_size: int = 32, n_layer: int = 4, heads: int = 4, head_dim: int = 16,
          text_len: int = 32, *, device="cpu", dtype=torch.float32):
    zc.import_transformers()   # diffusers imports transformers, which imports torchvision
    from diffusers import SD3Transformer2DModel
    width = heads * head_dim
    model = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=4, out_channels=4, num_layers=n_layer,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=width,
        caption_projection_dim=width, pooled_projection_dim=width,
        pos_embed_max_size=sample_size).to(device=device, dtype=dtype)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        g = zc.generator(step, 7200)
        x0 = torch.randn(batch_size, 4, sample_size, sample_size, generator=g)
        noise = torch.randn(x0.shape, generator=g)
        s = torch.rand(batch_size, generator=g)
        xt = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise     # rectified flow
        text = torch.randn(batch_size, text_len, width, generator=g)
        pooled = torch.randn(batch_size, width, generator=g)
        return tuple(x.to(device=device, dtype=dtype) for x in (xt, text, pooled, s * 1000, noise - x0))

    def loss(model, batch):
        xt, text, pooled, t, velocity = batch
        out = model(hidden_states=xt, encoder_hidden_states=text, pooled_projections=pooled, timestep=t).sample
        return F.mse_loss(out.float(), velocity.float())

    return zc.remat.Workload(model=model, batch=batch, loss=loss, optimizer=zc.adamw)
