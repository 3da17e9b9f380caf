"""Enums shared by several stages (docs/DESIGN.md: shared types live here)."""

from __future__ import annotations

import dataclasses
import enum

# NOTE [module names]
# torch accepts any non-empty child name without a "." (``add_module`` checks only that):
# torchvision's RegNet names its blocks ``block1-0``, other models use "+", ":" or non-ASCII
# letters. A plan or receipt is data (module paths are only looked up in named_modules()), yet
# a name that reads like code (quotes, parentheses, "/", "$", ";", spaces) is refused anyway: no
# model we have met uses one, and a receipt carrying one is more likely an attack than a model.
# So: word characters (Unicode letters, digits, "_") and "-", "+", ":", "@", "#", "~", "=";
# never ".", "[", "]" (the path separator and remat's segment syntax, ``container[start:stop]``).
MODULE_NAME_RE = r"[\w\-+:@#~=]+"
MODULE_PATH_RE = MODULE_NAME_RE + r"(?:\." + MODULE_NAME_RE + r")*"


class Phase(str, enum.Enum):
    """Phases of one training step, in the order they run."""

    BATCH = "batch"          # batch(step): data making and host->device copy
    FORWARD = "forward"      # loss(model, batch): model call + loss
    BACKWARD = "backward"    # loss.backward()
    OPTIMIZER = "optimizer"  # optimizer.step() + zero_grad(set_to_none=True)


class MemCategory(str, enum.Enum):
    """What a live storage is, for the breakdown at the peak."""

    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    BATCH = "batch"
    ACTIVATIONS = "activations"  # saved for backward (seen by a saved_tensors pack hook)
    OTHER = "other"              # temporaries, outputs not saved, autograd buffers


class MemorySource(str, enum.Enum):
    """Which instrument produced a byte figure. Every figure records one."""

    CUDA_ALLOCATOR = "cuda-allocator"
    CPU_LIVE_TENSORS = "cpu-live-tensors"
    CPU_ALLOCATOR = "cpu-allocator"           # remat's counter inside the CPU allocator (NOTE [CPU allocator counter])
    CPU_PROFILER = "cpu-profiler-allocator"   # torch.profiler's CPU allocator events: compiled steps on CPU
    SIMULATED = "simulated"

    def __str__(self) -> str:   # the word a report prints: "cpu-live-tensors", not "MemorySource.CPU_LIVE_TENSORS"
        return self.value


import typing  # noqa: E402
from typing import Callable  # noqa: E402

# Progress callback for long library work: (what, done, total). Library code never prints;
# the CLI renders this with rich.
ProgressFn = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    return None


class RankReduce(typing.Protocol):
    """The ranks of a job that run every measured step together (NOTE [one plan per job] in
    remat/autoplan/ranks.py): each measured figure is replaced by its reduction over them, so every
    rank sees the same numbers and takes the same decisions. One process: no reducer at all (None)."""

    def max_bytes(self, value: int) -> int: ...

    def median_ms(self, values: list[float]) -> list[float]: ...

    def gather(self, value: typing.Any) -> list[typing.Any]:
        """``value`` of every rank, in rank order (a collective: every rank calls it)."""
        ...


class CheckpointMode(str, enum.Enum):
    """What a plan does with one candidate module."""

    KEEP = "keep"            # no checkpoint: its activations stay saved until backward
    FULL = "full"            # non-reentrant torch.utils.checkpoint: only its inputs are kept
    SELECTIVE = "selective"  # SAC: matmul/attention outputs saved, cheap ops recomputed
    SAVE_ATTENTION = "save-attention"            # SAC: only attention outputs saved, the rest recomputed
    RECOMPUTE_POINTWISE = "recompute-pointwise"  # SAC: only pointwise and norm ops recomputed, the rest saved
    OFFLOAD = "offload"      # nothing recomputed: its saved activations wait in host memory (NOTE [activation offload])
    # a segment recomputed as in FULL, and the one thing FULL keeps, its input, waits in host memory until the
    # replay loads it back (NOTE [segment input on the host] in remat/wrap/offload.py)
    FULL_HOST_INPUT = "full-host-input"

    @property
    def holds_host(self) -> bool:
        """Whether this mode keeps bytes in host memory (offload is on, and the host budget bounds it)."""
        return self in (CheckpointMode.OFFLOAD, CheckpointMode.FULL_HOST_INPUT)


