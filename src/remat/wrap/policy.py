"""Selective activation checkpointing (SAC) policies: which ops a SELECTIVE boundary saves.

NOTE [selective policy]
A SELECTIVE boundary runs under ``torch.utils.checkpoint`` with
``context_fn=partial(create_selective_checkpoint_contexts, policy)``: during the forward
the policy is asked, op by op, whether to keep the op's output for backward or drop it
and recompute it at replay. Matmuls, convolutions and attention are the expensive ops
whose outputs are cheap to keep relative to their FLOPs; norms, activations, dropout,
adds and views are cheap to recompute. This is the torchtitan "op-level SAC" policy.

Two limits worth knowing (docs/TORCH-NOTES.md):
- an op whose saved output is later mutated in place (``linear(x).relu_()``) makes the
  backward raise ``Tensor cached during selective activation checkpoint has been
  mutated``: use FULL mode for such blocks;
- random ops (dropout) are recomputed, so the plan's ``preserve_rng_state`` must stay on.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager

from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from ..types import SAC_SAVE_OPS, CheckpointMode, is_cheap_op, sac_saves

# The op set is shared with remat.profile (NOTE [selective policy ops] in remat.types), so the
# profiler's SELECTIVE prediction and this wrapper can never disagree.
DEFAULT_SAVE_OPS: frozenset[str] = SAC_SAVE_OPS


def op_name(op: Any) -> str:
    """Overload-packet name of an aten op: ``aten.addmm.default`` -> ``"addmm"``."""
    packet = getattr(op, "_overloadpacket", None) or getattr(op, "overloadpacket", None)
    return str(getattr(packet, "__name__", op))


class SaveMatmulPolicy:
    """SAC policy: save the outputs of ``save_ops`` (matmul, conv, attention; packet names), recompute the rest.

    One override point, :meth:`decide`; ``__call__`` has the signature
    ``create_selective_checkpoint_contexts`` expects.
    """

    def __init__(self, save_ops: frozenset[str] = DEFAULT_SAVE_OPS) -> None:
        self.save_ops = save_ops

    def decide(self, op: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op_name(op) in self.save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return self.decide(op)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.save_ops)} save ops)"


class OpLevelPolicy:
    """SAC policy of an op-level mode other than SELECTIVE (NOTE [op-level policies] in remat.types):
    ``SAVE_ATTENTION`` keeps attention outputs only; ``RECOMPUTE_POINTWISE`` recomputes only
    pointwise and norm ops. One override point, :meth:`decide`."""

    def __init__(self, mode: CheckpointMode) -> None:
        sac_saves(mode, "", False)   # ValueError for a mode that is not op-level
        self.mode = mode

    def decide(self, op: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if sac_saves(self.mode, op_name(op), is_cheap_op(op)) \
            else CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return self.decide(op)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mode.value})"


def selective_context_fn(policy: SaveMatmulPolicy | OpLevelPolicy | None = None) -> Callable[[], tuple[ContextManager, ContextManager]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (or ``checkpoint_wrapper``) running ``policy``."""
    return functools.partial(create_selective_checkpoint_contexts, policy or SaveMatmulPolicy())


def traceable_context_fn(policy: SaveMatmulPolicy | OpLevelPolicy | None = None) -> Callable[[], tuple[ContextManager, ContextManager]]:
    """:func:`selective_context_fn` in the form torch.compile accepts (NOTE [wrapper under compile]
    in remat/wrap/wrapper.py): Dynamo takes a checkpoint's ``context_fn`` only as a Python
    constant, and a ``partial`` holding a policy *object* is not one, while one holding a plain
    function is. The function is made here, outside any compiled region, and calls the policy."""
    chosen = policy or SaveMatmulPolicy()

    def remat_policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return chosen(ctx, op, *args, **kwargs)

    return functools.partial(create_selective_checkpoint_contexts, remat_policy)

