"""A LoRA fine-tune of a diffusers UNet2DConditionModel (random init, no download) with the
noise-prediction loss, in a plain loop, with ``remat.integrations.diffusers.enable`` instead of
``unet.enable_gradient_checkpointing()``.

    pip install -e '.[zoo,integrations]'      # diffusers, peft
    python examples/diffusion_finetune.py     # an SD-like UNet at 32x32 latents; --size tiny for a quick run

The step: latents x0 and noise e at a random timestep t, x_t = scheduler.add_noise(x0, e, t), and
loss = mse(unet(x_t, t, text).sample, e). Noise and timesteps are drawn per step from a seeded
generator into the batch, so the planned run and an unplanned run see the same data.
With LoRA on the attention projections only the adapters train, so the step's peak is the UNet's
activations: where the checkpoints go is most of what decides it.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from remat.integrations.diffusers import enable

SIZES = {"tiny": dict(channels=(8, 16), layers=1, heads=2, text_dim=8, latent=16, tokens=4, batch=4),
         "small": dict(channels=(64, 128, 256), layers=2, heads=8, text_dim=128, latent=32, tokens=16, batch=4)}


def build(size: str, seed: int, lora: bool = True):
    """The UNet (train mode) with LoRA adapters on its attention projections (``lora=False``: full fine-tune)."""
    from diffusers import UNet2DConditionModel
    c = SIZES[size]
    n = len(c["channels"])
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=c["latent"], in_channels=4, out_channels=4, layers_per_block=c["layers"],
        block_out_channels=c["channels"], norm_num_groups=8, cross_attention_dim=c["text_dim"],
        attention_head_dim=c["heads"],
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1))
    if lora:
        from peft import LoraConfig
        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                    target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    unet.train()
    return unet


def batches(size: str, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Per step: noisy latents x_t, the noise e they hide, timesteps t, text embeddings (batch, tokens, dim)."""
    from diffusers import DDPMScheduler
    c = SIZES[size]
    sched = DDPMScheduler(num_train_timesteps=1000)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x0 = torch.randn(c["batch"], 4, c["latent"], c["latent"], generator=g)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, sched.config.num_train_timesteps, (c["batch"],), generator=g)
        out.append({"noisy": sched.add_noise(x0, noise, t), "noise": noise, "timesteps": t,
                    "text": torch.randn(c["batch"], c["tokens"], c["text_dim"], generator=g)})
    return out


def noise_prediction_loss(unet, batch) -> torch.Tensor:
    """mse(predicted noise, the noise): the epsilon-prediction objective of DDPM / Stable Diffusion."""
    pred = unet(batch["noisy"], batch["timesteps"], encoder_hidden_states=batch["text"]).sample
    return torch.nn.functional.mse_loss(pred.float(), batch["noise"].float())


@dataclasses.dataclass
class Result:
    losses: list[float]
    report: object | None
    trainable: dict[str, torch.Tensor]     # the trained weights (the LoRA adapters) after the last step
    baseline: object | None = None         # diffusers' enable_gradient_checkpointing() measured against the plan


def main(size: str = "tiny", steps: int = 3, budget: str = "60%", plan: bool = True, seed: int = 0,
         cache_dir: str | None = None, lora: bool = True, **auto_kwargs) -> Result:
    unet = build(size, seed, lora)
    opt = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-4)
    data = batches(size, steps, seed)
    handle = enable(unet, data[0], budget=budget, loss_fn=noise_prediction_loss, optimizer=opt, cache_dir=cache_dir,
                    **auto_kwargs) if plan else None
    losses = []
    for batch in data:
        loss = noise_prediction_loss(unet, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    trainable = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    return Result(losses=losses, report=handle.report if handle else None, trainable=trainable,
                  baseline=handle.baseline if handle else None)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--budget", default="60%")
    ap.add_argument("--full", action="store_true", help="train every weight instead of LoRA adapters")
    ap.add_argument("--baseline", action="store_true", help="also measure diffusers' own enable_gradient_checkpointing()")
    a = ap.parse_args()
    res = main(a.size, budget=a.budget, lora=not a.full, baseline=a.baseline or None)
    print(res.report.summary())
    if res.baseline is not None:
        print(res.baseline.summary())
    print("losses:", res.losses)
