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
import enum
import math
from typing import Any

from ..errors import VerificationFailed
from ..types import CheckpointMode, HazardKind

VERIFY_SCHEMA_VERSION = 1


class RunMode(str, enum.Enum):
    """How a compared step runs: ``train`` (forward, backward, optimizer step) or ``eval`` (the model
    in eval mode, forward and backward, no optimizer step)."""

    TRAIN = "train"
    EVAL = "eval"

    def __str__(self) -> str:
        return self.value


class Site(str, enum.Enum):
    """Where a divergence showed first (NOTE [first divergent module] in remat.verify.probe)."""

    CALL_ORDER = "forward call order"
    FORWARD_OUTPUT = "forward output"
    GRADIENT = "gradient"
    BUFFER = "buffer"
    PYTHON_ATTRIBUTE = "python attribute"
    PARAMETER = "parameter after optimizer step"
    GENERATOR = "generator state"
    LOSS_OR_OUTPUTS = "loss or outputs"

    def __str__(self) -> str:
        return self.value


class RngPolicyKind(str, enum.Enum):
    PRESERVE = "preserve"   # RNG state stashed at each boundary's forward, restored for its replay
    OFF = "off"             # preserve_rng_state=False

    def __str__(self) -> str:
        return self.value


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
# NOTE [compiled tolerances]
# Under --compile the control is the *compiled* unplanned step and the plan the compiled planned
# step (an eager control would charge inductor's own reordering and fusion to the plan). Two
# compiled graphs that differ by checkpoint regions are partitioned and fused differently, so
# float sums are reassociated: bitwise equality is not expected, and the eager tolerances above
# (set for "the same kernels, replayed") are too tight. These are per dtype, stated in every
# report made with --compile, and kept under the perturbed-gradient control's size (PERTURBATION,
# one part in a thousand) so that control is still rejected. Parameters *after the optimizer step*
# get atol = 2 x the learning rate on top (remat.verify.runner._param_tolerances): AdamW's first
# steps move each element by about lr x sign(grad), and gradient elements within rounding of zero
# flip sign between two compiled graphs (seen on mlp, benchmarks/compile_check.py: every gradient
# within 1.7e-5 relative, yet two parameters out of the plain tolerance after step 0).
#
# NOTE [cancelled gradients]
# A float sum's rounding error scales with the terms summed, not with the sum. A gradient that
# cancels to ~0 (torchvision EfficientNet-B0's features.1.0.block.2.1.bias: a BatchNorm bias
# followed by a convolution and another BatchNorm, max |g| 4.4e-7) is all rounding, and two
# compiled graphs disagree on it completely: the *unplanned* step eager and compiled differed
# there by 1.5x its magnitude at step 0 and 2.3x at step 1 (3.5x on the worst parameter), and a
# correct compiled plan by 1.65x. So under compile a gradient whose whole magnitude lies within
# ``rtol x`` the model's largest gradient is compared at that scale (atol + rtol x the largest
# gradient), as the error of the sums it came from allows; every other gradient keeps its own
# magnitude, so the perturbed-gradient control (one part in a thousand of a gradient that is not
# cancellation noise) is still rejected.
COMPILED_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-9, atol=1e-12),
    "float32": Tolerance(rtol=1e-4, atol=1e-6),
    "bfloat16": Tolerance(rtol=3e-2, atol=1e-4),
    "float16": Tolerance(rtol=5e-3, atol=1e-6),
}
# NOTE [autocast tolerances]
# Under autocast (NOTE [autocast steps] in remat/workload/contract.py) parameters and gradients
# stay float32, but every matmul and convolution that produced them ran in bfloat16 or float16,
# so their rounding is the autocast dtype's. A float tensor wider than the autocast dtype is
# therefore compared at the autocast dtype's tolerance (float32 under bf16: rtol 1.6e-2), never
# tighter than its own; the perturbed-gradient control grows with it (4 x rtol: 6.4e-2 under
# bf16) so it still lies outside. On CPU a correct plan is still *bitwise* equal (a replay runs
# the same bf16 kernels under the recorded autocast state), and each comparison records whether
# it was; the wider tolerance is for devices whose reduced-precision kernels are not
# reproducible run to run. The table used is in every report (``tolerances``, ``autocast``).
_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def tolerance_table(*, compiled: bool = False, autocast: str | None = None) -> dict[str, Tolerance]:
    """The per-dtype tolerances of one verification: eager or compiled (NOTE [compiled tolerances]),
    widened under ``autocast`` (``"bfloat16"``/``"float16"``: NOTE [autocast tolerances])."""
    base = COMPILED_TOLERANCES if compiled else TOLERANCES
    if autocast is None:
        return dict(base)
    low = base[autocast]
    return {k: (Tolerance(rtol=max(v.rtol, low.rtol), atol=max(v.atol, low.atol))
                if _WIDTH.get(k, 0) > _WIDTH[autocast] else v) for k, v in base.items()}


