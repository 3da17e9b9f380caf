"""Integrations with training frameworks, each an optional extra, never a dependency:

- ``remat.integrations.transformers``: ``enable(model, example_batch, budget=...)`` (the drop-in for
  ``model.gradient_checkpointing_enable()``) and ``RematTrainerCallback`` for ``transformers.Trainer``;
  works with PEFT (LoRA) models.
- ``remat.integrations.lightning``: ``RematCallback`` for ``lightning.Trainer``.

Each module imports its framework only when used, so ``import remat.integrations`` needs neither.
"""
