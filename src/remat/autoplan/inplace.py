"""A model wrapped by FSDP2 or DDP, profiled in place: its state saved before and restored after.

NOTE [wrapped models in place]
FSDP2 (``fully_shard``) and DDP modules cannot be copied (``copy.deepcopy`` fails on their
process groups), and a copy would not be the step the job runs anyway: the sharded parameters,
gradients and optimizer state, the all-gathers (again during a replay) and reduce-scatters,
DDP's gradient buckets. So on a wrapped model ``remat.auto`` profiles and measures *the user's
model itself*, on every rank at once (NOTE [one plan per job]), and every build of the workload
first puts the model back as it was found (:class:`StateSnapshot`): every parameter and buffer
value (written in place, so FSDP2's shard storage and DDP's parameter views stay the tensors
they were), every gradient (or None), every module's ``training`` flag; once planning is over, a
DDP reducer that planning found new is made new again (NOTE [DDP reducer after planning] in
autoplan/reducer.py). Each build gets a fresh optimizer of the user's class over the model's
(sharded) parameters; the user's optimizer object and its state are never stepped or written. The
RNG streams are restored as for a plain model (NOTE [no side effects]). On CUDA the snapshot is
kept on the CPU, so no measured peak holds it.
The cost: one copy of this rank's parameters, buffers and gradients in host memory while
``remat.auto`` runs.
"""

from __future__ import annotations

import enum
import sys
from typing import Any

import torch
from torch import nn

from ..errors import AutoError
from ..workload import Workload, with_autocast
from .reducer import ReducerState
from .source import InMemoryWorkload, ModelSource, clone_batch


class JobEngine(str, enum.Enum):
    """How the user's model is wrapped for data parallelism."""

    NONE = "none"
    DDP = "ddp"
    FSDP2 = "fsdp2"


def job_engine(model: nn.Module) -> JobEngine:
    """DDP when ``model`` is a ``DistributedDataParallel``, FSDP2 when any of its modules went through
    ``fully_shard``, else NONE. Reads ``sys.modules`` first: a job that never imported FSDP2 has no
    FSDP2 module, and importing it costs about 1.5 s."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return JobEngine.DDP
    if "torch.distributed.fsdp" in sys.modules:
        from torch.distributed.fsdp import FSDPModule
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            return JobEngine.FSDP2
    return JobEngine.NONE


def _saved(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


class StateSnapshot:
    """Every parameter, buffer and gradient of a model, and its modules' ``training`` flags, written
    back in place by :meth:`restore` (NOTE [wrapped models in place])."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        with torch.no_grad():
            self.params = [(p, _saved(p), _saved(p.grad)) for p in model.parameters()]
            self.buffers = [(b, _saved(b)) for b in model.buffers()]
        self.training = [(m, m.training) for m in model.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            for p, value, grad in self.params:
                p.copy_(value)
                # a copy: a later step accumulates into p.grad in place, and the snapshot must outlive it
                p.grad = None if grad is None else grad.to(p.device, copy=True)
            for b, value in self.buffers:
                b.copy_(value)
        for m, flag in self.training:
            m.training = flag


class InPlaceSource(ModelSource):
    """The user's wrapped model as the workload of every build (NOTE [wrapped models in place])."""

    def __init__(self, model: nn.Module, batch: Any, *args: Any, autocast: str | None = None,
                 accumulation_steps: int = 1, engine: JobEngine, ranks: Any) -> None:
        super().__init__(model, batch, *args, autocast=autocast, accumulation_steps=accumulation_steps)
        self.engine, self.ranks = engine, ranks
        self.snapshot = StateSnapshot(model)
        # DDP's reducer: made new again after planning when planning found it new (NOTE [DDP reducer after planning])
        self.reducer = ReducerState(model) if engine is JobEngine.DDP else None

    @property
    def in_place(self) -> bool:
        return True

    def restore(self) -> None:
        self.snapshot.restore()
        if self.reducer is not None:
            self.reducer.restore()

    def workload(self) -> Workload:
        self.snapshot.restore()
        model, batch, spec = self.model, self.batch, self.optimizer
        return with_autocast(Workload(model=model, batch=lambda step: clone_batch(batch), loss=self.loss,
                                      optimizer=lambda params: spec.build(model)), str(self.device), self.autocast)

    def loaded(self) -> InMemoryWorkload:
        p = next(iter(self.model.parameters()), None)
        dtype = str(p.dtype).replace("torch.", "") if p is not None else "float32"
        batch, loss = self.batch, self.loss
        return InMemoryWorkload(spec=f"remat.auto:{type(self.model).__qualname__}", shape={},
                                device=str(self.device), dtype=dtype,
                                workload=Workload(model=self.model, batch=lambda step: clone_batch(batch), loss=loss),
                                autocast=self.autocast, source=self, ranks=self.ranks)


def check_job(engine: JobEngine, ranks: Any, *, quick_verify: bool, copy_fn: Any) -> None:
    """A wrapped model is planned in place, inside its process group; what cannot run there is refused."""
    if engine is JobEngine.NONE:
        return
    if ranks is None:
        raise AutoError(f"the model is wrapped by {engine.value.upper()} but no default process group is "
                        "initialised: remat.auto plans a wrapped model on all of the job's ranks at once",
                        tip="call remat.auto in the torchrun job, after init_process_group and the wrapping")
    if quick_verify:
        raise AutoError(f"verify='quick' compares a copy of the model with a planned copy, and a "
                        f"{engine.value.upper()} model cannot be copied",
                        tip="verify the plan at this world size with `remat distributed` on a workload file")
    if copy_fn is not None:
        raise AutoError(f"copy_fn is not used for a {engine.value.upper()} model: it is profiled in place, its "
                        "state saved and restored (NOTE [wrapped models in place])", tip="drop copy_fn")