PERTURBATION = 1e-3  # relative size of the perturbed-gradient negative control (one part in a thousand)


@dataclasses.dataclass(kw_only=True)
class StepComparison:
    """Control vs planned after one step of one seed (``mode`` "train", or "eval": no optimizer step)."""

    seed: int
    step: int
    mode: RunMode
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
    first_divergence: Site | None             # where it showed first
    passed: bool

    def __post_init__(self) -> None:
        self.mode = RunMode(self.mode)   # "train"/"eval" accepted: the enum's values
        self.first_divergence = None if self.first_divergence is None else Site(self.first_divergence)

    @property
    def divergences(self) -> list[Divergence]:
        """``divergent`` as records (verify reads its own format: ``"<kind> <tensor or state>"``)."""
        return [Divergence.parse(d) for d in self.divergent]

    def to_json(self) -> dict[str, Any]:
        d = {k: _json_float(v) for k, v in dataclasses.asdict(self).items()}
        d["mode"] = self.mode.value
        d["first_divergence"] = None if self.first_divergence is None else self.first_divergence.value
        d["loss"] = [_json_float(x) for x in self.loss]
        d["grad_norm"] = [_json_float(x) for x in self.grad_norm]
        return d

    @classmethod
    def from_json(cls, s: dict[str, Any]) -> "StepComparison":
        return cls(seed=s["seed"], step=s["step"], mode=RunMode(s["mode"]), loss=(_f(s["loss"][0]), _f(s["loss"][1])),
                   outputs_max_abs=_opt_f(s["outputs_max_abs"]), grad_max_abs=_f(s["grad_max_abs"]),
                   grad_max_rel=_f(s["grad_max_rel"]), grads_bitwise=s["grads_bitwise"],
                   grad_norm=(_f(s["grad_norm"][0]), _f(s["grad_norm"][1])),
                   params_max_abs=_opt_f(s["params_max_abs"]), buffers_max_abs=_f(s["buffers_max_abs"]),
                   bitwise=s["bitwise"], divergent=list(s["divergent"]),
                   first_divergent_module=s["first_divergent_module"],
                   first_divergence=None if s["first_divergence"] is None else Site(s["first_divergence"]),
                   passed=s["passed"])


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One entry of ``StepComparison.divergent``: what kind of value differs, and which.

    ``kind``: "loss", "output", "grad", "param", "buffer", "python", "rng" or "grad_norm";
    ``name``: the tensor, attribute or generator (None for the loss and the grad norm)."""

    kind: str
    name: str | None

    def __str__(self) -> str:
        return self.kind if self.name is None else f"{self.kind} {self.name}"

    @classmethod
    def parse(cls, text: str) -> "Divergence":
        kind, _, name = text.partition(" ")
        return cls(kind, name or None)

    def under(self, module: str) -> bool:
        """Whether it names a tensor or attribute of ``module`` or of a module inside it."""
        n = self.name
        return n is not None and self.kind != "rng" and (n == module or n.startswith(module + "."))


def _f(x: Any) -> float:
    return float(x)  # "inf"/"nan" strings included (the JSON encoding of non-finite values, _json_float)


def _opt_f(x: Any) -> float | None:
    return None if x is None else float(x)


def _json_float(x: Any) -> Any:
    """JSON has no inf/nan: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hazard:
    """An externally visible replay side effect, e.g. ``blocks.2.calls: 1 -> 2``."""

    module: str          # the boundary it happened in ("a, b" when several replays are to blame)
    kind: HazardKind
    detail: str
    mode: RunMode = RunMode.TRAIN
    seed: int = 0
    step: int = 0
    # the state that changed ("blocks.0.bn1.num_batches_tracked"), for de-duplication; not in the JSON
    state: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", RunMode(self.mode))

    @property
    def modules(self) -> list[str]:
        """The boundaries it names."""
        return [m.strip() for m in self.module.split(",") if m.strip()]

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "kind": self.kind.value, "detail": self.detail, "mode": self.mode.value,
                "seed": self.seed, "step": self.step}

    @classmethod
    def from_json(cls, h: dict[str, Any]) -> "Hazard":
        return cls(module=h["module"], kind=HazardKind(h["kind"]), detail=h["detail"], mode=RunMode(h["mode"]),
                   seed=h["seed"], step=h["step"])


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
    mode: CheckpointMode
    guarded: bool
    forward_calls: dict[str, int]       # per step, by RunMode value ("train", "eval")
    replay_calls: dict[str, int]        # per step, by RunMode value ("train", "eval")
    draws_rng: bool                     # the global RNG advanced across its forward
    replay_mutations: list[str]         # state its replay changed (after any guard): "bn1.running_mean"
    device_moves: list[str]             # "aten._to_copy: cpu -> cuda:0 (forward)"

    def __post_init__(self) -> None:
        self.mode = CheckpointMode(self.mode)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mode": self.mode.value}

    @classmethod
    def from_json(cls, b: dict[str, Any]) -> "BoundaryActivity":
        return cls(module=b["module"], mode=CheckpointMode(b["mode"]), guarded=b["guarded"],
                   forward_calls=dict(b["forward_calls"]), replay_calls=dict(b["replay_calls"]),
                   draws_rng=b["draws_rng"], replay_mutations=list(b["replay_mutations"]),
                   device_moves=list(b["device_moves"]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RngPolicy:
    preserve_rng_state: bool
    policy: RngPolicyKind
    justification: str
    boundaries_drawing_rng: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RngPolicyKind(self.policy))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["policy"] = self.policy.value
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
    compile: dict[str, Any] | None = None   # CompileSpec JSON: both sides ran compiled (NOTE [compiled tolerances])
    autocast: str | None = None         # both sides' forward ran under torch.autocast of this dtype (NOTE [autocast tolerances])
    schema_version: int = VERIFY_SCHEMA_VERSION

    @property
    def rng_overhead_ms(self) -> float | None:
        return None if self.rng_timing is None else self.rng_timing.overhead_ms

    def implicates(self, module: str) -> bool:
        """Whether a failure names ``module``: a divergent tensor or attribute under it, a first divergence
        in it, or a hazard in its replay."""
        def under(name: str | None) -> bool:
            return name is not None and (name == module or name.startswith(module + "."))
        return (any(d.under(module) for s in self.per_step for d in s.divergences)
                or any(under(s.first_divergent_module) for s in self.per_step)
                or any(module in h.modules for h in self.hazards))

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
            **({} if self.compile is None else {"compile": self.compile}),
            **({} if self.autocast is None else {"autocast": self.autocast}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "VerifyReport":
        """The report ``to_json`` wrote (validated first by the reader's schema: remat.receipt)."""
        timing = d["rng_timing"]
        pol = d["rng_policy"]
        return cls(
            passed=d["passed"], workload=d["workload"], shape=dict(d["shape"]), device=d["device"], dtype=d["dtype"],
            planner=d["planner"], plan_digest=d["plan_digest"], steps=d["steps"], seeds=list(d["seeds"]),
            tolerances={k: Tolerance(**v) for k, v in d["tolerances"].items()}, perturbation=float(d["perturbation"]),
            per_step=[StepComparison.from_json(s) for s in d["per_step"]],
            first_divergent_module=d["first_divergent_module"],
            rng_policy=RngPolicy(preserve_rng_state=pol["preserve_rng_state"], policy=RngPolicyKind(pol["policy"]),
                                 justification=pol["justification"],
                                 boundaries_drawing_rng=tuple(pol["boundaries_drawing_rng"])),
            rng_timing=None if timing is None else RngTiming(
                with_ms=timing["with_ms"], without_ms=timing["without_ms"], with_p95_ms=timing["with_p95_ms"],
                without_p95_ms=timing["without_p95_ms"], steps=timing["steps"]),
            hazards=[Hazard.from_json(h) for h in d["hazards"]],
            negative_controls=[NegativeControl(**n) for n in d["negative_controls"]],
            boundaries=[BoundaryActivity.from_json(b) for b in d["boundaries"]],
            repeatable=d["repeatable"], failures=list(d["failures"]), warnings=list(d["warnings"]),
            compile=d.get("compile"), autocast=d.get("autocast"), schema_version=d["schema_version"])

    def raise_if_failed(self) -> None:
        """Raise :class:`VerificationFailed` (exit code 1) carrying the failures."""
        if not self.passed:
            shown = "; ".join(self.failures[:5]) + (f"; ... ({len(self.failures) - 5} more)" if len(self.failures) > 5 else "")
            raise VerificationFailed(f"verification failed: {shown}")
