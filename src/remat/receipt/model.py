"""The receipt: every figure behind one checkpointing decision, as versioned plain JSON.

A :class:`Receipt` embeds the stage reports as their own JSON forms (``StepTrace``,
``Plan``, ``VerifyReport``, ``FrontierReport``) and adds what only the receipt knows: the
context it was made in, per-boundary records (revision hash, measured saving, replay
cost, the fixture that covers it), the decision and the modes it does not cover.
Each type's JSON and schema follow from its annotated fields (NOTE [codecs from the types] in
remat/_codec.py); ``Receipt.from_json`` validates against :data:`RECEIPT_SCHEMA`, derived from
:class:`Receipt`, first (NOTE [hostile JSON] in remat/_json.py); every failure is a :class:`ReceiptError`.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import math
import subprocess
from pathlib import Path
from typing import Annotated, Any

from .. import __version__
from .._codec import AS_WRITTEN, JsonCodec, Len, Reading, Short, SignedBytes, Text, json_field, schema
from .._json import (AUTOCAST, BYTES, DEVICE, DTYPE, MEMORY_SOURCE, MODE, MODULE_PATH, MS, SHAPE, Enum, Int, List,
                     Map, Num, Str, json_kind, read_bounded_bytes, show)
from ..closed_loop import Attempt
from ..distributed.report import remake_pipeline_command
from ..errors import ReceiptError, RematError, StaleReceiptFormat
from ..frontier.model import FrontierReport, OverheadInterval
from ..plan.model import Plan
from ..plan.schema import COMPILE
from ..profile.model import DEFAULT_SAMPLE_STEPS, BlockedStep
from ..trace.model import HostContext, StepTrace
from ..types import CheckpointMode, MemorySource
from ..verify.model import RunMode, Tolerance, VerifyReport
from ..workload.loader import LoadedWorkload, factory_defaults
from .world_size import PipelineEvidence, WorldSizeEvidence
from .schema import (ATTEMPT, COUNT, FRACTION, FRONTIER, HEX16, MAX_SEEDS, MAX_STEPS, MAX_TRIES, MAX_WARMUP,
                     OVERHEAD_INTERVAL, PLAN, RECEIPT_KIND, RECEIPT_SCHEMA_VERSION, STEP_TRACE, TOLERANCE, VERIFICATION,
                     parse_json_bounded, read_json_file)

ShapeDict = dict[str, Any]

# The receipt's floats are read as the file holds them (an int stays an int), as they always were:
# a file read and written again keeps its bytes (NOTE [codecs from the types] in remat/_codec.py).
Fraction = Annotated[float, FRACTION, AS_WRITTEN]   # a share in [0, 1]
MsAsWritten = Annotated[float, MS, AS_WRITTEN]       # ms
Share = Annotated[float, Num(0, 0.999999), AS_WRITTEN]   # a reserve: share of the budget kept free
Figure = Annotated[float, Num(), AS_WRITTEN]         # a signed figure (%, or a share) in +-1e15


# -- context ---------------------------------------------------------------------------------------

def git_revision(cwd: Path | str | None = None) -> tuple[str | None, bool | None]:
    """(``git rev-parse HEAD``, whether tracked files differ from it) in ``cwd``; (None, None)
    outside a repository, without git, or on any error: never raises."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        rev = head.stdout.strip()
        if not rev or any(c not in "0123456789abcdef" for c in rev):
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=10)
        dirty = None if status.returncode != 0 else bool(status.stdout.strip())
        return rev, dirty
    except (OSError, subprocess.SubprocessError, ValueError):
        return None, None


def resolved_shape(spec: str, shape: ShapeDict) -> ShapeDict:
    """Every shape keyword the factory takes, with its default where ``shape`` leaves it out
    (JSON scalars only; device and dtype are recorded separately). ``remat check`` compares
    it, so a changed default (``batch_size=8`` -> ``16`` in the user's factory) is caught."""
    out: ShapeDict = {k: v for k, v in factory_defaults(spec).items()
                      if isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and not math.isfinite(v))}
    out.update(shape)
    return out


