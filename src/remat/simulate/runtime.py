"""The roofline runtime model: per-op times on a named device, summed by phase and module.

NOTE [roofline runtime model]
For every op that launches a kernel (NOTE [op costs]):

    t_op = calibration * (max(flops / peak_flops[dtype], bytes / bandwidth) + launch_overhead)

summed over the step (all four phases) for ``step_ms``, by phase for ``phase_ms``, and over
the forward-phase ops inside a module for ``module_fwd_ms[name]`` (inclusive of children).
What checkpointing a module costs at backward is a replay of its forward: ``replay_ms`` is
``module_fwd_ms`` for FULL, and for SELECTIVE the forward time *less* the ops a selective
policy saves instead of recomputing (matmul, convolution and attention ops:
``remat.types.SAC_SAVE_OPS``, the set remat.apply's policy saves, NOTE [selective policy ops]). Not modelled: overlap of host dispatch with kernels (the launch
term is simply added), kernel fusion, data-loader time, and any communication.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterable

from .._codec import JsonCodec, json_field
from ..types import SAC_SAVE_OPS, CheckpointMode, Phase
from .costs import OpRecord
from .devices import DeviceModel

def _packet(op: str) -> str:
    """``"aten.mm.default"`` -> ``"mm"`` (overload-packet name, as in SAC_SAVE_OPS)."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpTypeCost(JsonCodec):
    op: str        # op packet, e.g. "mm"
    count: int
    flops: int
    nbytes: int
    ms: float


@dataclasses.dataclass(kw_only=True)
class RuntimePrediction(JsonCodec):
    """Predicted times of one training step on ``device`` (ms, calibration included)."""

    device: str
    calibration: float
    step_ms: float
    phase_ms: dict[Phase, float]
    module_fwd_ms: dict[str, float]          # inclusive forward time per module ("" = root)
    module_selective_ms: dict[str, float]    # forward time less SAC_SAVE_OPS (what SELECTIVE recomputes)
    flops: int                               # whole step
    nbytes: int = json_field(key="bytes")     # bytes moved, whole step
    kernels: int                             # ops that launch a kernel
    top_ops: list[OpTypeCost]                # op types by predicted time, largest first

    def replay_ms(self, module: str, mode: CheckpointMode) -> float:
        """Added backward time if ``module`` is checkpointed in ``mode`` (NOTE [roofline runtime model])."""
        if mode is CheckpointMode.KEEP:
            return 0.0
        table = self.module_fwd_ms if mode is CheckpointMode.FULL else self.module_selective_ms
        return table.get(module, 0.0)


def op_ms(op: OpRecord, device: DeviceModel) -> float:
    """Predicted time of one op (ms); 0 for ops that launch no kernel."""
    if not op.kernel:
        return 0.0
    return device.op_seconds(op.flops, op.nbytes, op.dtype, conv=op.conv, scores=op.scores) * 1e3


def predict_runtime(ops: Iterable[OpRecord], device: DeviceModel, *, top: int = 15) -> RuntimePrediction:
    """Apply the roofline model to recorded ops (NOTE [roofline runtime model])."""
    phase_ms: dict[Phase, float] = {p: 0.0 for p in Phase}
    fwd: dict[str, float] = defaultdict(float)
    sel: dict[str, float] = defaultdict(float)
    by_type: dict[str, list] = defaultdict(lambda: [0, 0, 0, 0.0])
    flops = nbytes = kernels = 0
    total = 0.0
    for op in ops:
        ms = op_ms(op, device)
        total += ms
        if op.phase is not None:
            phase_ms[op.phase] += ms
        if op.kernel:
            kernels += 1
            flops += op.flops
            nbytes += op.nbytes
            agg = by_type[_packet(op.op)]
            agg[0] += 1
            agg[1] += op.flops
            agg[2] += op.nbytes
            agg[3] += ms
        if op.phase is Phase.FORWARD:
            saved = _packet(op.op) in SAC_SAVE_OPS
            for m in op.modules:
                fwd[m] += ms
                if not saved:
                    sel[m] += ms
            for m in op.modules:  # a module whose ops are all saved still has an entry
                sel.setdefault(m, 0.0)
    ranked = sorted(by_type.items(), key=lambda kv: -kv[1][3])[:top]
    return RuntimePrediction(
        device=device.name, calibration=device.calibration, step_ms=total, phase_ms=phase_ms,
        module_fwd_ms=dict(fwd), module_selective_ms=dict(sel), flops=flops, nbytes=nbytes, kernels=kernels,
        top_ops=[OpTypeCost(op=k, count=v[0], flops=v[1], nbytes=v[2], ms=v[3]) for k, v in ranked])
