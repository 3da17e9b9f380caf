"""Hugging Face ``transformers`` (and PEFT): ``enable`` and a ``TrainerCallback``.

``enable(model, example_batch, budget="8GiB")`` replaces ``model.activation_checkpointing_enable()``
(transformers 5; ``gradient_checkpointing_enable()`` before it):
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
from ..autoplan.library_flags import TRANSFORMERS_5, checkpointing_api
from ..autoplan.offload import host_budget_of
from ..errors import AutoError
from . import trainer_accumulation
from .baseline import EnableHandle, LibraryCheckpointing, replace_library_checkpointing

try:   # an optional extra: without transformers, enable() still works on any HF-style model
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover - exercised only without the extra
    _CallbackBase = object  # type: ignore[assignment,misc]


# what torch.utils.checkpoint's keywords mean to remat, which checkpoints non-reentrant and
# replays with the forward's RNG state (the values a plan honours as they are; others refused)
_CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": True, "determinism_check": "default",
                      "debug": False}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointingOptions:
    """``activation_checkpointing_enable``'s options (transformers 5.x) as remat reads them.

    ``kwargs``: torch.utils.checkpoint's keywords; remat honours use_reentrant=False,
    preserve_rng_state=True, determinism_check="default" and debug=False (its own settings) and
    refuses any other value rather than ignore it. ``every_n_layers``: the Hugging Face
    configuration remat's plan is measured against (NOTE [library checkpointing baseline]), not
    a constraint on the plan. ``offload=True`` (transformers' "activations in pinned host memory")
    lets remat plan keep / recompute / offload per boundary under a default host budget, and a
    host budget (``"16GiB"``, bytes) states it: ``remat.auto(offload=...)``, NOTE [auto offload]
    in remat/autoplan/offload.py. Where transformers offloads every checkpointed layer, remat
    offloads the boundaries whose copies cost less than their recomputation, within the budgets."""

    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    every_n_layers: int | None = None
    offload: bool | str | int = False

    def __post_init__(self) -> None:
        if not isinstance(self.kwargs, dict):
            raise AutoError(f"activation_checkpointing_kwargs must be a dict, got {type(self.kwargs).__name__}")
        for key, value in self.kwargs.items():
            if key not in _CHECKPOINT_KWARGS:
                raise AutoError(f"activation_checkpointing_kwargs {key!r}: remat chooses how each boundary is "
                                "checkpointed (non-reentrant torch.utils.checkpoint, or a selective policy)",
                                tip=f"drop {key!r}; remat honours {', '.join(_CHECKPOINT_KWARGS)} at their defaults")
            if value != _CHECKPOINT_KWARGS[key]:
                raise AutoError(f"activation_checkpointing_kwargs {key}={value!r}: remat always runs "
                                f"{key}={_CHECKPOINT_KWARGS[key]!r}"
                                + (" (reentrant replay checks nothing and can give silently wrong gradients)"
                                   if key == "use_reentrant" else ""),
                                tip=f"drop {key}, or pass {key}={_CHECKPOINT_KWARGS[key]!r}")
        n = self.every_n_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise AutoError(f"every_n_layers must be a positive integer, got {n!r}")
        host_budget_of(self.offload)   # malformed: refused here, before any work (NOTE [auto offload])

    def hf_call(self) -> dict[str, Any]:
        """The keywords of the equivalent ``activation_checkpointing_enable`` call (the baseline's)."""
        return {"activation_checkpointing_kwargs": dict(self.kwargs) or None, "every_n_layers": self.every_n_layers or 1}


def enable(model: nn.Module, example_batch: Any, *, budget: str | int, optimizer: Any | None = None,
           activation_checkpointing_kwargs: dict[str, Any] | None = None,
           gradient_checkpointing_kwargs: dict[str, Any] | None = None, every_n_layers: int | None = None,
           offload: bool | str | int = False, baseline: bool | None = None, **auto_kwargs: Any) -> EnableHandle:
    """``remat.auto`` for a Hugging Face (or PEFT-wrapped) model: ``model(**batch).loss`` is the loss.

    The drop-in for ``model.activation_checkpointing_enable()`` (transformers 5) and the deprecated
    ``model.gradient_checkpointing_enable()``: their keywords are taken (:class:`CheckpointingOptions`
    says what each means to remat; ``gradient_checkpointing_kwargs`` is the old name of
    ``activation_checkpointing_kwargs``). If either was called before, that checkpointing is
    recorded, switched off so the two never stack, and measured against remat's plan on copies;
    so is ``activation_checkpointing_enable(every_n_layers=N)`` when ``every_n_layers`` is given
    (``baseline=True``: N=1 when not given; ``baseline=False``: nothing measured).
    ``handle.baseline`` holds the figures (NOTE [library checkpointing baseline]). Pass the optimizer
    you will train with (its state counts in the peak); without one, AdamW over the trainable
    parameters is assumed and ``handle.report.optimizer`` says so. ``offload=True`` (or a host budget,
    ``"16GiB"``) plans activation offload beside recomputation (``remat.auto(offload=...)``)."""
    if activation_checkpointing_kwargs is not None and gradient_checkpointing_kwargs is not None:
        raise AutoError("both activation_checkpointing_kwargs and gradient_checkpointing_kwargs were given",
                        tip="pass one: gradient_checkpointing_kwargs is transformers 4's name for the same keywords")
    options = CheckpointingOptions(kwargs=dict(activation_checkpointing_kwargs or gradient_checkpointing_kwargs or {}),
                                   every_n_layers=every_n_layers, offload=offload)
    api = checkpointing_api(model)
    requested = None
    if api is not None and (every_n_layers is not None or baseline):
        call = options.hf_call() if api is TRANSFORMERS_5 else {"gradient_checkpointing_kwargs": dict(options.kwargs) or None}
        if api is not TRANSFORMERS_5 and (every_n_layers or 1) != 1:
            raise AutoError(f"every_n_layers={every_n_layers}: this model's transformers has no every_n_layers "
                            f"({api.enable}() checkpoints every layer)", tip="leave every_n_layers out")
        requested = LibraryCheckpointing(api=api, enable_kwargs=call, describe=f"{api.enable}("
                                         + ", ".join(f"{k}={v!r}" for k, v in call.items() if v is not None) + ")")
    return replace_library_checkpointing(model, example_batch, budget=budget, optimizer=optimizer, requested=requested,
                                         baseline=baseline, auto_kwargs={**auto_kwargs, "offload": options.offload})


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Pending:
    model: nn.Module
    optimizer: Any
    accumulation_steps: int   # TrainingArguments.gradient_accumulation_steps (NOTE [accumulated step])


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
    (``state.log_history`` and the next ``on_log``) as ``remat_*`` entries. The plan is made for
    the Trainer's ``gradient_accumulation_steps`` (NOTE [accumulated step] in remat/workload/contract.py).
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
        accumulation = trainer_accumulation(getattr(args, "gradient_accumulation_steps", 1), self.auto_kwargs,
                                            "gradient_accumulation_steps")
        self._pending = _Pending(model=model, optimizer=optimizer, accumulation_steps=accumulation)
        self._state = state
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
        auto_kwargs = {**self.auto_kwargs, "accumulation_steps": pending.accumulation_steps}
        self.handle = auto(pending.model, dict(kwargs), budget=self.budget, optimizer=pending.optimizer, **auto_kwargs)
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
                "remat_measured_peak_bytes": r.measured_peak_bytes, "remat_memory_source": r.memory_source.value,
                "remat_optimizer": r.optimizer, "remat_accumulation_steps": r.accumulation_steps,
                "remat_verification": r.verification.value,
                "remat_cache": r.cache.value}
