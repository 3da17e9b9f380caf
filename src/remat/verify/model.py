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
from typing import Any

from .._codec import FloatAsWritten, JsonCodec, NonFinite, json_field
from ..errors import VerificationFailed
from ..plan.spec import PlannerText
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
class Tolerance(JsonCodec):
    rtol: FloatAsWritten  # relative to max |control| of the tensor
    atol: FloatAsWritten  # absolute floor, in the tensor's units

    def __post_init__(self) -> None:
        if self.rtol < 0 or self.atol < 0:
            raise ValueError(f"tolerances must be >= 0, got rtol={self.rtol}, atol={self.atol}")

    def allows(self, max_abs: float, ref_max_abs: float) -> bool:
        return max_abs <= self.atol + self.rtol * ref_max_abs



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
# flip sign between two compiled graphs.
#
# NOTE [cancelled gradients]
# A float sum's rounding error scales with the terms summed, not with the sum. A gradient that
# cancels to ~0 (a BatchNorm bias followed by a convolution and another BatchNorm) is all
# rounding, and two compiled graphs (even the unplanned step eager and compiled) disagree on it
# completely. So under compile a gradient whose whole magnitude lies within
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
class StepComparison(JsonCodec):
    """Control vs planned after one step of one seed (``mode`` "train", or "eval": no optimizer step).

    Its differences may be inf or nan, written as the strings "inf", "-inf", "nan" (``NonFinite``)."""

    seed: int
    step: int
    mode: RunMode
    loss: tuple[NonFinite, NonFinite]         # (control, planned)
    outputs_max_abs: NonFinite | None         # model outputs the loss saw; None: none reachable
    grad_max_abs: NonFinite                   # max over parameters of max |g_planned - g_control|
    grad_max_rel: NonFinite                   # max over parameters of that / max |g_control|
    grads_bitwise: bool
    grad_norm: tuple[NonFinite, NonFinite]    # global L2 norm (control, planned), float64
    params_max_abs: NonFinite | None          # after optimizer.step(); None in eval mode
    buffers_max_abs: NonFinite
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hazard(JsonCodec):
    """An externally visible replay side effect, e.g. ``blocks.2.calls: 1 -> 2``."""

    module: str          # the boundary it happened in ("a, b" when several replays are to blame)
    kind: HazardKind
    detail: str
    mode: RunMode = RunMode.TRAIN
    seed: int = 0
    step: int = 0
    # the state that changed ("blocks.0.bn1.num_batches_tracked"), for de-duplication; not in the JSON
    state: str = json_field(default="", compare=False, skip=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", RunMode(self.mode))

    @property
    def modules(self) -> list[str]:
        """The boundaries it names."""
        return [m.strip() for m in self.module.split(",") if m.strip()]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NegativeControl(JsonCodec):
    """A deliberately wrong run that verification must reject; ``rejected`` is None when not applicable."""

    name: str
    applicable: bool
    rejected: bool | None
    detail: str


@dataclasses.dataclass(kw_only=True)
class BoundaryActivity(JsonCodec):
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RngPolicy(JsonCodec):
    preserve_rng_state: bool
    policy: RngPolicyKind
    justification: str
    boundaries_drawing_rng: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RngPolicyKind(self.policy))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RngTiming(JsonCodec):
    """Warm whole-step time of the planned step with and without RNG preservation (ms)."""

    with_ms: FloatAsWritten             # p50
    without_ms: FloatAsWritten = json_field(then=("overhead_ms",))   # p50; the JSON adds the overhead
    with_p95_ms: FloatAsWritten
    without_p95_ms: FloatAsWritten
    steps: int                          # timed steps per variant

    @property
    def overhead_ms(self) -> float:
        return self.with_ms - self.without_ms


@dataclasses.dataclass(kw_only=True)
class VerifyReport(JsonCodec):
    schema_version: int = VERIFY_SCHEMA_VERSION
    passed: bool
    workload: str
    shape: dict[str, Any]
    device: str
    dtype: str
    planner: PlannerText                # the plan's planner spec; its JSON is the text
    plan_digest: str                    # fingerprint digest of the model the plan is bound to
    steps: int
    seeds: list[int]
    tolerances: dict[str, Tolerance]
    perturbation: float                 # relative size used by the perturbed-gradient control
    per_step: list[StepComparison]
    first_divergent_module: str | None
    rng_policy: RngPolicy = json_field(then=("rng_overhead_ms",))   # the JSON adds the overhead after it
    rng_timing: RngTiming | None
    hazards: list[Hazard]
    negative_controls: list[NegativeControl]
    boundaries: list[BoundaryActivity]
    repeatable: bool                    # the control twice, same seed: equal (else nothing can be proved)
    failures: list[str]                 # why it failed, one line each
    warnings: list[str] = dataclasses.field(default_factory=list)  # e.g. non-finite control gradients
    # CompileSpec JSON: both sides ran compiled (NOTE [compiled tolerances]); left out of the JSON when None
    compile: dict[str, Any] | None = json_field(default=None, omit=None)
    # both sides' forward ran under torch.autocast of this dtype (NOTE [autocast tolerances]); left out when None
    autocast: str | None = json_field(default=None, omit=None)

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

    def raise_if_failed(self) -> None:
        """Raise :class:`VerificationFailed` (exit code 1) carrying the failures."""
        if not self.passed:
            shown = "; ".join(self.failures[:5]) + (f"; ... ({len(self.failures) - 5} more)" if len(self.failures) > 5 else "")
            raise VerificationFailed(f"verification failed: {shown}")