@dataclasses.dataclass(kw_only=True)
class ReceiptContext(JsonCodec):
    """Where, on what, and from which code revision the receipt was made."""

    workload: Annotated[str, Str(max_len=4096)]   # the spec as given: built-in name, file.py:fn or module:fn
    shape: Annotated[ShapeDict, SHAPE]            # the shape keywords given (what `remat check` passes again)
    resolved_shape: Annotated[ShapeDict, SHAPE]   # with the factory's defaults filled in
    boundary_shape: Annotated[ShapeDict, SHAPE] | None   # the second traced shape, if any
    dtype: Annotated[str, DTYPE]
    device: Annotated[str, DEVICE]
    torch_version: Short
    python_version: Short
    platform: Short
    hostname: Short
    cpu_count: Annotated[int, Int(0, 1 << 20)] | None
    threads: Annotated[int, Int(0, 4096)]         # torch intra-op threads
    remat_version: Short
    git_revision: Annotated[str, Str(r"[0-9a-f]{7,64}")] | None   # HEAD of the repository in the working directory
    git_dirty: bool | None            # tracked files differ from HEAD
    created: Short                    # ISO 8601, UTC
    command: Text                     # the command line that made it ("" from the library)
    memory_source: Annotated[MemorySource, MEMORY_SOURCE]   # cpu-live-tensors or cuda-allocator
    # the two below are left out when None: receipts made without them read as they always did
    # the forward ran under torch.autocast of this dtype (NOTE [autocast steps])
    autocast: Annotated[str, AUTOCAST] | None = json_field(default=None, omit=None)
    # the device's stated capacity, enforced on the CPU (NOTE [blocked receipt])
    device_memory_bytes: Annotated[int, Int(1, 2 ** 53)] | None = json_field(default=None, omit=None)

    @classmethod
    def capture(cls, loaded: LoadedWorkload, *, boundary_shape: ShapeDict | None, memory_source: MemorySource,
                command: str = "", device_memory_bytes: int | None = None) -> "ReceiptContext":
        rev, dirty = git_revision()
        host = dataclasses.asdict(HostContext.capture())   # the same fields, captured in one place
        return cls(workload=loaded.spec, shape=dict(loaded.shape), resolved_shape=resolved_shape(loaded.spec, loaded.shape),
                   boundary_shape=dict(boundary_shape) if boundary_shape else None, dtype=loaded.dtype,
                   device=loaded.device, **host, remat_version=__version__, git_revision=rev, git_dirty=dirty,
                   created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command=command, memory_source=memory_source, autocast=loaded.autocast,
                   device_memory_bytes=device_memory_bytes)


Warmup = Annotated[int, Int(1, MAX_WARMUP)]
Steps = Annotated[int, Int(1, MAX_STEPS)]


def _default_plans() -> list[str]:
    return ["none", "all", "uniform:2", "sqrt", "selective", "checkpoint_sequential", "first-k", "optimal",
            "optimal@70%", "optimal@50%"]


@dataclasses.dataclass(kw_only=True)
class RunSettings(JsonCodec):
    """How much was run. ``remat demo`` runs less than the defaults and says so in ``note``. Every key
    but ``compile`` is in every file (required by the schema though the field has a default: a count
    a receipt does not state is not read as one)."""

    trace_warmup: Warmup = json_field(default=2, required=True)
    trace_steps: Steps = json_field(default=3, required=True)
    verify_steps: Steps = json_field(default=3, required=True)
    verify_seeds: Annotated[int, Int(1, MAX_SEEDS)] = json_field(default=3, required=True)
    verify_timing_steps: Annotated[int, Int(0, MAX_STEPS)] = json_field(default=10, required=True)
    frontier_plans: Annotated[list[Short], Len(100)] = json_field(default_factory=_default_plans, required=True)
    frontier_steps: Steps = json_field(default=10, required=True)
    frontier_warmup: Warmup = json_field(default=2, required=True)
    capacity_key: Short | None = json_field(default="batch_size", required=True)
    capacity_tries: Annotated[int, Int(1, MAX_TRIES)] = json_field(default=6, required=True)
    capacity_steps: Steps = json_field(default=3, required=True)
    # a boundary's re-measured saving may fall this much (relative)
    saving_tolerance: Fraction = json_field(default=0.10, required=True)
    saving_warmup: Warmup = json_field(default=1, required=True)
    # steps profiled and measured per shape (NOTE [step sample])
    sample_steps: Annotated[int, Int(1, 64)] = json_field(default=DEFAULT_SAMPLE_STEPS, required=True)
    note: Text = json_field(default="", required=True)
    # CompileSpec JSON: made with --compile (NOTE [compiled receipts]); left out when None, so eager
    # receipts read as they always did
    compile: Annotated[dict[str, Any], COMPILE] | None = json_field(default=None, omit=None)

    def __post_init__(self) -> None:
        for name in ("trace_warmup", "trace_steps", "verify_steps", "verify_seeds", "frontier_steps",
                     "frontier_warmup", "capacity_tries", "capacity_steps", "saving_warmup", "sample_steps"):
            if getattr(self, name) < 1:
                raise RematError(f"receipt setting {name} must be at least 1, got {getattr(self, name)}")
        if self.verify_timing_steps < 0:
            raise RematError(f"verify_timing_steps must be >= 0, got {self.verify_timing_steps}")
        if not 0.0 <= self.saving_tolerance <= 1.0:
            raise RematError(f"saving_tolerance must lie in [0, 1], got {self.saving_tolerance}")


