"""What verification reports: per-step comparisons, hazards, negative controls, RNG policy.

NOTE [tolerances]
Agreement of one tensor is judged as a whole, not element by element:

    max |planned - control|  <=  atol + rtol * max |control|

Element-wise ``allclose`` is misleading for gradients, most of whose entries are near
zero. ``rtol`` is a few units in the last place of the dtype (float32: 1e-5, about 80 ulps
of the largest element; bfloat16: 1.6e-2, 4 ulps; float16: 2e-3, 4 ulps). Eager
non-reentrant checkpointing on CPU float32 is *bitwise* equal to the control (measured),
so each comparison also records whether it was bitwise. Integer tensors must be equal.
The perturbed-gradient negative control perturbs by 1e-3 relative, or by 4 x rtol where
that is larger (bfloat16), so it always lies outside the tolerance it tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import VerificationFailed
from ..types import HazardKind

VERIFY_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    rtol: float  # relative to max |control| of the tensor
    atol: float  # absolute floor, in the tensor's units

    def __post_init__(self) -> None:
        if self.rtol < 0 or self.atol < 0:
            raise ValueError(f"tolerances must be >= 0, got rtol={self.rtol}, atol={self.atol}")

    def allows(self, max_abs: float, ref_max_abs: float) -> bool:
        return max_abs <= self.atol + self.rtol * ref_max_abs

    def to_json(self) -> dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


# Per floating dtype (NOTE [tolerances]); other dtypes must match exactly.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-12, atol=1e-15),
    "float32": Tolerance(rtol=1e-5, atol=1e-8),
    "bfloat16": Tolerance(rtol=1.6e-2, atol=1e-5),
    "float16": Tolerance(rtol=2e-3, atol=1e-7),
}
PERTURBATION = 1e-3  # relative size of the perturbed-gradient negative control (one part in a thousand)


@dataclasses.dataclass(kw_only=True)
class StepComparison:
    """Control vs planned after one step of one seed (``mode`` "train", or "eval": no optimizer step)."""

    seed: int
    step: int
    mode: str
    loss: tuple[float, float]                 # (control, planned)
    outputs_max_abs: float | None             # model outputs the loss saw; None: none reachable
    grad_max_abs: float                       # max over parameters of max |g_planned - g_control|
    grad_max_rel: float                       # max over parameters of that / max |g_control|
    grads_bitwise: bool
    grad_norm: tuple[float, float]            # global L2 norm (control, planned), float64
    params_max_abs: float | None              # after optimizer.step(); None in eval mode
    buffers_max_abs: float
    bitwise: bool                             # every compared tensor bitwise equal
    divergent: list[str]                      # what is out of tolerance, e.g. "grad h.1.mlp.c_fc.weight"
    first_divergent_module: str | None
    first_divergence: str | None              # where it showed first: "forward output", "gradient", ...
    passed: bool

    def to_json(self) -> dict[str, Any]:
        d = {k: _json_float(v) for k, v in dataclasses.asdict(self).items()}
        d["loss"] = [_json_float(x) for x in self.loss]
        d["grad_norm"] = [_json_float(x) for x in self.grad_norm]
        return d


def _json_float(x: Any) -> Any:
    """JSON has no inf/nan: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hazard:
    """An externally visible replay side effect, e.g. ``blocks.2.calls: 1 -> 2``."""

    module: str          # the boundary it happened in
    kind: HazardKind
    detail: str
    mode: str = "train"  # "train" or "eval"
    seed: int = 0
    step: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "kind": self.kind.value, "detail": self.detail, "mode": self.mode,
                "seed": self.seed, "step": self.step}


@dataclasses.dataclass(frozen=True, kw_only=True)
class NegativeControl:
    """A deliberately wrong run that verification must reject; ``rejected`` is None when not applicable."""

    name: str
    applicable: bool
    rejected: bool | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True)
