"""The checkpointing switches of Hugging Face transformers and diffusers models, by library.

Both libraries checkpoint by a ``gradient_checkpointing`` flag on their layers (and a
``_gradient_checkpointing_func`` beside it), but name the switch differently: transformers 5
``activation_checkpointing_enable()`` / ``activation_checkpointing_disable()`` (the 4.x names
``gradient_checkpointing_enable()`` / ``gradient_checkpointing_disable()`` still work, deprecated,
until v6), diffusers ``enable_gradient_checkpointing()`` / ``disable_gradient_checkpointing()``.
remat.auto's refusal names the user's own call from here, and the integrations switch it off
and measure it as a baseline (NOTE [library checkpointing baseline] in remat/integrations/baseline.py).
"""

from __future__ import annotations

import dataclasses

from torch import nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointingAPI:
    library: str      # as a user knows it: "transformers 5", "transformers 4", "diffusers"
    enable: str       # the model's method that turns it on
    disable: str      # and off


TRANSFORMERS_5 = CheckpointingAPI(library="transformers 5", enable="activation_checkpointing_enable",
                                  disable="activation_checkpointing_disable")
TRANSFORMERS_4 = CheckpointingAPI(library="transformers 4", enable="gradient_checkpointing_enable",
                                  disable="gradient_checkpointing_disable")
DIFFUSERS = CheckpointingAPI(library="diffusers", enable="enable_gradient_checkpointing",
                             disable="disable_gradient_checkpointing")
APIS = (TRANSFORMERS_5, DIFFUSERS, TRANSFORMERS_4)   # the first a model answers to is its own


def checkpointing_api(model: nn.Module) -> CheckpointingAPI | None:
    """The library switch ``model`` has (a PEFT wrapper answers for its base model); None: neither library's."""
    for api in APIS:
        if callable(getattr(model, api.disable, None)) and callable(getattr(model, api.enable, None)):
            return api
    return None


def flagged_modules(model: nn.Module) -> list[str]:
    """Module paths whose ``gradient_checkpointing`` flag is on ("<root>" for the model itself)."""
    return [n or "<root>" for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