# -- per boundary ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Fixture(JsonCodec):
    """The equivalence fixture that covers a boundary: verify's paired control/planned runs.

    ``remat check`` re-runs exactly this (same seeds, steps, tolerance)."""

    name: Short                     # "paired-step": remat.verify.verify_plan
    seeds: Annotated[tuple[Annotated[int, Int(0, 10_000)], ...], Len(MAX_SEEDS, min_len=1)]
    steps: Steps                    # training steps per seed (plus one eval step when "eval" in modes)
    modes: Annotated[tuple[RunMode, ...], Len(2)]   # (TRAIN, EVAL)
    dtype: Annotated[str, DTYPE]
    # max |planned - control| <= atol + rtol * max |control|, per tensor
    tolerance: Annotated[Tolerance, TOLERANCE]
    # the boundary's parameters whose gradients the fixture compares
    parameters: Annotated[tuple[Annotated[str, Str(max_len=500)], ...], Len(10_000)]
    passed: bool | None             # None: not run (nothing shipped with boundaries)
    forward_calls_per_step: Annotated[int, COUNT] | None
    replay_calls_per_step: Annotated[int, COUNT] | None
    draws_rng: bool | None
    negative_controls: Annotated[tuple[Short, ...], Len(20)]   # the deliberately wrong runs the fixture rejected


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryRecord(JsonCodec):
    """Why one wrapper exists, and which check catches it going stale (seed 000)."""

    module: Annotated[str, MODULE_PATH]   # module path, e.g. "h.2"
    class_name: Short
    mode: Annotated[CheckpointMode, MODE]   # any mode but KEEP (FULL, SELECTIVE, ...)
    guarded: bool
    revision: Annotated[str, HEX16]       # remat.profile.module_revision: class sources + parameter shapes
    predicted_saving_bytes: SignedBytes   # the planner's figure (profile of the unmodified step)
    measured_saving_bytes: SignedBytes    # NOTE [measured saving] in remat/workflow/build.py
    saving_tolerance: Fraction            # check fails when the saving falls by more than this share
    replay_ms: MsAsWritten                # measured warm forward time of the module: the added backward time
    fixture: Fixture


# -- plan, decision, unsupported -------------------------------------------------------------------

# The stages' own reports, held to the receipt's schema of them (receipt/schema.py: a trace in a
# receipt is never nested, and so on).
Trace = Annotated[StepTrace, STEP_TRACE]


@dataclasses.dataclass(kw_only=True)
class ReceiptTraces(JsonCodec):
    target: Trace                     # the unmodified step (the control) at the target shape; blocked: where it
                                      # fits, the verified batch (its context says; NOTE [blocked receipt])
    boundary: Trace | None            # the unmodified step at the boundary shape
    planned: Trace | None             # the shipped plan's step at the target shape


@dataclasses.dataclass(kw_only=True)
class ReceiptPlan(JsonCodec):
    label: Short | None               # frontier label of the plan ("optimal", "none"); None: nothing to show
    plan: Annotated[Plan, PLAN] | None
    boundaries: Annotated[list[BoundaryRecord], Len(10_000)]
    control_held_bytes: Annotated[int, BYTES] | None   # live bytes at the start of backward, unmodified step
    # the optimal planner's apply-measure-replan tries
    closed_loop: Annotated[list[Annotated[Attempt, ATTEMPT]], Len(100)]
    closed_loop_boundaries: list[Short]   # what that closed loop planned ("h.1:full")
    note: Text = json_field(default="", required=True)
    # candidates excluded after verification found them hazardous, module -> why (NOTE [re-plan after
    # verify]); left out when empty
    excluded_after_verify: Annotated[dict[str, str], Map(Str(max_len=20_000), max_len=100)] = json_field(
        default_factory=dict, omit={})


