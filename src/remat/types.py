"""Enums shared by several stages (DESIGN.md: shared types live here)."""

from __future__ import annotations

import enum


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
    SIMULATED = "simulated"


from typing import Callable  # noqa: E402

# Progress callback for long library work: (what, done, total). Library code never prints;
# the CLI renders this with rich.
ProgressFn = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    return None


class CheckpointMode(str, enum.Enum):
    """What a plan does with one candidate module."""

    KEEP = "keep"            # no checkpoint: its activations stay saved until backward
    FULL = "full"            # non-reentrant torch.utils.checkpoint: only its inputs are kept
    SELECTIVE = "selective"  # SAC: matmul/attention outputs saved, cheap ops recomputed


class HazardKind(str, enum.Enum):
    """Replay hazards found in a candidate (profile) or observed at replay (verify)."""

    BUFFER_MUTATION = "buffer_mutation"      # e.g. BatchNorm running stats updated in forward
    RNG = "rng"                              # draws random numbers (dropout): safe while RNG is preserved
    PYTHON_STATE = "python_state"            # a Python attribute of the module changed in forward
    DEVICE_MOVE = "device_move"              # a tensor moved between devices inside the region
    INPLACE_INPUT = "inplace_input"          # an op wrote in place into one of the region's inputs


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
