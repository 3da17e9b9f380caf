"""diffusers `UNet2DConditionModel` (Stable Diffusion's layout, small): ResNet stages with
GroupNorm/SiLU, cross-attention `Transformer2DModel`s whose `BasicTransformerBlock` holds the
twins `attn1`/`attn2`, down/up stages of distinct classes in a ModuleList, the epsilon-prediction
loss on a noised latent, AdamW.

Peak: at batch_size=4, sample_size=32 (latents 4 x 32 x 32) the first stage's 32-channel feature
maps at 32 x 32 (GroupNorm and SiLU saving each) and its self-attention over 1024 tokens dominate.
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


def build(batch_size: int = 4, sample_size: int = 32, width: int = 32, layers_per_block: int = 2,
          text_len: int = 16, cross_dim: int = 32, *, device="cpu", dtype=torch.float32):
    zc.import_transformers()   # diffusers imports transformers, which imports torchvision
    from diffusers import UNet2DConditionModel
    model = UNet2DConditionModel(
        sample_size=sample_size, in_channels=4, out_channels=4, layers_per_block=layers_per_block,
        block_out_channels=(width, 2 * width), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=cross_dim,
        attention_head_dim=8, norm_num_groups=8).to(device=device, dtype=dtype)

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        g = zc.generator(step, 7100)
        latents = torch.randn(batch_size, 4, sample_size, sample_size, generator=g)
        noise = torch.randn(latents.shape, generator=g)
        t = torch.randint(0, 1000, (batch_size,), generator=g)
        text = torch.randn(batch_size, text_len, cross_dim, generator=g)
        alpha = (1 - t.float() / 1000).view(-1, 1, 1, 1)
        noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise     # (B, 4, H, W)
        return tuple(x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)
                     for x in (noisy, t, text, noise))

    def loss(model, batch):
        noisy, t, text, noise = batch
        return F.mse_loss(model(noisy, t, encoder_hidden_states=text).sample.float(), noise.float())

    return zc.remat.Workload(model=model, batch=batch, loss=loss, optimizer=zc.adamw)
