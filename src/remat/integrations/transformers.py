"""Hugging Face ``transformers`` (and PEFT): ``enable`` and a ``TrainerCallback``.

``enable(model, example_batch, budget="8GiB")`` replaces ``model.gradient_checkpointing_enable()``:
instead of checkpointing every layer it checkpoints the cheapest set of modules whose whole
training step (activations, gradients, optimizer state) fits the budget, measured on copies
(``remat.auto``). ``RematTrainerCallback(budget=...)`` does the same inside ``Trainer.train()``:
NOTE [planning on the first training batch].
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..autoplan import AutoHandle, auto
from ..errors import AutoError

try:   # an optional extra: without transformers, enable() still works on any HF-style model
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover - exercised only without the extra
    _CallbackBase = object  # type: ignore[assignment,misc]


def enable(model: nn.Module, example_batch: Any, *, budget: str | int, optimizer: Any | None = None,
           **auto_kwargs: Any) -> AutoHandle:
    """``remat.auto`` for a Hugging Face (or PEFT-wrapped) model: ``model(**batch).loss`` is the loss.

    The drop-in for ``model.gradient_checkpointing_enable()``: if that was called before, it is
    switched off first (``gradient_checkpointing_disable()``) so the two never stack; remat then
    checkpoints what the budget needs, no more. Pass the optimizer you will train with (its state
    counts in the peak); without one, AdamW over the trainable parameters is assumed and
    ``handle.report.optimizer`` says so."""
    # transformers 5 renames it activation checkpointing (the old names warn, and go in v6)
    for flag, off in (("is_activation_checkpointing", "activation_checkpointing_disable"),
                      ("is_gradient_checkpointing", "gradient_checkpointing_disable")):
        if hasattr(type(model), flag) or hasattr(model, off):
            if getattr(model, flag, False) and hasattr(model, off):
                getattr(model, off)()
            break
    return auto(model, example_batch, budget=budget, optimizer=optimizer, **auto_kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Pending:
    model: nn.Module
    optimizer: Any


class RematTrainerCallback(_CallbackBase):
    """Plans on the first training batch with the Trainer's own optimizer; logs the plan and peaks.

    NOTE [planning on the first training batch]
    ``on_train_begin`` receives the model and the Trainer's optimizer but no batch, and drawing
    one from the train dataloader would advance its sampler (the run would see other data than
    an unplanned run with the same seed). So the callback registers a forward pre-hook on the
    model and plans on the keyword arguments of the model's first forward in training mode: the
    first training batch exactly as the Trainer feeds it (``model(**inputs)``). The hook removes
    itself before planning (the copies remat profiles carry no hook), plans on copies with every
    RNG stream restored (NOTE [no side effects]), applies the plan to the model, and returns, so
    that very forward already runs checkpointed. The report goes into the Trainer's log
    (``state.log_history`` and the next ``on_log``) as ``remat_*`` entries.
    """

    def __init__(self, budget: str | int, **auto_kwargs: Any) -> None:
        self.budget = budget
        self.auto_kwargs = auto_kwargs
        self.handle: AutoHandle | None = None
        self._pending: _Pending | None = None
        self._hook: Any = None
        self._state: Any = None
        self._logged = False

    # -- TrainerCallback events --------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if self.handle is not None or model is None:
            return
        if getattr(args, "gradient_checkpointing", False):
            raise AutoError("TrainingArguments(gradient_checkpointing=True) and RematTrainerCallback both "
                            "checkpoint the model", tip="drop gradient_checkpointing=True: the callback plans instead")
        self._pending, self._state = _Pending(model=model, optimizer=optimizer), state
        self._hook = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.handle is not None and not self._logged and logs is not None:
            logs.update(self.log_entries())
            self._logged = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_hook()

    # -- planning ----------------------------------------------------------------------------
    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not module.training or self._pending is None:
            return None
        pending, self._pending = self._pending, None
        self._remove_hook()
        if args:
            raise AutoError(f"the Trainer called {type(module).__name__} with {len(args)} positional argument(s); "
                            "RematTrainerCallback plans on model(**inputs)")
        self.handle = auto(pending.model, dict(kwargs), budget=self.budget, optimizer=pending.optimizer,
                           **self.auto_kwargs)
        if self._state is not None:
            self._state.log_history.append({**self.log_entries(), "step": self._state.global_step})
        return None

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def log_entries(self) -> dict[str, Any]:
        """The report as flat ``remat_*`` log entries (bytes, ms), for the Trainer's log."""
        if self.handle is None:
            return {}
        r = self.handle.report
        return {"remat_boundaries": len(r.boundaries), "remat_plan": ", ".join(r.boundaries),
                "remat_planner": r.planner, "remat_budget_bytes": r.budget_bytes,
                "remat_baseline_peak_bytes": r.baseline_peak_bytes,
                "remat_predicted_peak_bytes": r.predicted_peak_bytes,
                "remat_measured_peak_bytes": r.measured_peak_bytes, "remat_memory_source": r.memory_source,
                "remat_optimizer": r.optimizer, "remat_verification": r.verification.value,
                "remat_cache": r.cache.value}
