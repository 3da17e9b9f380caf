"""Replacing a library's own checkpointing (transformers, diffusers) with remat's plan, measured against it.

NOTE [library checkpointing baseline]
``remat.integrations.transformers.enable`` and ``remat.integrations.diffusers.enable`` are
drop-ins for the libraries' own switches (``activation_checkpointing_enable()`` /
``gradient_checkpointing_enable()``, ``enable_gradient_checkpointing()``). If the model was
checkpointed by its library before the call, that configuration is recorded first (which
layers carry ``gradient_checkpointing=True``, and the ``_gradient_checkpointing_func`` each
calls), then switched off with the library's own ``disable`` call, so the two never stack.
remat.auto then plans the unwrapped model. The recorded configuration is the *baseline*: it is
rebuilt on fresh copies (the same flags on the same module paths, the same function; or, when
the caller asked for one with ``every_n_layers`` / ``baseline=True``, the library's own
``enable`` call on the copy) and measured against remat's plan by the same instruments: the
whole-step peak of one warm step of each alone (CPU live-tensor tracker or CUDA allocator), and
warm step times interleaved round-robin (``remat.measure.time_round_robin``). The user's model
is parked on the CPU meanwhile on CUDA, and its plan taken off and put back by module path
(NOTE [no side effects] in remat/autoplan/source.py). ``handle.baseline`` holds the figures;
``baseline=False`` skips the measuring (no extra steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

from torch import nn

from ..autoplan import AutoHandle, auto
from ..autoplan.library_flags import CheckpointingAPI, checkpointing_api, flagged_modules
from ..autoplan.source import ModelSource, OptimizerSpec, Parked, default_loss, model_device
from ..errors import AutoError
from ..measure import Arm, discard, measure_arm_peak, prepare_arm, time_round_robin
from ..types import MemorySource
from ..units import fmt_bytes
from ..wrap import PlanArm, apply

BASELINE_STEPS = 5   # interleaved warm steps per side (ms figures are their p50)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LibraryCheckpointing:
    """How to put the library's checkpointing on a fresh copy: the flags recorded on the user's model
    (``flags``: module path -> its ``_gradient_checkpointing_func``), or the library's ``enable`` call
    (``enable_kwargs``) when nothing was recorded. ``describe`` is what a user would have called."""

    api: CheckpointingAPI
    describe: str
    flags: dict[str, Any] | None = None
    enable_kwargs: dict[str, Any] | None = None

    @classmethod
    def recorded(cls, model: nn.Module, api: CheckpointingAPI) -> "LibraryCheckpointing | None":
        """The library checkpointing ``model`` has on now; None when no layer is flagged."""
        named = dict(model.named_modules())
        paths = [("" if p == "<root>" else p) for p in flagged_modules(model)]
        if not paths:
            return None
        return cls(api=api, describe=f"{api.enable}() as the model had it ({len(paths)} flagged modules)",
                   flags={p: getattr(named[p], "_gradient_checkpointing_func", None) for p in paths})

    def put_on(self, model: nn.Module) -> None:
        if self.flags is None:
            getattr(model, self.api.enable)(**(self.enable_kwargs or {}))
            return
        named = dict(model.named_modules())
        for path, func in self.flags.items():
            if func is not None:
                named[path]._gradient_checkpointing_func = func
            named[path].gradient_checkpointing = True

    def take_off(self, model: nn.Module) -> None:
        getattr(model, self.api.disable)()


class LibraryArm(Arm):
    """A fresh copy with the library's own checkpointing on (the baseline of NOTE [library checkpointing baseline])."""

    def __init__(self, label: str, setup: LibraryCheckpointing) -> None:
        super().__init__(label)
        self.setup = setup

    def prepare(self, fresh: Any) -> Callable[[], None]:
        model = fresh.workload.model
        self.setup.put_on(model)
        return lambda: self.setup.take_off(model)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointingBaseline:
    """The library's checkpointing against remat's plan, measured on copies (bytes, ms)."""

    what: str                   # the library call it stands for
    library: str
    peak_bytes: int             # one warm step, the library's checkpointing on
    plan_peak_bytes: int        # one warm step, remat's plan applied
    memory_source: MemorySource
    step_ms: float              # p50 of warm steps, interleaved with the plan's
    plan_step_ms: float
    steps: int

    @property
    def saved_bytes(self) -> int:
        """How many bytes less remat's plan peaks at than the library's checkpointing (negative: more)."""
        return self.peak_bytes - self.plan_peak_bytes

    def summary(self) -> str:
        return (f"{self.what}: peak {fmt_bytes(self.peak_bytes)}, {self.step_ms:.1f} ms; remat's plan: peak "
                f"{fmt_bytes(self.plan_peak_bytes)}, {self.plan_step_ms:.1f} ms (p50 of {self.steps} interleaved "
                f"warm steps each; peaks from {self.memory_source})")


