"""Shared plumbing for the zoo's workload factories (batches, losses, optimizers).

remat loads each factory file as a stand-alone module (``path/to/file.py:build``), so the
factories import this one by its top-level name after putting this folder on ``sys.path``
(``zoo_path()``); nothing here is part of remat.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

import remat


def generator(step: int, base: int) -> torch.Generator:
    """The batch of step ``step`` is a pure function of (base, step): deterministic per step."""
    return torch.Generator().manual_seed(base + step)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def image_classification(model: nn.Module, *, batch_size: int, image_size: int, num_classes: int,
                         device: Any, dtype: torch.dtype, seed: int,
                         optimizer: Callable[[Any], torch.optim.Optimizer] = sgd) -> remat.Workload:
    """Random images (B, 3, S, S) and labels (B,), cross-entropy on the logits."""
    model = model.to(device=device, dtype=dtype)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(step, seed)
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(0, num_classes, (batch_size,), generator=g)
        return x.to(device=device, dtype=dtype), y.to(device)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    return remat.Workload(model=model, batch=batch, loss=loss, optimizer=optimizer)


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Hugging Face models return the training loss when ``labels`` are in the batch."""
    return model(**batch).loss


def to_device(batch: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def import_transformers() -> Any:
    """``import transformers``; it imports torchvision when installed (image utilities), so
    make that import work first (``_torchvision_cpu``)."""
    from _torchvision_cpu import import_torchvision
    try:
        import_torchvision()
    except ImportError:      # no torchvision at all: transformers does without it
        pass
    import transformers
    return transformers


def import_timm() -> Any:
    """``import timm`` (which imports torchvision: ``_torchvision_cpu``)."""
    from _torchvision_cpu import import_torchvision
    import_torchvision()
    import timm
    return timm
