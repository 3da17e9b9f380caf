"""The user's model, batch, loss and optimizer as a workload whose every build is a copy.

NOTE [no side effects]
``remat.auto`` profiles and measures real training steps, but never on the user's objects:
every build (``InMemoryWorkload.rebuild``) is a fresh copy of the model (``copy.deepcopy``, or
the caller's ``copy_fn``), a fresh optimizer of the user's class and hyperparameters over the
copy's parameters (groups mapped by position in ``model.parameters()``), and a clone of the
example batch per step (so the CPU tracker counts the batch as the step's own bytes, as a
workload's ``batch(step)`` would). The user's parameters, buffers, gradients, optimizer state
and ``training`` flag are never written; every global RNG stream (torch CPU and CUDA, Python,
NumPy) is captured before and restored after (``remat.verify.probe.RngState``). On CUDA the
user's own tensors would sit in the allocator beside the copy and inflate every measured peak,
so they are *parked* on the CPU while remat measures and moved back after, bitwise
(``Parked``): the same ``Parameter`` and tensor objects, the same values, on the same device.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import AutoError, WorkloadError
from ..workload import LoadedWorkload, Workload, with_autocast

LossFn = Callable[[nn.Module, Any], torch.Tensor]
CopyFn = Callable[[nn.Module], nn.Module]


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default loss: ``model(**batch).loss`` (Hugging Face models with ``labels`` in the batch)."""
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise AutoError(f"{type(model).__name__}(**batch) returned no .loss",
                        tip="pass loss_fn=lambda model, batch: ... returning the scalar training loss")
    return loss


def default_loss(batch: Any) -> LossFn:
    """``hf_loss`` for a dict batch with ``labels``; otherwise AutoError asking for ``loss_fn``."""
    if isinstance(batch, Mapping) and "labels" in batch:
        return hf_loss
    what = f"a dict without 'labels' (keys: {', '.join(map(str, batch))})" if isinstance(batch, Mapping) \
        else f"a {type(batch).__name__}"
    raise AutoError(f"no loss_fn was given and the example batch is {what}: remat.auto needs the training loss",
                    tip="pass loss_fn=lambda model, batch: <scalar loss>, or a dict batch with labels for "
                        "model(**batch).loss")