class EnableHandle(AutoHandle):
    """``remat.auto``'s handle, with ``.baseline``: the library checkpointing it replaced, measured (or None)."""

    def __init__(self, handle: AutoHandle, baseline: CheckpointingBaseline | None) -> None:
        super().__init__(handle, handle.report)
        self.baseline = baseline


def replace_library_checkpointing(model: nn.Module, example_batch: Any, *, budget: str | int, optimizer: Any,
                                  requested: LibraryCheckpointing | None, baseline: bool | None,
                                  auto_kwargs: dict[str, Any]) -> EnableHandle:
    """Record and switch off the library's checkpointing, plan with remat.auto, measure the baseline
    (NOTE [library checkpointing baseline]). ``requested``: the library call to measure when the model
    had none on; ``baseline``: None measures when there is one to measure, False never, True always."""
    api = checkpointing_api(model)
    recorded = LibraryCheckpointing.recorded(model, api) if api is not None else None
    if recorded is not None:
        recorded.take_off(model)
    setup = recorded or requested
    if baseline is True and setup is None:
        raise AutoError("baseline=True, but the model has no library checkpointing switch to measure "
                        "(neither transformers' nor diffusers')", tip="leave baseline out")
    handle = auto(model, example_batch, budget=budget, optimizer=optimizer, **auto_kwargs)
    if baseline is False or setup is None:
        return EnableHandle(handle, None)
    return measure_against(model, handle, example_batch, optimizer, setup, auto_kwargs)


def measure_against(model: nn.Module, handle: AutoHandle, example_batch: Any, optimizer: Any,
                    setup: LibraryCheckpointing, auto_kwargs: dict[str, Any]) -> EnableHandle:
    """The baseline measured on copies of the unwrapped model; the plan put back on ``model`` after."""
    plan, report = handle.plan, handle.report
    loss = auto_kwargs.get("loss_fn") or default_loss(example_batch)
    device = model_device(model)
    handle.remove()
    try:
        source = ModelSource(model, example_batch, loss, OptimizerSpec.of(model, optimizer), device,
                             auto_kwargs.get("copy_fn"), autocast=report.autocast,
                             accumulation_steps=report.accumulation_steps)   # the step the plan was made for
        with Parked(model, optimizer) if device.type == "cuda" else contextlib.nullcontext():
            figures = _measure(source, setup, plan)
    finally:
        handle = AutoHandle(apply(model, plan), report)
    return EnableHandle(handle, figures)


def _measure(source: ModelSource, setup: LibraryCheckpointing, plan: Any) -> CheckpointingBaseline:
    loaded = source.loaded()
    lib_arm, plan_arm = LibraryArm("library", setup), PlanArm("remat", plan)
    lib_peak = measure_arm_peak(loaded, lib_arm, warmup=1)
    plan_peak = measure_arm_peak(loaded, plan_arm, warmup=1)
    runners = [prepare_arm(loaded, lib_arm), prepare_arm(loaded, plan_arm)]
    try:
        times = time_round_robin(runners, warmup=1, steps=BASELINE_STEPS, what="baseline timing")
    finally:
        discard(runners)
    return CheckpointingBaseline(what=setup.describe, library=setup.api.library, peak_bytes=lib_peak.peak_bytes,
                                 plan_peak_bytes=plan_peak.peak_bytes, memory_source=lib_peak.source,
                                 step_ms=times.p50("library"), plan_step_ms=times.p50("remat"), steps=BASELINE_STEPS)
