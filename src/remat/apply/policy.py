"""Selective activation checkpointing (SAC) policies: which ops a SELECTIVE boundary saves.

NOTE [selective policy]
A SELECTIVE boundary runs under ``torch.utils.checkpoint`` with
``context_fn=partial(create_selective_checkpoint_contexts, policy)``: during the forward
the policy is asked, op by op, whether to keep the op's output for backward or drop it
and recompute it at replay. Matmuls, convolutions and attention are the expensive ops
whose outputs are cheap to keep relative to their FLOPs; norms, activations, dropout,
adds and views are cheap to recompute. This is the torchtitan "op-level SAC" policy.

Two limits worth knowing (TORCH-NOTES.md):
- an op whose saved output is later mutated in place (``linear(x).relu_()``) makes the
  backward raise ``Tensor cached during selective activation checkpoint has been
  mutated``: use FULL mode for such blocks;
- random ops (dropout) are recomputed, so the plan's ``preserve_rng_state`` must stay on.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

aten = torch.ops.aten


def _existing(*names: str) -> frozenset[Any]:
    """The ``aten`` overloads among ``names`` that this torch build has (``op.overload``)."""
    out = []
    for name in names:
        op_name, _, overload = name.partition(".")
        packet = getattr(aten, op_name, None)
        if packet is not None and hasattr(packet, overload or "default"):
            out.append(getattr(packet, overload or "default"))
    return frozenset(out)


# Outputs worth keeping: FLOP-heavy ops whose recompute costs more than the bytes they hold.
DEFAULT_SAVE_OPS: frozenset[Any] = _existing(
    "mm.default", "addmm.default", "bmm.default", "baddbmm.default", "_scaled_mm.default",
    "convolution.default", "_convolution.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
    "_flash_attention_forward.default", "_efficient_attention_forward.default",
)


class SaveMatmulPolicy:
    """SAC policy: save the outputs of ``save_ops`` (matmul, conv, attention), recompute the rest.

    One override point, :meth:`decide`; ``__call__`` has the signature
    ``create_selective_checkpoint_contexts`` expects.
    """

    def __init__(self, save_ops: frozenset[Any] = DEFAULT_SAVE_OPS) -> None:
        self.save_ops = save_ops

    def decide(self, op: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in self.save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return self.decide(op)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.save_ops)} save ops)"


def selective_context_fn(policy: SaveMatmulPolicy | None = None) -> Callable[[], tuple[ContextManager, ContextManager]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (or ``checkpoint_wrapper``) running ``policy``."""
    return functools.partial(create_selective_checkpoint_contexts, policy or SaveMatmulPolicy())