def clone_batch(batch: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, batch)


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` or Lightning's ``LightningOptimizer``."""
    seen = 0
    while seen < 8:
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt or not isinstance(inner, torch.optim.Optimizer):
            break
        opt, seen = inner, seen + 1
    if not isinstance(opt, torch.optim.Optimizer):
        raise AutoError(f"optimizer= must be a torch.optim.Optimizer, got {type(opt).__name__}")
    return opt


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """How to build the user's optimizer again on a copy: class, constructor defaults, groups.

    ``groups``: per param group, the positions of its parameters in ``list(model.parameters())``
    and its hyperparameters (``lr``, ``weight_decay``... as the group holds them now)."""

    cls: type
    defaults: dict[str, Any]
    groups: tuple[tuple[tuple[int, ...], dict[str, Any]], ...]
    assumed: bool                  # True: the caller passed none; the AdamW default below was assumed

    @classmethod
    def of(cls, model: nn.Module, optimizer: Any | None) -> "OptimizerSpec":
        params = list(model.parameters())
        if optimizer is None:
            idx = tuple(i for i, p in enumerate(params) if p.requires_grad)
            return cls(cls=torch.optim.AdamW, defaults={"lr": 1e-3}, groups=((idx, {}),), assumed=True)
        opt = unwrap_optimizer(optimizer)
        where = {id(p): i for i, p in enumerate(params)}
        groups = []
        for g in opt.param_groups:
            missing = [tuple(p.shape) for p in g["params"] if id(p) not in where]
            if missing:
                raise AutoError(f"the optimizer holds {len(missing)} parameter(s) that are not in the model "
                                f"(shapes {missing[:3]}): remat cannot rebuild it on a copy of the model",
                                tip="pass an optimizer over model.parameters() (or a subset), or none")
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append((tuple(where[id(p)] for p in g["params"]), hyper))
        return cls(cls=type(opt), defaults=dict(opt.defaults), groups=tuple(groups), assumed=False)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        params = list(model.parameters())
        groups = [{**hyper, "params": [params[i] for i in idx]} for idx, hyper in self.groups]
        try:
            # the groups carry every hyperparameter; the constructor gets the defaults it names
            # (AdamW's defaults hold ``decoupled_weight_decay``, which its __init__ does not take)
            sig = inspect.signature(self.cls.__init__).parameters
            takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.values())
            kwargs = {k: v for k, v in self.defaults.items() if takes_all or k in sig}
            return self.cls(groups, **kwargs)
        except Exception as exc:
            raise AutoError(f"cannot rebuild the optimizer {self.cls.__name__} on a copy of the model: "
                            f"{type(exc).__name__}: {exc}",
                            tip="pass optimizer=None to plan with AdamW, or an optimizer whose class takes "
                                "(param_groups, **optimizer.defaults)") from exc

    def describe(self) -> str:
        """``'AdamW(lr=0.001) over 12 of 14 parameters (1 group)'``; what the peak counted."""
        hyper = ", ".join(f"{k}={v}" for k, v in sorted(self.defaults.items())
                          if k in ("lr", "weight_decay", "momentum", "betas", "eps") and v is not None)
        n = sum(len(idx) for idx, _ in self.groups)
        text = f"{self.cls.__name__}({hyper}) over {n} parameter(s) in {len(self.groups)} group(s)"
        if self.assumed:
            text += (" [assumed: no optimizer was passed, so the peak counts AdamW state for every parameter "
                     "that requires grad; pass optimizer= to count yours]")
        return text

    def key(self) -> list[Any]:
        return [f"{self.cls.__module__}.{self.cls.__qualname__}", repr(sorted(self.defaults.items())),
                [[list(idx), repr(sorted(h.items()))] for idx, h in self.groups]]


def copy_model(model: nn.Module) -> nn.Module:
    try:
        return copy.deepcopy(model)
    except Exception as exc:
        raise AutoError(f"cannot copy {type(model).__name__} to profile it without touching yours "
                        f"(copy.deepcopy raised {type(exc).__name__}: {exc})",
                        tip="pass copy_fn=... that builds an equal model (same parameters and buffers)") from exc


class ModelSource:
    """Builds fresh copies of the user's training step (NOTE [no side effects])."""

    def __init__(self, model: nn.Module, batch: Any, loss: LossFn, optimizer: OptimizerSpec,
                 device: torch.device, copy_fn: CopyFn | None = None, autocast: str | None = None,
                 accumulation_steps: int = 1) -> None:
        self.model, self.batch, self.loss, self.optimizer = model, batch, loss, optimizer
        self.device = device
        self.copy_fn = copy_fn or copy_model
        self.autocast = autocast   # "bfloat16"/"float16": the loss runs under torch.autocast (NOTE [autocast steps])
        # micro-batches per optimizer step: every build runs the accumulated step (NOTE [accumulated step])
        self.accumulation_steps = accumulation_steps

    @property
    def in_place(self) -> bool:
        """False: every build is a copy (NOTE [no side effects]); True: the user's model itself
        (NOTE [wrapped models in place] in inplace.py)."""
        return False

    def restore(self) -> None:
        """Put the user's model back as it was found; nothing to do when every build was a copy."""

    def workload(self) -> Workload:
        model = self.copy_fn(self.model)
        if not isinstance(model, nn.Module):
            raise AutoError(f"copy_fn returned {type(model).__name__}, not a torch.nn.Module")
        if self.device.type != "cpu":
            model.to(self.device)    # the user's model is parked on the CPU meanwhile (Parked)
        batch, spec = self.batch, self.optimizer
        return with_autocast(Workload(model=model, batch=lambda step: clone_batch(batch), loss=self.loss,
                                      optimizer=lambda params: spec.build(model)), str(self.device), self.autocast)

    def loaded(self) -> "InMemoryWorkload":
        """The workload every stage rebuilds from. Its own model is a copy on the ``meta`` device:
        the identity verify checks (fingerprint, dtypes) without a byte of storage, because a real
        copy held here would sit in the CUDA allocator under every peak the closed loop measures
        (it did: +0.5 GiB on a LoRA GPT-2 small, benchmarks/lora_gpt2.py). Only rebuilds are real."""
        p = next(iter(self.model.parameters()), None)
        dtype = str(p.dtype).replace("torch.", "") if p is not None else "float32"
        meta = self.copy_fn(self.model).to("meta")
        batch, loss = self.batch, self.loss
        return InMemoryWorkload(spec=f"remat.auto:{type(self.model).__qualname__}", shape={},
                                device=str(self.device), dtype=dtype,
                                workload=Workload(model=meta, batch=lambda step: clone_batch(batch), loss=loss),
                                autocast=self.autocast, source=self)


@dataclasses.dataclass(kw_only=True)
class InMemoryWorkload(LoadedWorkload):
    """A LoadedWorkload whose every rebuild is a fresh copy of the user's objects (one shape: the batch's)."""

    source: ModelSource

    def rebuild(self, **shape_overrides: Any) -> "InMemoryWorkload":
        if shape_overrides:
            raise WorkloadError(f"remat.auto's workload has one shape, its example batch; cannot rebuild it at "
                                f"{shape_overrides}")
        workload = dataclasses.replace(self.source.workload(), accumulation_steps=self.source.accumulation_steps)
        return dataclasses.replace(self, workload=workload)


class Parked:
    """On CUDA: move the user's parameters, buffers, grads and optimizer state to the CPU, and back
    on exit, bitwise and in place (``t.data = ...``: the same tensor objects). NOTE [no side effects]."""

    def __init__(self, model: nn.Module, optimizer: Any | None) -> None:
        tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
        if optimizer is not None:
            opt = unwrap_optimizer(optimizer)
            tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        seen: set[int] = set()
        self.tensors = [t for t in tensors if t.device.type == "cuda" and not (id(t) in seen or seen.add(id(t)))]
        self.devices: list[torch.device] = []

    def __enter__(self) -> "Parked":
        self.devices = [t.device for t in self.tensors]
        with torch.no_grad():
            for t in self.tensors:
                t.data = t.data.to("cpu")
        if self.tensors:
            torch.cuda.empty_cache()
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for t, dev in zip(self.tensors, self.devices):
                t.data = t.data.to(dev)


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise AutoError(f"{type(model).__name__} has no parameters: there is nothing to train or plan")


def trainable(params: Iterable[nn.Parameter]) -> list[bool]:
    return [p.requires_grad for p in params]
