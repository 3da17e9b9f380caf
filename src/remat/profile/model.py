"""What profiling hands to the planner: per-candidate costs and the peak rows of the step, and the
sample of steps they cover (NOTE [step sample] in profile/sample.py).

NOTE [peak cost model]
The planner predicts the whole-step peak of any assignment of modes to candidates from
one profiled baseline step (no checkpointing), as a maximum over *rows*:

    peak(choice) = max over rows r of
        r.base_bytes
        - sum over j in r.live      of candidate[j].saved_bytes[mode_j]
        + sum over j in r.replaying of candidate[j].replay_extra_bytes[mode_j]

``base_bytes`` is the largest live byte count the baseline reached at instants that
share the same signature: ``live`` are the candidates whose forward has finished and
whose backward has not started (their saved activations would be gone if checkpointed),
``replaying`` the candidates whose backward is running (a checkpointed one re-materialises
its activations there, plus its forward transients). ``saved_bytes[KEEP] = 0`` and
``replay_extra_bytes[KEEP] = 0``. Added time is ``sum of replay_ms[mode_j]``.
A parent and its child candidate are never both checkpointed (``parent`` links them).
A candidate called N > 1 times per step (``calls``) is listed in ``live`` once per call whose
activations are held at that instant, and each listing frees ``saved_bytes / N`` (NOTE [shared
modules] in profile/step.py): at the end of a siamese forward both calls count, during the
second call's backward only the first.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Annotated

from .._codec import JsonCodec, Len, Short, json_field
from .._json import BYTES, HEX64, MAX_MODULES, SHAPE, Enum, Int, List, Obj, Opt, Str
from ..errors import ShapeError, WorkloadError
from ..percentile import p50
from ..types import MODULE_PATH_RE, CheckpointMode, HazardKind, MemorySource, Phase, Refusal
from ..units import fmt_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class HazardRecord(JsonCodec):
    kind: HazardKind
    detail: str               # e.g. "bn1.running_mean, bn1.num_batches_tracked mutated in forward"
    guardable: bool = False   # remat can neutralise it (restore buffers around the replay)


@dataclasses.dataclass(kw_only=True)
class CandidateCost(JsonCodec):
    """One module that could be checkpointed, measured on the real step."""

    name: str                          # module path, e.g. "h.3" or "blocks.2.mlp"
    class_name: str
    order: int                         # forward order (0 = first to run)
    parent: str | None = json_field(absent=None)   # enclosing candidate, if any
    fwd_ms: float                      # warm median forward time (ms)
    input_bytes: int                   # bytes of its inputs a checkpoint keeps (ms of nothing, kept anyway)
    saved_bytes: dict[CheckpointMode, int]        # bytes freed until backward, per mode (KEEP: 0)
    replay_ms: dict[CheckpointMode, float]        # added backward time per mode (KEEP: 0.0)
    replay_extra_bytes: dict[CheckpointMode, int]  # extra live bytes while it replays (KEEP: 0)
    hazards: list[HazardRecord] = dataclasses.field(default_factory=list)
    # interquartile range of each measured replay cost (NOTE [measured replay costs]); a mode
    # missing here kept its first estimate (simulated, or not measurable alone)
    replay_spread_ms: dict[CheckpointMode, float] = dataclasses.field(default_factory=dict)
    # a segment (NOTE [segments] in profile/segments.py) lists its member module paths, in order;
    # a module candidate lists none
    members: tuple[str, ...] = ()
    # forward calls per step: a shared module's costs cover every call (NOTE [shared modules] in
    # profile/step.py); replay_ms and fwd_ms are for all of them
    calls: int = json_field(default=1, omit=1)   # written only when not 1
    # bytes of its inputs that ops inside it save for backward (allocated before it runs): a checkpoint
    # frees none of them, but an offload copies them to the host too (NOTE [offload cost model] in
    # remat/plan/offload.py); written only when not 0
    saved_input_bytes: int = json_field(default=0, omit=0)
    # a segment: bytes its input frees when it waits in host memory (mode FULL_HOST_INPUT), 0 where the
    # recorded step shows something else holds it (NOTE [segment input freed] in profile/step.py); written
    # only when not 0
    host_input_bytes: int = json_field(default=0, omit=0)
    # the device model's time (ms) of the forward ops a replay in each mode runs again, from the recorded
    # step's op counts (FLOPs, bytes, kernels): what its replay is priced from (NOTE [prices from counts] in
    # profile/prices.py); empty for a profile made before prices came from counts
    replay_work: dict[CheckpointMode, float] = json_field(default_factory=dict, omit={})

    @property
    def covers(self) -> tuple[str, ...]:
        """The module paths whose subtrees this candidate checkpoints (itself, or a segment's members)."""
        return self.members or (self.name,)

    @property
    def modes(self) -> list[CheckpointMode]:
        return [m for m in CheckpointMode if m in self.saved_bytes]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeakRow(JsonCodec):
    """A group of instants of the baseline step sharing one signature (NOTE [peak cost model])."""

    base_bytes: int
    live: tuple[str, ...]        # candidates whose saved activations are held here
    replaying: tuple[str, ...]   # candidates whose backward runs here
    label: str = ""              # human hint, e.g. "backward of h.3"


ROOT_OR_MODULE_PATH = Str(f"(?:{MODULE_PATH_RE})?", max_len=500)   # a fingerprint lists the root as ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamSignature(JsonCodec):
    name: Annotated[str, Str(max_len=500)]
    shape: Annotated[tuple[Annotated[int, Int(0, 2 ** 40)], ...], Len(16)]
    dtype: Short


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFingerprint(JsonCodec):
    """Identity of a model for plans and receipts: module tree, parameters, class sources."""

    digest: Annotated[str, HEX64]                 # sha256 over all of the below
    # (path, class name) for every module; the root's path is ""
    modules: Annotated[tuple[tuple[Annotated[str, ROOT_OR_MODULE_PATH], Short], ...], Len(MAX_MODULES)]
    params: Annotated[tuple[ParamSignature, ...], Len(MAX_MODULES)]
    # (qualified class name, the first 16 hex digits of the sha256 of its source)
    class_source_hashes: Annotated[tuple[tuple[Short, Annotated[str, Str(r"[0-9a-f]{16}")]], ...], Len(MAX_MODULES)]
    # classes with no readable source, hashed by structure (NOTE [class identity without source]);
    # written only when there are some
    structural_classes: Annotated[tuple[Short, ...], Len(MAX_MODULES)] = json_field(default=(), omit=())

    def differences(self, other: "ModelFingerprint") -> list[FingerprintDiff]:
        """What differs, as records whose ``str()`` reads well (empty when the digests agree)."""
        if self.digest == other.digest:
            return []
        D = FingerprintDiff
        out: list[FingerprintDiff] = []
        a, b = dict(self.modules), dict(other.modules)
        out += [D(kind=DiffKind.MODULE, name=m, text=f"module {m} missing") for m in sorted(a.keys() - b.keys())]
        out += [D(kind=DiffKind.MODULE, name=m, text=f"module {m} is new") for m in sorted(b.keys() - a.keys())]
        out += [D(kind=DiffKind.MODULE, name=m, text=f"module {m}: {a[m]} -> {b[m]}")
                for m in sorted(a.keys() & b.keys()) if a[m] != b[m]]
        pa, pb = {p.name: p for p in self.params}, {p.name: p for p in other.params}
        out += [D(kind=DiffKind.PARAMETER, name=n, text=f"parameter {n} missing") for n in sorted(pa.keys() - pb.keys())]
        out += [D(kind=DiffKind.PARAMETER, name=n, text=f"parameter {n} is new") for n in sorted(pb.keys() - pa.keys())]
        out += [D(kind=DiffKind.PARAMETER, name=n,
                  text=f"parameter {n}: {list(pa[n].shape)} {pa[n].dtype} -> {list(pb[n].shape)} {pb[n].dtype}")
                for n in sorted(pa.keys() & pb.keys()) if pa[n] != pb[n]]
        ca, cb = dict(self.class_source_hashes), dict(other.class_source_hashes)
        structural = set(self.structural_classes) | set(other.structural_classes)
        out += [D(kind=DiffKind.CLASS, name=c, text=f"source of class {c} changed" if c not in structural else
                  f"class {c} changed (hashed by its bytecode: no source was readable)")
                for c in sorted(ca.keys() & cb.keys()) if ca[c] != cb[c]]
        return out or [D(kind=DiffKind.DIGEST, name="", text="fingerprint digest differs")]


class DiffKind(str, enum.Enum):
    """What a fingerprint difference is about (a str enum: ``kind == "class"`` still reads)."""

    MODULE = "module"
    PARAMETER = "parameter"
    CLASS = "class"
    DIGEST = "digest"   # nothing more specific found


@dataclasses.dataclass(frozen=True, kw_only=True)
class FingerprintDiff:
    """One difference between two fingerprints: a module, parameter or class (by its path or
    qualified name), with the sentence that says it."""

    kind: DiffKind
    name: str      # module path, parameter name, or qualified class name
    text: str

    def __str__(self) -> str:
        return self.text

    def under(self, module: str, *, strictly: bool = False) -> bool:
        """Whether it is about ``module`` (unless ``strictly``) or a module or parameter inside it."""
        if self.kind not in (DiffKind.MODULE, DiffKind.PARAMETER):
            return False
        return self.name.startswith(module + ".") or (not strictly and self.name == module)


@dataclasses.dataclass(kw_only=True)
class ProfileReport(JsonCodec):
    """Everything the planner needs, measured on one workload at one shape."""

    candidates: list[CandidateCost]
    rows: list[PeakRow]
    excluded: dict[str, str]          # candidate name -> reason it cannot be planned as is
    baseline_peak_bytes: int          # measured peak of the unmodified step
    baseline_step_ms: float           # warm median of the unmodified step
    memory_source: MemorySource
    fingerprint: ModelFingerprint
    simulated: bool = False           # figures from FakeTensorMode + a device model
    device_model: str | None = None
    # suspicions a replay did not reproduce (NOTE [confirmed hazards]): name -> "kind: detail"
    refuted_hazards: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # modes that failed a dry run (NOTE [mode dry runs]): name -> mode value -> reason
    mode_excluded: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    # peak live bytes per phase of the profiled step (Phase value -> bytes); {} when unknown
    phase_peak_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # the excluded candidates that free nothing until backward (a subset of ``excluded``'s keys),
    # so a planner can tell them from telling exclusions without reading the reasons
    idle: list[str] = dataclasses.field(default_factory=list)
    # candidates whose replay could not be measured alone (name -> why): they keep first estimates
    replay_unmeasured: dict[str, str] = dataclasses.field(default_factory=dict)
    # candidates that took another's replay measurement (name -> the one measured; NOTE [shared
    # replay measurements] in profile/shared.py)
    replay_shared: dict[str, str] = dataclasses.field(default_factory=dict)
    # segments whose FULL replay is their members' measured sum (name -> members; NOTE [composed
    # segment replays] in profile/replay.py)
    replay_composed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # composed segments whose extra bytes are their family's shortest and longest segment's, which
    # measured the same (name -> [shortest, longest]; NOTE [extra bytes between equal ends] in profile/replay.py)
    replay_extra_between: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # (candidate, mode values) whose measured replay cost was below the clock's resolution: priced
    # at that resolution, not zero (NOTE [measured replay costs] in profile/replay.py)
    replay_below_resolution: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # measured ms per work ms: every price of a mode that replays forward ops (FULL, the op-level modes) is this
    # times the candidate's ``replay_work`` (NOTE [prices from counts] in profile/prices.py); 0 when no price came
    # from counts
    replay_calibration: float = json_field(default=0.0, omit=0.0)
    # bytes the whole-step instrument saw at the peak beyond the tensors the rows count (kernel
    # workspaces, a checkpoint's RNG state), already added to every row's base (NOTE [untracked bytes]
    # in profile/step.py); 0 when the rows' instrument measured the baseline too
    untracked_bytes: int = 0
    # modules no sampled step ran, costed as an identical module that ran (name -> the twin; NOTE
    # [unsampled blocks] in profile/twins.py): their figures are the twin's, not measured on them
    costed_as_twin: dict[str, str] = dataclasses.field(default_factory=dict)


# -- the step sample: which steps a profile and a plan's measurements cover (NOTE [step sample] in
# profile/sample.py, which runs them and merges their profiles); here, so the plan stage reads it without torch

DEFAULT_SAMPLE_STEPS = 3        # NOTE [step sample] in profile/sample.py
MAX_SAMPLE_STEPS = 64
POINT_STRIDE = 1000             # point k runs batch(POINT_STRIDE * k + i)
SEED_STRIDE = 1_000_003         # point k >= 1 seeds SEED_STRIDE * k + i before step i
NOT_CALLED = "not called during the step"   # profile_step's reason for a module no sampled step ran

ShapeValue = int | float | str | bool
ShapePairs = tuple[tuple[str, ShapeValue], ...]   # shape overrides, sorted by key: hashable, one order


def shape_to_json(shape: ShapePairs) -> dict[str, ShapeValue]:
    """Shape overrides as the JSON object of their keywords."""
    return dict(shape)


def shape_from_json(d: dict[str, ShapeValue]) -> ShapePairs:
    return tuple(sorted(d.items()))


def shapes_to_json(shapes: tuple[ShapePairs, ...]) -> list[dict[str, ShapeValue]]:
    return [shape_to_json(s) for s in shapes]


def shapes_from_json(ds: list[dict[str, ShapeValue]]) -> tuple[ShapePairs, ...]:
    return tuple(shape_from_json(d) for d in ds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplePoint(JsonCodec):
    """One sampled step stream: shape overrides, batch index offset, seed (None: unseeded)."""

    shape: ShapePairs = json_field(default=(), encode=shape_to_json, decode=shape_from_json)
    offset: int = 0
    seed: int | None = None

    @property
    def is_plain(self) -> bool:
        """The single step remat always ran (no offset, no seed) at the workload's own shape."""
        return not self.shape and self.offset == 0 and self.seed is None

    def label(self) -> str:
        shape = ",".join(f"{k}={v}" for k, v in self.shape)
        return (f"{shape} " if shape else "") + f"batch({self.offset}+i)" + (f" seed {self.seed}" if self.seed is not None else "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSample(JsonCodec):
    """Which steps to profile and measure over (NOTE [step sample] in profile/sample.py).

    ``steps``: steps per shape (1: the single seeded step of before). ``boundary_shapes``: shape
    overrides the workload is built at a second (third, ...) time; its steps join the sample."""

    steps: int = DEFAULT_SAMPLE_STEPS
    boundary_shapes: tuple[ShapePairs, ...] = json_field(default=(), encode=shapes_to_json, decode=shapes_from_json)

    def __post_init__(self) -> None:
        if type(self.steps) is not int or not 1 <= self.steps <= MAX_SAMPLE_STEPS:
            raise WorkloadError(f"the step sample needs 1 to {MAX_SAMPLE_STEPS} steps, got {self.steps!r}",
                            tip="--sample-steps 1 profiles one step, as before; 3 is the default (NOTE [step sample])")
        for shape in self.boundary_shapes:
            if not shape:
                raise ShapeError("a boundary shape needs at least one KEY=VAL", tip="e.g. --boundary-shape seq_len=128")

    @classmethod
    def of(cls, steps: int = DEFAULT_SAMPLE_STEPS, boundary_shapes: list[dict[str, ShapeValue]] | None = None) -> "StepSample":
        return cls(steps=steps, boundary_shapes=shapes_from_json(boundary_shapes or []))

    @property
    def is_single(self) -> bool:
        return self.steps == 1 and not self.boundary_shapes

    def points(self) -> list[SamplePoint]:
        """Every point, the workload's own shape first, then each boundary shape in order."""
        return [SamplePoint(shape=shape, offset=POINT_STRIDE * k, seed=None if k == 0 else k)
                for shape in ((), *self.boundary_shapes) for k in range(self.steps)]


# SampleRecord's JSON: the steps a plan was made and measured on (NOTE [step sample]); its points
# and spread are computed, so its schema is written here
SAMPLE = Obj({
    "steps": Int(1, MAX_SAMPLE_STEPS), "boundary_shapes": List(SHAPE, max_len=16),
    "points": List(Obj({"shape": SHAPE, "offset": Int(0, 2 ** 40), "seed": Opt(Int(0, 2 ** 40))}),
                   max_len=MAX_SAMPLE_STEPS * 17),
    "point_peaks": List(BYTES, max_len=MAX_SAMPLE_STEPS * 17),
    "peak_spread": Opt(Obj({"min": BYTES, "median": BYTES, "max": BYTES})),
})


@dataclasses.dataclass(kw_only=True)
class SampleRecord(JsonCodec):
    """The sample a plan was made and measured on, and its measured peak at each point (bytes). Its JSON is
    the sample's keys, its points (computed, never read back), the peaks and their spread (computed)."""

    sample: StepSample = json_field(inline=True, then=("points",))
    # measured, in ``sample.points()`` order (bytes)
    point_peaks: list[int] = json_field(default_factory=list, then=(("peak_spread", "spread"),))

    @property
    def points(self) -> list[SamplePoint]:
        return self.sample.points()

    @property
    def spread(self) -> dict[str, int] | None:
        """min / median / max of the measured peaks (bytes), or None before any was measured."""
        if not self.point_peaks:
            return None
        return {"min": min(self.point_peaks), "median": int(p50(self.point_peaks)),
                "max": max(self.point_peaks)}


def describe_refusal(r: Refusal) -> str:
    """A refused allocation in words: where, how much, against what, and what held the live bytes."""
    where = f"in {r.phase.value}" if r.phase is not None else "outside a step"
    text = (f"{where}: an allocation of {fmt_bytes(r.requested_bytes)} with {fmt_bytes(r.live_bytes)} "
            f"live, against the capacity of {fmt_bytes(r.capacity_bytes)}")
    k = r.by_kind
    if k is not None:
        text += (f" (parameters {fmt_bytes(k.parameters)}, gradients {fmt_bytes(k.gradients)}, optimizer state "
                 f"{fmt_bytes(k.optimizer_state)}, saved activations {fmt_bytes(k.saved_activations)}, "
                 f"other {fmt_bytes(k.other)})")
    return text


# remat.types.Refusal's JSON (its codec is the generic one; remat.types sits below the schema language)
REFUSAL = Obj({
    "capacity_bytes": BYTES, "requested_bytes": BYTES, "live_bytes": BYTES,
    "phase": Opt(Enum(*(p.value for p in Phase))),
    "by_kind": Opt(Obj({k: BYTES for k in ("parameters", "gradients", "optimizer_state", "saved_activations", "other")})),
})
BATCH = Int(1, 2 ** 40)


@dataclasses.dataclass(frozen=True)
class BlockedStep(JsonCodec):
    """The evidence of a blocked step and how remat planned it (NOTE [blocked step])."""

    # the unplanned step's refused allocation (None: CUDA, which does not say)
    refusal: Annotated[Refusal | None, Opt(REFUSAL)]
    target_batch: Annotated[int, Int(2, 2 ** 40)]   # B: the example batch's leading dimension
    # (k1, k2): the smaller batches profiled unplanned
    profiled_batches: Annotated[tuple[Annotated[int, BATCH], ...], Len(2, min_len=1)]
    verified_batch: Annotated[int, BATCH]   # k2: the largest batch at which the unplanned control fits
    rule: Annotated[str, Enum("affine", "proportional")]   # NOTE [blocked step]

    def describe(self) -> str:
        evidence = describe_refusal(self.refusal) if self.refusal is not None else "out of memory"
        return (f"the unplanned step at batch {self.target_batch} does not fit ({evidence}); profiled at batches "
                f"{', '.join(map(str, self.profiled_batches))} and extrapolated ({self.rule}); the control fits at "
                f"batch {self.verified_batch}")
