"""``export_check_fn``: a plan as a ``check_fn`` for torch's ``apply_activation_checkpointing``."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..errors import PlanError
from ..plan.model import Plan
from .handle import check_plan_fingerprint, load_plan, resolve_modules


class PlanCheckFn:
    """``check_fn(module) -> bool``: True exactly for the modules the plan checkpoints (by identity)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.paths = tuple(modules)
        self._ids = {id(m): p for p, m in modules.items()}
        self._keep = tuple(modules.values())  # keep them alive so ids stay unique

    def __call__(self, module: nn.Module) -> bool:
        return id(module) in self._ids

    def __repr__(self) -> str:
        return f"PlanCheckFn({', '.join(self.paths)})"


def export_check_fn(plan: Plan | str | Path, model: nn.Module, *, check_fingerprint: bool = True,
                    allow_unguarded: bool = False) -> PlanCheckFn:
    """A ``check_fn`` for ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``.

    Use it (FSDP, Hugging Face, Lightning) as::

        apply_activation_checkpointing(model, checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT), check_fn=export_check_fn(plan, model))

    Why the model is needed: a plan names modules by *path* (``h.3``), but torch calls
    ``check_fn`` with bare module objects, and the paths change as wrappers are inserted
    (``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``). So the plan's paths are
    resolved to module *identities* once, on the model as the plan knows it (fingerprint
    checked), before torch starts re-parenting modules. Call it before any wrapping.

    torch's wrapper cannot express remat's per-boundary extras: the RNG policy and the
    SAC policy come from your ``checkpoint_wrapper_fn``, and buffer guards (NOTE [buffer
    guard]) do not exist there, so a plan with guarded boundaries is refused unless
    ``allow_unguarded=True`` (its BatchNorm statistics would be updated twice per step).
    ``apply_activation_checkpointing`` never wraps the root module; a plan naming ``""``
    is refused.
    """
    plan = load_plan(plan)
    if check_fingerprint:
        check_plan_fingerprint(model, plan)
    guarded = [b.module for b in plan.boundaries if b.guarded]
    if guarded and not allow_unguarded:
        raise PlanError(f"boundaries {', '.join(guarded)} need remat's buffer guard, which torch's checkpoint_wrapper lacks",
                        tip="use remat.apply(model, plan), or pass allow_unguarded=True to accept double-updated buffers")
    segments = [b.module for b in plan.boundaries if "[" in b.module]
    if segments:
        raise PlanError(f"boundaries {', '.join(segments)} are segments (one checkpoint around several modules), "
                        "which torch's per-module checkpoint_wrapper cannot express",
                        tip="apply the plan with remat.apply, or re-plan without segments")
    if any(b.module == "" for b in plan.boundaries):
        raise PlanError("the plan checkpoints the root module, which apply_activation_checkpointing never wraps",
                        tip="use remat.apply(model, plan)")
    return PlanCheckFn(resolve_modules(model, [b.module for b in plan.boundaries]))
