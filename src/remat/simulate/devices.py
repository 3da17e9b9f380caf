"""Named device models for the roofline runtime model (``--target-device``).

NOTE [device model figures]
Peak FLOP/s are NVIDIA's published *dense* figures (the datasheets quote tensor-core numbers
"with sparsity": dense is half of those). HBM bandwidth and capacity are the datasheet figures;
``memory_bytes`` is the total ``nvidia-smi`` reports for that part. A roofline is an optimistic
bound: real eager kernels reach 40-80 % of peak, which is what ``fit_calibration`` corrects
from one measured step.

- H100 SXM5 80 GB  (NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column):
  FP32 67 TFLOP/s; TF32 tensor core 989 TFLOP/s with sparsity -> 494.5 dense;
  BF16/FP16 tensor core 1,979 with sparsity -> 989.5 dense; HBM3 3.35 TB/s; 80 GB (81,559 MiB).
- A100 SXM4 80 GB  (NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column):
  FP32 19.5 TFLOP/s; TF32 156 dense (312 sparse); BF16/FP16 312 dense (624 sparse);
  HBM2e 2,039 GB/s; 80 GB (81,920 MiB).
- H200 SXM 141 GB  (NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column): same compute as
  H100 SXM (FP32 67; TF32 494.5 dense; BF16/FP16 989.5 dense); HBM3e 4.8 TB/s; 141 GB (143,771 MiB).
- cpu: *measured*, not published: one thread of this project's CI machine (AMD EPYC, torch 2.13,
  1024^3 matmul and a 64 MiB copy) gave 55 GFLOP/s fp32, 137 GFLOP/s bf16, 13 GB/s copy, ~8 us per
  eager op; the model uses rounded-down (conservative) figures. Fit a calibration for your CPU.
- ``host_link``: device <-> host copy bandwidth per direction, for offload (NOTE [offload cost
  model] in remat/plan/offload.py): the datasheets' PCIe figures are bidirectional (H100/H200
  SXM "PCIe Gen5: 128 GB/s", A100 "PCIe Gen4: 64 GB/s"), so half each way, derated to 80% (what
  pinned copies reach in practice is below the link's nominal rate; measure with
  ``remat.measure.link_bandwidth`` on the machine itself); cpu: the 64 MiB copy above.

NOTE [attention scores]
A fused attention kernel's FLOPs (4 x scores x head dim, forward) say nothing of its softmax
(an exp, a running max and a sum per query x key score), which dominates when heads are
narrow: on one CPU thread the diffusers UNet's heads of dim 4 and 8 ran at 5-18 GFLOP/s, heads of
40-160 at 71-73 (``benchmarks/op_costs.py``, benchmarks/results/op_costs.json). So an attention op
also costs ``attention_score_s`` per score. cpu: 2 ns, the median of what the four narrow-head
shapes took per score beyond their FLOPs at the model's fp32 peak (1.0-2.8 ns). The CUDA parts:
0, not measured (flash attention there is bound by its matmuls, and this project has not timed
one). The backward op is charged the same per score as the forward, a floor.

NOTE [SAC op cost]
An op-level (SAC) checkpoint runs its region's forward under a Python dispatch mode that asks
the policy about every op and caches what it keeps, and replays under one in backward: a cost
per op of the region, whatever the op's size, that no FLOP or byte count holds.
``benchmarks/op_costs.py`` times a region of N tiny pointwise ops forward + backward plain and
under each op-level mode, interleaved: 12.8-14.4 us per op on one CPU thread for every op-level
mode (FULL: 1.0-1.8 us, the ops run again). cpu: 13 us (about the op-level modes' cost less FULL's). The CUDA
parts: the same figure, unmeasured there: it is host time, and on a GPU host it may hide behind
queued kernels.

Which peak an op gets: FLOPs come only from matmul/convolution/attention ops (the
``FlopCounterMode`` registry). On CUDA, fp32 matmuls run at the FP32 peak unless TF32 matmul is
enabled (``torch.backends.cuda.matmul.allow_tf32``, default False), while cuDNN convolutions use
TF32 by default (``torch.backends.cudnn.allow_tf32``, default True): ``tf32_matmul`` and
``tf32_conv`` say which the model assumes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._codec import JsonCodec
from .errors import SimulationError
from .semantics import KernelSemantics

_GB = 10**9
_MiB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceModel(JsonCodec):
    """A device for the roofline model: time per op = max(flops/peak, bytes/bandwidth) + launch."""

    name: str
    description: str
    semantics: KernelSemantics                 # which eager kernels the simulated step follows
    peak_flops: dict[str, float]               # dense FLOP/s by dtype name ("float32", "tf32", "bfloat16", ...)
    bandwidth: float                           # bytes/s (HBM or DRAM)
    launch_overhead_s: float                   # seconds added per kernel (host dispatch + launch)
    memory_bytes: int                          # device memory capacity (bytes)
    tf32_matmul: bool = False                  # fp32 matmuls at the TF32 peak (CUDA default: no)
    tf32_conv: bool = True                     # fp32 convolutions at the TF32 peak (cuDNN default: yes)
    host_link: float = 10 * _GB                # bytes/s each way between device and host (NOTE above)
    calibration: float = 1.0                   # multiplies every predicted time (fit_calibration)
    source: str = ""                           # where the figures come from
    attention_score_s: float = 0.0             # seconds per query x key score of a fused attention op (NOTE [attention scores])
    sac_op_s: float = 0.0                      # seconds an op-level (SAC) checkpoint adds per op of its region (NOTE [SAC op cost])

    def __post_init__(self) -> None:
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise SimulationError(f"device model {self.name!r}: peak_flops must be positive, got {self.peak_flops}")
        if self.bandwidth <= 0 or self.launch_overhead_s < 0:
            raise SimulationError(f"device model {self.name!r}: bandwidth must be > 0 and launch overhead >= 0")
        if not (self.calibration > 0 and math.isfinite(self.calibration)):
            raise SimulationError(f"device model {self.name!r}: calibration must be a positive number, "
                                  f"got {self.calibration}")

    def flops_peak(self, dtype: torch.dtype | None, *, conv: bool = False) -> float:
        """Dense FLOP/s for a matmul-class op whose inputs have ``dtype``."""
        key = str(dtype).replace("torch.", "") if dtype is not None else "float32"
        if key == "float32" and ((conv and self.tf32_conv) or (not conv and self.tf32_matmul)):
            key = "tf32"
        return self.peak_flops.get(key, self.peak_flops.get("float32", min(self.peak_flops.values())))

    def op_seconds(self, flops: int, nbytes: int, dtype: torch.dtype | None, *, conv: bool = False,
                   scores: int = 0) -> float:
        """Roofline time of one kernel (seconds), calibration included; ``scores``: an attention op's query x key
        scores, each costing ``attention_score_s`` on top of its FLOPs (NOTE [attention scores])."""
        compute = (flops / self.flops_peak(dtype, conv=conv) if flops else 0.0) + scores * self.attention_score_s
        return (max(compute, nbytes / self.bandwidth) + self.launch_overhead_s) * self.calibration

    def calibrated(self, factor: float) -> "DeviceModel":
        """The same device with ``factor`` applied to every predicted time (see fit_calibration)."""
        return dataclasses.replace(self, calibration=float(factor))


DEVICE_MODELS: dict[str, DeviceModel] = {
    "h100": DeviceModel(
        name="h100", host_link=0.8 * 64 * _GB, description="NVIDIA H100 SXM5 80 GB (HBM3)", semantics=KernelSemantics.CUDA,
        peak_flops={"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12,
                    "float64": 67e12},
        bandwidth=3.35e12, launch_overhead_s=5e-6, memory_bytes=81_559 * _MiB,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5), dense = sparse / 2"),
    "a100": DeviceModel(
        name="a100", host_link=0.8 * 32 * _GB, description="NVIDIA A100 SXM4 80 GB (HBM2e)", semantics=KernelSemantics.CUDA,
        peak_flops={"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12,
                    "float64": 19.5e12},
        bandwidth=2.039e12, launch_overhead_s=5e-6, memory_bytes=81_920 * _MiB,
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM), dense figures"),
    "h200": DeviceModel(
        name="h200", host_link=0.8 * 64 * _GB, description="NVIDIA H200 SXM 141 GB (HBM3e)", semantics=KernelSemantics.CUDA,
        peak_flops={"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12,
                    "float64": 67e12},
        bandwidth=4.8e12, launch_overhead_s=5e-6, memory_bytes=143_771 * _MiB,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM), dense = sparse / 2"),
    "cpu": DeviceModel(
        name="cpu", description="one CPU thread (conservative, measured on an AMD EPYC CI core)",
        semantics=KernelSemantics.CPU,
        peak_flops={"float32": 40e9, "tf32": 40e9, "bfloat16": 80e9, "float16": 20e9, "float64": 20e9},
        bandwidth=10 * _GB, launch_overhead_s=8e-6, memory_bytes=24 * 2**30,
        attention_score_s=2e-9, sac_op_s=13e-6,
        source="measured: torch 2.13 matmul 1024^3 and a 64 MiB copy on one thread, rounded down; attention "
               "scores and SAC's per-op cost: benchmarks/op_costs.py"),
}


def get_device_model(name: str | DeviceModel) -> DeviceModel:
    """``"h100"``, ``"a100"``, ``"h200"`` or ``"cpu"`` (case-insensitive), or a DeviceModel as is."""
    if isinstance(name, DeviceModel):
        return name
    model = DEVICE_MODELS.get(str(name).strip().lower())
    if model is None:
        raise SimulationError(f"unknown target device {name!r}; choose one of {', '.join(DEVICE_MODELS)}",
                              tip="or build a remat.simulate.DeviceModel with your device's figures")
    return model


def device_model_for(device: torch.device) -> DeviceModel:
    """The named model that prices ops run on ``device``: ``cpu`` for a CPU, else the CUDA part torch names
    (H200, A100), the H100 when the name matches none. Prices from counts (NOTE [prices from counts] in
    remat/profile/prices.py) use only its ratios (FLOP/s : bytes/s : launch); a measured calibration sets the scale."""
    if device.type != "cuda":
        return DEVICE_MODELS["cpu"]
    try:
        name = torch.cuda.get_device_name(device).lower()
    except (RuntimeError, AssertionError):   # no CUDA runtime to ask
        name = ""
    return next((m for key, m in DEVICE_MODELS.items() if key != "cpu" and key in name), DEVICE_MODELS["h100"])


def fit_calibration(measured_step_ms: float, predicted_step_ms: float) -> float:
    """The factor that makes the model's step time equal one measured warm step (measured / predicted).

    Use it as ``get_device_model("h100").calibrated(fit_calibration(measured, predicted))``, where
    ``predicted`` came from the *uncalibrated* model of the same workload and shape.
    """
    for label, v in (("measured_step_ms", measured_step_ms), ("predicted_step_ms", predicted_step_ms)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise SimulationError(f"fit_calibration: {label} must be a positive number of ms, got {v!r}")
    return float(measured_step_ms) / float(predicted_step_ms)
