"""Lightning: ``RematCallback`` for ``lightning.Trainer`` (or ``pytorch_lightning``).

It plans on the first training batch (``on_train_batch_start`` receives it: nothing is drawn
from the dataloader), with the Trainer's optimizer, and applies the plan to the
``LightningModule`` before that batch's forward. The loss is the module's own
``training_step(batch, 0)`` (its ``loss`` entry when it returns a dict), run on copies whose
trainer reference is cut (``self.log`` then does nothing there; the real module's logging is
untouched). NOTE [no side effects] in ``remat.autoplan.source``. The plan is made for the
Trainer's ``accumulate_grad_batches`` (NOTE [accumulated step] in remat/workload/contract.py).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..autoplan import AutoHandle, auto
from ..autoplan.offload import host_budget_of
from ..errors import AutoError
from . import trainer_accumulation

try:
    from lightning.pytorch.callbacks import Callback as _CallbackBase
except ImportError:  # pragma: no cover - only without the extra
    try:
        from pytorch_lightning.callbacks import Callback as _CallbackBase  # type: ignore[no-redef]
    except ImportError:
        _CallbackBase = object  # type: ignore[assignment,misc]


def training_step_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``module.training_step(batch, 0)``: the tensor, or the dict's ``"loss"``."""
    with warnings.catch_warnings():   # self.log on a copy without a trainer warns and does nothing
        warnings.simplefilter("ignore")
        out = module.training_step(batch, 0)
    if isinstance(out, Mapping):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor):
        raise AutoError(f"{type(module).__name__}.training_step returned {type(out).__name__}, not a loss tensor",
                        tip="return the loss (or {'loss': loss}) from training_step, or pass loss_fn=")
    return out


class RematCallback(_CallbackBase):
    """Fit the LightningModule's training step under ``budget`` (``remat.auto``), on the first batch.

    ``offload=True`` (or a host budget, ``"16GiB"``) plans activation offload beside recomputation,
    as ``remat.auto(offload=...)`` does (NOTE [auto offload] in remat/autoplan/offload.py); a
    malformed value is refused here, before training starts."""

    def __init__(self, budget: str | int, *, offload: bool | str | int = False, **auto_kwargs: Any) -> None:
        host_budget_of(offload)   # AutoError now rather than at the first batch
        self.budget = budget
        self.offload = offload
        self.auto_kwargs = auto_kwargs
        self.handle: AutoHandle | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        if self.handle is not None:
            return
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        if len(optimizers) > 1:
            raise AutoError(f"RematCallback plans one optimizer; this Trainer has {len(optimizers)}")
        kwargs = dict(self.auto_kwargs)
        kwargs.setdefault("loss_fn", training_step_loss)
        kwargs.setdefault("copy_fn", lambda m: copy.deepcopy(m, {id(trainer): None}))
        kwargs["accumulation_steps"] = trainer_accumulation(getattr(trainer, "accumulate_grad_batches", 1),
                                                            self.auto_kwargs, "accumulate_grad_batches")
        self.handle = auto(pl_module, batch, budget=self.budget, optimizer=optimizers[0] if optimizers else None,
                           offload=self.offload, **kwargs)
        r = self.handle.report
        pl_module.log_dict({"remat_boundaries": float(len(r.boundaries)),
                            "remat_predicted_peak_bytes": float(r.predicted_peak_bytes),
                            "remat_measured_peak_bytes": float(r.measured_peak_bytes or 0)},
                           on_step=True, on_epoch=False, batch_size=1)
