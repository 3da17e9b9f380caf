"""diffusers (UNet2DConditionModel, SD3/DiT-style transformers): ``enable``, the drop-in for
``model.enable_gradient_checkpointing()``.

diffusers models return no loss, so ``loss_fn(model, batch)`` is required (the noise-prediction
loss of a diffusion fine-tune: ``examples/diffusion_finetune.py``). If diffusers' own
checkpointing was on, it is recorded, switched off (``disable_gradient_checkpointing()``) and
measured against remat's plan (NOTE [library checkpointing baseline]).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..autoplan.library_flags import DIFFUSERS, checkpointing_api
from ..autoplan.offload import host_budget_of
from ..errors import AutoError
from .baseline import EnableHandle, LibraryCheckpointing, replace_library_checkpointing


def enable(model: nn.Module, example_batch: Any, *, budget: str | int, loss_fn: Callable[[nn.Module, Any], Any],
           optimizer: Any | None = None, gradient_checkpointing_func: Callable[..., Any] | None = None,
           baseline: bool | None = None, offload: bool | str | int = False, **auto_kwargs: Any) -> EnableHandle:
    """``remat.auto`` for a diffusers model, in place of ``model.enable_gradient_checkpointing()``.

    ``gradient_checkpointing_func`` (diffusers' own keyword) is refused: remat chooses how each
    boundary is checkpointed. ``baseline=True`` measures diffusers' ``enable_gradient_checkpointing()``
    against the plan even when it was not on; ``baseline=False`` measures nothing; by default the
    checkpointing the model had on is measured. ``handle.baseline`` holds the figures. ``offload=True``
    (or a host budget, ``"16GiB"``) plans activation offload beside recomputation
    (``remat.auto(offload=...)``, NOTE [auto offload] in remat/autoplan/offload.py)."""
    host_budget_of(offload)   # malformed: refused before the library's checkpointing is switched off
    if gradient_checkpointing_func is not None:
        raise AutoError("gradient_checkpointing_func: remat checkpoints each planned boundary with its own "
                        "non-reentrant wrapper, and would ignore yours", tip="drop gradient_checkpointing_func")
    if checkpointing_api(model) is not DIFFUSERS:
        raise AutoError(f"{type(model).__name__} is not a diffusers model (it has no "
                        f"{DIFFUSERS.enable}()/{DIFFUSERS.disable}())",
                        tip="use remat.auto, or remat.integrations.transformers.enable for a transformers model")
    requested = LibraryCheckpointing(api=DIFFUSERS, enable_kwargs={}, describe=f"{DIFFUSERS.enable}()") \
        if baseline else None
    return replace_library_checkpointing(model, example_batch, budget=budget, optimizer=optimizer, requested=requested,
                                         baseline=baseline,
                                         auto_kwargs={**auto_kwargs, "loss_fn": loss_fn, "offload": offload})