class _Value(str, enum.Enum):
    """A decision word as the receipt's JSON spells it (``str()`` and f-strings give the word)."""

    def __str__(self) -> str:
        return self.value


class ShipStatus(_Value):
    SHIP = "ship"           # a plan (or the control) ships
    NO_PLAN = "no-plan"     # nothing measured clears the budget with its reserve, or the plan failed verification


class Rejection(_Value):
    """Why a measured plan did not ship: the frontier's decisions, or verification."""

    REJECT = "reject"           # fits, but another plan is cheaper; or misses the budget
    INFEASIBLE = "infeasible"   # no plan of that planner reaches its budget
    FAILED = "failed"           # measuring it failed
    UNVERIFIED = "unverified"   # fits, but failed verification


class Coverage(_Value):
    NOT_RUN = "not run"          # might work; not measured
    UNSUPPORTED = "unsupported"  # remat refuses it


@dataclasses.dataclass(frozen=True, kw_only=True)
class RejectedPlan(JsonCodec):
    plan: Short
    decision: Rejection
    reason: Text
    peak_bytes: Annotated[int, BYTES] | None = json_field(default=None, required=True)
    p50_ms: MsAsWritten | None = json_field(default=None, required=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decision", Rejection(self.decision))


@dataclasses.dataclass(kw_only=True)
class ReceiptDecision(JsonCodec):
    """What ships and why (NOTE [receipt decision] in remat/workflow/build.py)."""

    status: ShipStatus
    shipped: Short | None             # frontier label of the shipped plan
    boundaries: list[Short]           # "h.1:full"
    budget_bytes: Annotated[int, Int(1, 2 ** 53)]
    reserve: Share                    # the required reserve: share of the budget kept free
    effective_budget_bytes: SignedBytes   # budget x (1 - reserve): what the peak must stay under
    control_peak_bytes: Annotated[int, BYTES] | None
    shipped_peak_bytes: Annotated[int, BYTES] | None
    clears: bool                      # shipped peak <= effective budget
    headroom_bytes: SignedBytes | None   # effective budget - shipped peak
    reserve_left: Figure | None       # 1 - shipped peak / budget
    control_p50_ms: MsAsWritten | None
    shipped_p50_ms: MsAsWritten | None
    overhead_pct: Figure | None
    verified: bool | None             # None: nothing to verify (no boundaries)
    rejected: Annotated[list[RejectedPlan], Len(200)]
    why: Annotated[list[Text], Len(50)]   # the decision in a few sentences, first line first
    # the shipped plan's overhead with its interval (NOTE [overhead intervals] in frontier/model.py);
    # `remat check` re-measures the overhead itself and only checks this against the receipt's own
    # samples; left out when None
    overhead_interval: Annotated[OverheadInterval, OVERHEAD_INTERVAL] | None = json_field(default=None, omit=None)

    def __post_init__(self) -> None:
        self.status = ShipStatus(self.status)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnsupportedMode(JsonCodec):
    """An execution mode the receipt's evidence does not cover."""

    mode: Short                       # "torch.compile", "reentrant checkpointing", "bfloat16", ...
    status: Coverage
    detail: Text

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Coverage(self.status))


# -- the receipt -----------------------------------------------------------------------------------

# NOTE [one receipt]
# Every run remat vouches for writes one kind of receipt. A single-process receipt (``remat receipt``,
# ``remat demo``) holds the sections below from ``settings`` to ``unsupported``, and may hold a run at a
# world size (DDP or FSDP2). A pipeline run (``remat distributed --engine pipeline``) has no single-process
# trace, frontier or paired-seed verification: what it proves is per stage, so its receipt holds the
# context and the run at its world size alone (``world_size.engine`` is ``pipeline``; its per-stage rows,
# plans, bubble and boundary revisions are ``world_size.pipeline``: NOTE [receipt at a world size]). The
# single-process sections are then left out of the file (``omit_if``), and a file that mixes the two
# shapes is refused (``_check_shape``). One renderer (receipt/render.py) and one ``remat check`` path
# (``check_receipt`` in workflow/check.py, reached through ``check_any_receipt`` in workflow/check_child.py)
# read both. The old pipeline receipt kind
# (``remat-pipeline-receipt``, days old when it was merged into this one) is refused with the command
# that makes it again (:class:`~remat.errors.StaleReceiptFormat`).

