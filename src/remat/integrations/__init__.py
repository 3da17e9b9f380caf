"""Integrations with training frameworks, each an optional extra, never a dependency:

- ``remat.integrations.transformers``: ``enable(model, example_batch, budget=...)`` (the drop-in for
  ``model.activation_checkpointing_enable()`` and ``gradient_checkpointing_enable()``) and
  ``RematTrainerCallback`` for ``transformers.Trainer``; works with PEFT (LoRA) models.
- ``remat.integrations.diffusers``: ``enable(model, example_batch, budget=..., loss_fn=...)`` (the
  drop-in for ``model.enable_gradient_checkpointing()``).
- ``remat.integrations.lightning``: ``RematCallback`` for ``lightning.Trainer``.

Each module imports its framework only when used, so ``import remat.integrations`` needs neither.
"""

from __future__ import annotations

from typing import Any

from ..errors import AutoError


def trainer_accumulation(trainer_value: Any, auto_kwargs: dict[str, Any], setting: str) -> Any:
    """A callback's ``accumulation_steps``: its trainer's gradient accumulation (``setting``: its name
    there), which the plan is made for (NOTE [accumulated step] in remat/workload/contract.py);
    AutoError when the callback was also given a different ``accumulation_steps``."""
    given = auto_kwargs.get("accumulation_steps", trainer_value)
    if given != trainer_value:
        raise AutoError(f"the callback was given accumulation_steps={given!r}, but the trainer accumulates "
                        f"gradients over {setting}={trainer_value!r} micro-batches",
                        tip=f"leave accumulation_steps out: the callback plans for the trainer's {setting}")
    return trainer_value