class HazardKind(str, enum.Enum):
    """Replay hazards found in a candidate (profile) or observed at replay (verify)."""

    BUFFER_MUTATION = "buffer_mutation"      # e.g. BatchNorm running stats updated in forward
    RNG = "rng"                              # draws random numbers (dropout): safe while RNG is preserved
    PYTHON_STATE = "python_state"            # a Python attribute of the module changed in forward
    DEVICE_MOVE = "device_move"              # a tensor moved between devices inside the region
    INPLACE_INPUT = "inplace_input"          # an op wrote in place into one of the region's inputs
    HOOK = "hook"                            # a user's forward / pre-forward hook inside the region fires on replay
    GLOBAL_STATE = "global_state"            # a module global or closure cell the forward writes changes on replay
    GLOBAL_READ = "global_read"              # one the forward only reads has another value when backward replays it


# NOTE [selective policy ops]
# Selective checkpointing (SAC) saves the outputs of these ops (matmuls, attention,
# convolutions: expensive to recompute, compact to keep) and recomputes everything else.
# ``remat.profile`` predicts SAC savings and replay time from this set and ``remat.apply``
# builds its policy from it, so the prediction and the wrapper can never disagree.
# Names are aten overload-packet names (``func._overloadpacket.__name__``).
SAC_SAVE_OPS: frozenset[str] = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "linear", "convolution", "_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
})


# NOTE [op-level policies]
# Every mode but KEEP and FULL is an op-level (SAC) policy: the region runs under torch's
# ``create_selective_checkpoint_contexts`` and the policy keeps some ops' outputs for
# backward and recomputes the others at replay. ``sac_saves`` is the one
# definition, used by remat.profile (kept bytes, dry runs, measured replays) and remat.apply
# (the wrapper's policy), so the prediction and the wrapper can never disagree:
#   SELECTIVE            keep SAC_SAVE_OPS (matmuls, convolutions, attention)
#   SAVE_ATTENTION       keep SAC_ATTENTION_OPS only (Megatron's "selective", reversed:
#                        the attention core is kept, its projections and MLP recomputed)
#   RECOMPUTE_POINTWISE  keep everything except *cheap* ops (aten's ``pointwise`` tag, and views,
#                        which compute nothing: a kept view would keep its base alive) and
#                        NORM_OPS: the cheap ops are recomputed, every matmul and reduction kept
# Each is offered per candidate only where it keeps something and frees something different
# from the modes before it, then dry-run (NOTE [mode dry runs]) and measured like any other.
SAC_ATTENTION_OPS: frozenset[str] = frozenset(n for n in SAC_SAVE_OPS if "attention" in n)
NORM_OPS: frozenset[str] = frozenset({
    "native_layer_norm", "layer_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "batch_norm",
    "native_group_norm", "group_norm", "_fused_rms_norm", "rms_norm",
})
OP_POLICY_MODES: tuple[CheckpointMode, ...] = (CheckpointMode.SELECTIVE, CheckpointMode.SAVE_ATTENTION,
                                               CheckpointMode.RECOMPUTE_POINTWISE)


def sac_saves(mode: CheckpointMode, op_name: str, cheap: bool) -> bool:
    """Whether op-level ``mode`` keeps the output of op ``op_name`` (an aten overload-packet name;
    ``cheap``: the op carries aten's pointwise tag or is a view). NOTE [op-level policies]."""
    if mode is CheckpointMode.SELECTIVE:
        return op_name in SAC_SAVE_OPS
    if mode is CheckpointMode.SAVE_ATTENTION:
        return op_name in SAC_ATTENTION_OPS
    if mode is CheckpointMode.RECOMPUTE_POINTWISE:
        return not (cheap or op_name in NORM_OPS)
    raise ValueError(f"{mode} is not an op-level policy mode")


def is_cheap_op(op: object) -> bool:
    """An aten OpOverload that is pointwise (aten's tag) or a view (NOTE [op-level policies])."""
    import torch   # only callers that hold a torch op get here
    return torch.Tag.pointwise in getattr(op, "tags", ()) or bool(getattr(op, "is_view", False))


@dataclasses.dataclass(frozen=True)
class LiveByKind:
    """Bytes live at a refused allocation, by what holds them (each storage once)."""

    parameters: int           # parameters and buffers
    gradients: int
    optimizer_state: int
    saved_activations: int    # saved for backward by the autograd graph reachable from the failing frames
    other: int                # everything else the ledger was charged: the batch, outputs, temporaries


@dataclasses.dataclass(frozen=True)
class Refusal:
    """An allocation a device capacity refused: a blocked step's evidence (bytes; NOTE [CPU device
    capacity] in remat/memory/capacity.py). ``remat.profile.model.describe_refusal`` words it."""

    capacity_bytes: int
    requested_bytes: int
    live_bytes: int           # charged to the ledger when the allocation was refused
    phase: Phase | None       # the step's phase then (None: outside a step)
    by_kind: LiveByKind | None = None
