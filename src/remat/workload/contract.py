"""The workload contract (DESIGN.md) and the one training step every stage runs."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..errors import WorkloadError
from ..types import Phase

PhaseMarker = Callable[[Phase], None]


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclasses.dataclass
class Workload:
    """A training step: a model, a deterministic batch per step, a loss, an optimizer.

    ``batch(step)`` must return the same data for the same ``step``; ``loss(model, batch)``
    is the forward phase and must return a scalar tensor; ``optimizer(params)`` builds the
    optimizer (AdamW, lr 1e-3 when omitted).
    """

    model: nn.Module
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise WorkloadError(f"Workload.model must be a torch.nn.Module, got {type(self.model).__name__}")
        for name in ("batch", "loss"):
            if not callable(getattr(self, name)):
                raise WorkloadError(f"Workload.{name} must be callable, got {type(getattr(self, name)).__name__}")
        if self.optimizer is not None and not callable(self.optimizer):
            raise WorkloadError("Workload.optimizer must be callable(params) -> torch.optim.Optimizer or None")

    def make_optimizer(self) -> torch.optim.Optimizer:
        factory = self.optimizer or _default_optimizer
        try:
            opt = factory(self.model.parameters())
        except Exception as exc:  # the user's code: report it, typed
            raise WorkloadError(f"the workload's optimizer factory raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(opt, torch.optim.Optimizer):
            raise WorkloadError(f"the workload's optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt


def _noop(_: Phase) -> None:
    return None


class TrainingStep:
    """Runs whole training steps of a workload: batch, forward, backward, optimizer.

    One optimizer per ``TrainingStep``; ``run(step)`` is the step every measurement times.
    ``marker(phase)`` is called as each phase starts (and ``marker(None)``-free: the end of
    the step is the return), so tracers can label what happens in between.
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.optimizer = workload.make_optimizer()

    def run(self, step: int, marker: PhaseMarker = _noop) -> float:
        w = self.workload
        marker(Phase.BATCH)
        try:
            batch = w.batch(step)
        except Exception as exc:
            raise WorkloadError(f"the workload's batch({step}) raised {type(exc).__name__}: {exc}") from exc
        marker(Phase.FORWARD)
        loss = self.forward(batch)
        marker(Phase.BACKWARD)
        loss.backward()
        marker(Phase.OPTIMIZER)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def forward(self, batch: Any) -> torch.Tensor:
        """The forward phase with the contract checked: a scalar, differentiable loss."""
        loss = self.workload.loss(self.workload.model, batch)
        if not isinstance(loss, torch.Tensor):
            raise WorkloadError(f"the workload's loss returned {type(loss).__name__}, not a tensor")
        if loss.numel() != 1 or loss.dim() != 0:
            raise WorkloadError(
                f"the workload's loss must be a scalar tensor, got shape {tuple(loss.shape)}",
                tip="reduce it, e.g. with .mean()",
            )
        if not loss.requires_grad:
            raise WorkloadError("the workload's loss does not require grad: nothing to train")
        return loss
