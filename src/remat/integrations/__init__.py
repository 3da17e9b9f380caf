"""Integrations with training frameworks, each an optional extra, never a dependency:

- ``remat.integrations.transformers``: ``enable(model, example_batch, budget=...)`` (the drop-in for
  ``model.activation_checkpointing_enable()`` and ``gradient_checkpointing_enable()``) and
  ``RematTrainerCallback`` for ``transformers.Trainer``; works with PEFT (LoRA) models.
- ``remat.integrations.diffusers``: ``enable(model, example_batch, budget=..., loss_fn=...)`` (the
  drop-in for ``model.enable_gradient_checkpointing()``).
- ``remat.integrations.lightning``: ``RematCallback`` for ``lightning.Trainer``.

Each module imports its framework only when used, so ``import remat.integrations`` needs neither.
"""