OLD_PIPELINE_RECEIPT_KIND = "remat-pipeline-receipt"
# the single-process sections: all in a single-process receipt's file, none in a pipeline run's
SINGLE_PROCESS = ("settings", "traces", "plan", "verification", "verification_note", "frontier", "decision",
                  "unsupported")


def _pipeline_run(r: "Receipt") -> bool:
    return r.world_size is not None and r.world_size.pipeline is not None


def _single(**kw: Any) -> Any:
    """A single-process section: None in (and left out of) a pipeline run's receipt (NOTE [one receipt])."""
    return json_field(omit_if=_pipeline_run, **({"default": None} | kw))


def _refuse_other_kinds(data: dict[str, Any]) -> None:
    """The old pipeline receipt, refused with the command that makes it again (NOTE [one receipt]), and a file
    of another kind; before its version and schema are checked, so either is named as what it is."""
    if data.get("kind") == OLD_PIPELINE_RECEIPT_KIND or _old_pipeline_report(data) is not None:
        raise stale_pipeline_receipt(data)
    if data.get("kind", RECEIPT_KIND) != RECEIPT_KIND:
        raise ReceiptError(f"not a remat receipt: kind is {show(data.get('kind'))}, expected {RECEIPT_KIND!r}")


def _check_shape(data: dict[str, Any]) -> None:
    """A single-process receipt holds every single-process section, a pipeline run's none (NOTE [one receipt]);
    ``data`` has passed the schema."""
    ws = data.get("world_size")
    pipeline = isinstance(ws, dict) and ws.get("engine") == "pipeline"
    present = [k for k in SINGLE_PROCESS if k in data]
    if pipeline and present:
        raise ReceiptError(f"malformed receipt: a pipeline run's receipt holds no single-process section, but this "
                           f"one has {', '.join(present)}")
    missing = [k for k in SINGLE_PROCESS if k not in data]
    if not pipeline and missing:
        raise ReceiptError(f"malformed receipt: $: missing field(s) {', '.join(missing)}")


# NOTE [checked reading] in remat/_codec.py: the kind, the version (checked first, for a precise message), the
# schema, which sections come together, then the parts against each other; every failure a ReceiptError
_READING = Reading(error=ReceiptError, what="receipt", version=RECEIPT_SCHEMA_VERSION,
                   version_tip="re-create the receipt with this remat (`remat receipt ...`), or use the remat "
                               "version that wrote it",
                   refuse=_refuse_other_kinds, shape=_check_shape, wrap=(RematError, KeyError, TypeError, ValueError),
                   check=lambda receipt: receipt._check_references())


@dataclasses.dataclass(kw_only=True)
class Receipt(JsonCodec, reading=_READING):
    """NOTE [one receipt]."""

    # checked first, for a precise message (_READING); ``kind`` is written after it
    schema_version: Annotated[int, Int(0, 1000)] = json_field(default=RECEIPT_SCHEMA_VERSION, required=True,
                                                               then=("kind",))
    context: ReceiptContext
    # the single-process sections (each spec without null: a single-process file holds them all)
    settings: Annotated[RunSettings | None, schema(RunSettings)] = _single()
    traces: Annotated[ReceiptTraces | None, schema(ReceiptTraces)] = _single()
    plan: Annotated[ReceiptPlan | None, schema(ReceiptPlan)] = _single()
    verification: Annotated[VerifyReport, VERIFICATION] | None = _single()
    verification_note: Text = _single(default="")   # why verification was not run, or ""
    frontier: Annotated[FrontierReport, FRONTIER] | None = _single()
    decision: Annotated[ReceiptDecision | None, schema(ReceiptDecision)] = _single()
    unsupported: Annotated[list[UnsupportedMode] | None, List(schema(UnsupportedMode), max_len=100)] = _single()
    # NOTE [receipt at a world size] (receipt/world_size.py): a DDP/FSDP2 run beside the single-process
    # sections, or a pipeline run in place of them; left out when None
    world_size: WorldSizeEvidence | None = json_field(default=None, omit=None)

    @property
    def kind(self) -> Annotated[str, Enum(RECEIPT_KIND)]:
        """What the file is: the top level's ``kind`` key (never read back)."""
        return RECEIPT_KIND

    @property
    def pipeline(self) -> PipelineEvidence | None:
        """The pipeline run this receipt is (None for a single-process receipt: NOTE [one receipt])."""
        return None if self.world_size is None else self.world_size.pipeline

    @property
    def blocked(self) -> BlockedStep | None:
        """The unplanned step's evidence when it did not fit the device at the target (NOTE [blocked receipt])."""
        return None if self.plan is None or self.plan.plan is None else self.plan.plan.blocked

    @property
    def shipped(self) -> bool:
        return self.decision is not None and self.decision.status is ShipStatus.SHIP

    def _check_references(self) -> None:
        """The parts must agree with each other (a hand-edited receipt could mix them)."""
        if self.pipeline is not None:
            if self.context.workload != self.pipeline.report.spec:
                raise ReceiptError("malformed receipt: the context and the pipeline run name different workloads")
            return
        assert self.plan is not None and self.decision is not None and self.traces is not None   # _check_shape
        plan = self.plan.plan
        planned = [] if plan is None else [b.module for b in plan.boundaries]
        recorded = [b.module for b in self.plan.boundaries]
        if planned != recorded:
            raise ReceiptError(f"malformed receipt: the plan's boundaries {planned} differ from the boundary "
                               f"records {recorded}")
        if self.decision.status is ShipStatus.SHIP and plan is None:
            raise ReceiptError("malformed receipt: the decision ships a plan but the receipt holds none")
        if self.context.workload != self.traces.target.context.workload:
            raise ReceiptError("malformed receipt: the context and the target trace name different workloads")
        ws = self.world_size
        if ws is not None and ws.report is not None and (ws.report.spec != self.context.workload
                                                         or ws.report.plan_boundaries != planned):
            raise ReceiptError("malformed receipt: the run at world size "
                               f"{ws.world_size} names another workload or other boundaries than the receipt")

    @classmethod
    def loads(cls, text: str | bytes) -> "Receipt":
        return cls.from_json(parse_json_bounded(text))

    @classmethod
    def load(cls, path: Path | str) -> "Receipt":
        return cls.from_json(read_json_file(path))