class BoundaryActivity:
    """What one checkpointed module did per step: calls, replays, RNG draws, mutations seen at replay."""

    module: str
    mode: str                           # "full" or "selective"
    guarded: bool
    forward_calls: dict[str, int]       # per step, by "train"/"eval"
    replay_calls: dict[str, int]        # per step, by "train"/"eval"
    draws_rng: bool                     # the global RNG advanced across its forward
    replay_mutations: list[str]         # state its replay changed (after any guard): "bn1.running_mean"
    device_moves: list[str]             # "aten._to_copy: cpu -> cuda:0 (forward)"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RngPolicy:
    preserve_rng_state: bool
    policy: str                         # "preserve" or "off"
    justification: str
    boundaries_drawing_rng: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["boundaries_drawing_rng"] = list(self.boundaries_drawing_rng)
        return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class RngTiming:
    """Warm whole-step time of the planned step with and without RNG preservation (ms)."""

    with_ms: float                      # p50
    without_ms: float                   # p50
    with_p95_ms: float
    without_p95_ms: float
    steps: int                          # timed steps per variant

    @property
    def overhead_ms(self) -> float:
        return self.with_ms - self.without_ms

    def to_json(self) -> dict[str, Any]:
        return {"with_ms": self.with_ms, "without_ms": self.without_ms, "overhead_ms": self.overhead_ms,
                "with_p95_ms": self.with_p95_ms, "without_p95_ms": self.without_p95_ms, "steps": self.steps}


@dataclasses.dataclass(kw_only=True)
class VerifyReport:
    passed: bool
    workload: str
    shape: dict[str, Any]
    device: str
    dtype: str
    planner: str
    plan_digest: str                    # fingerprint digest of the model the plan is bound to
    steps: int
    seeds: list[int]
    tolerances: dict[str, Tolerance]
    perturbation: float                 # relative size used by the perturbed-gradient control
    per_step: list[StepComparison]
    first_divergent_module: str | None
    rng_policy: RngPolicy
    rng_timing: RngTiming | None
    hazards: list[Hazard]
    negative_controls: list[NegativeControl]
    boundaries: list[BoundaryActivity]
    repeatable: bool                    # the control twice, same seed: equal (else nothing can be proved)
    failures: list[str]                 # why it failed, one line each
    warnings: list[str] = dataclasses.field(default_factory=list)  # e.g. non-finite control gradients
    schema_version: int = VERIFY_SCHEMA_VERSION

    @property
    def rng_overhead_ms(self) -> float | None:
        return None if self.rng_timing is None else self.rng_timing.overhead_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "passed": self.passed,
            "workload": self.workload, "shape": dict(self.shape), "device": self.device, "dtype": self.dtype,
            "planner": self.planner, "plan_digest": self.plan_digest,
            "steps": self.steps, "seeds": list(self.seeds),
            "tolerances": {k: v.to_json() for k, v in self.tolerances.items()}, "perturbation": self.perturbation,
            "per_step": [s.to_json() for s in self.per_step],
            "first_divergent_module": self.first_divergent_module,
            "rng_policy": self.rng_policy.to_json(),
            "rng_overhead_ms": self.rng_overhead_ms,
            "rng_timing": None if self.rng_timing is None else self.rng_timing.to_json(),
            "hazards": [h.to_json() for h in self.hazards],
            "negative_controls": [n.to_json() for n in self.negative_controls],
            "boundaries": [b.to_json() for b in self.boundaries],
            "repeatable": self.repeatable,
            "failures": list(self.failures),
            "warnings": list(self.warnings),
        }

    def raise_if_failed(self) -> None:
        """Raise :class:`VerificationFailed` (exit code 1) carrying the failures."""
        if not self.passed:
            shown = "; ".join(self.failures[:5]) + (f"; ... ({len(self.failures) - 5} more)" if len(self.failures) > 5 else "")
            raise VerificationFailed(f"verification failed: {shown}")