def _old_pipeline_report(data: Any) -> dict[str, Any] | None:
    """A one receipt's pipeline report in the layout before NOTE [one per-rank report] (its own ``sides``), else
    None (the file is unchecked)."""
    ws = data.get("world_size") if isinstance(data, dict) else None
    pipe = ws.get("pipeline") if isinstance(ws, dict) else None
    rep = pipe.get("report") if isinstance(pipe, dict) else None
    return rep if isinstance(rep, dict) and "sides" in rep and "engine" not in rep else None


def _old_command(data: dict[str, Any]) -> str:
    """``remat distributed --engine pipeline ...`` with the old receipt's own settings where they are plain (the
    file is unchecked), else placeholders: the command that makes it again."""
    ctx = data.get("context") if isinstance(data.get("context"), dict) else {}
    rep = _old_pipeline_report(data) or data.get("pipeline")
    return remake_pipeline_command(rep, ctx.get("workload"), ctx.get("shape") if "shape" in ctx else "SHAPE")


def stale_pipeline_receipt(data: dict[str, Any]) -> StaleReceiptFormat:
    """The refusal of an old-format pipeline receipt (NOTE [one receipt]), naming the command that makes it again."""
    what = (f"kind {OLD_PIPELINE_RECEIPT_KIND!r}" if json_kind(data) == OLD_PIPELINE_RECEIPT_KIND else
            "its pipeline report in the layout before the one per-rank report")
    return StaleReceiptFormat(
        f"this is a pipeline receipt in the old format ({what}), which this remat no longer reads: a pipeline run "
        f"is now a {RECEIPT_KIND!r} whose run at a world size has engine pipeline, reported by one per-rank report",
        tip=f"make it again with this remat: `{_old_command(data)}`, then `remat check DIR/receipt.json`")


RECEIPT_SCHEMA = schema(Receipt)   # the receipt file's schema, from the fields (NOTE [codecs from the types])


def load_receipt(path: Path | str) -> Receipt:
    """Read and validate ``receipt.json`` (NOTE [hostile JSON]); :class:`ReceiptError` if it is not one."""
    return Receipt.load(path)


def load_receipt_with_digest(path: Path | str) -> tuple[Receipt, str]:
    """(the validated receipt, the sha256 of the bytes it was read from): one read, so they agree."""
    data = read_bounded_bytes(path, error=ReceiptError, what="receipt file",
                              tip="remat receipt ... --out DIR writes DIR/receipt.json")
    return Receipt.from_json(parse_json_bounded(data, source=str(path))), hashlib.sha256(data).hexdigest()
