"""The receipt: every figure behind one checkpointing decision, as versioned plain JSON.

A :class:`Receipt` embeds the stage reports as their own JSON forms (``StepTrace``,
``Plan``, ``VerifyReport``, ``FrontierReport``) and adds what only the receipt knows: the
context it was made in, per-boundary records (revision hash, measured saving, replay
cost, the fixture that covers it), the decision and the modes it does not cover.
``Receipt.from_json`` validates against :data:`~remat.receipt.schema.RECEIPT_SCHEMA`
first (NOTE [hostile JSON] in remat/_json.py); every failure is a :class:`ReceiptError`.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import math
import subprocess
from pathlib import Path
from typing import Any

from .. import __version__
from .._json import read_bounded_bytes
from ..closed_loop import Attempt
from ..errors import ReceiptError, RematError
from ..frontier.model import FrontierReport, OverheadInterval
from ..plan.model import Plan
from ..profile.model import DEFAULT_SAMPLE_STEPS, BlockedStep
from ..trace.model import HostContext, StepTrace
from ..types import CheckpointMode, MemorySource
from ..verify.model import RunMode, Tolerance, VerifyReport
from ..workload.loader import LoadedWorkload, factory_defaults
from .world_size import WorldSizeEvidence
from .schema import RECEIPT_KIND, RECEIPT_SCHEMA_VERSION, check_version, parse_json_bounded, read_json_file, validate

ShapeDict = dict[str, Any]


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
class ReceiptContext:
    """Where, on what, and from which code revision the receipt was made."""

    workload: str                     # the spec as given: built-in name, file.py:fn or module:fn
    shape: ShapeDict                  # the shape keywords given (what `remat check` passes again)
    resolved_shape: ShapeDict         # with the factory's defaults filled in
    boundary_shape: ShapeDict | None  # the second traced shape, if any
    dtype: str
    device: str
    torch_version: str
    python_version: str
    platform: str
    hostname: str
    cpu_count: int | None
    threads: int                      # torch intra-op threads
    remat_version: str
    git_revision: str | None          # HEAD of the repository in the working directory, if any
    git_dirty: bool | None            # tracked files differ from HEAD
    created: str                      # ISO 8601, UTC
    command: str                      # the command line that made it ("" from the library)
    memory_source: MemorySource       # cpu-live-tensors or cuda-allocator
    autocast: str | None = None       # the forward ran under torch.autocast of this dtype (NOTE [autocast steps])
    device_memory_bytes: int | None = None   # the device's stated capacity, enforced on the CPU (NOTE [blocked receipt])

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

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["memory_source"] = self.memory_source.value
        if self.autocast is None:
            del d["autocast"]   # receipts made without autocast read as they always did
        if self.device_memory_bytes is None:
            del d["device_memory_bytes"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReceiptContext":
        return cls(**{**d, "memory_source": _enum(MemorySource, d["memory_source"], "context.memory_source")})


@dataclasses.dataclass(kw_only=True)
class RunSettings:
    """How much was run. ``remat demo`` runs less than the defaults and says so in ``note``."""

    trace_warmup: int = 2
    trace_steps: int = 3
    verify_steps: int = 3
    verify_seeds: int = 3
    verify_timing_steps: int = 10
    frontier_plans: list[str] = dataclasses.field(default_factory=lambda: [
        "none", "all", "uniform:2", "sqrt", "selective", "checkpoint_sequential", "first-k", "optimal", "optimal@70%",
        "optimal@50%"])
    frontier_steps: int = 10
    frontier_warmup: int = 2
    capacity_key: str | None = "batch_size"
    capacity_tries: int = 6
    capacity_steps: int = 3
    saving_tolerance: float = 0.10    # a boundary's re-measured saving may fall this much (relative)
    saving_warmup: int = 1
    sample_steps: int = DEFAULT_SAMPLE_STEPS   # steps profiled and measured per shape (NOTE [step sample])
    note: str = ""
    compile: dict[str, Any] | None = None   # CompileSpec JSON: made with --compile (NOTE [compiled receipts])

    def __post_init__(self) -> None:
        for name in ("trace_warmup", "trace_steps", "verify_steps", "verify_seeds", "frontier_steps",
                     "frontier_warmup", "capacity_tries", "capacity_steps", "saving_warmup", "sample_steps"):
            if getattr(self, name) < 1:
                raise RematError(f"receipt setting {name} must be at least 1, got {getattr(self, name)}")
        if self.verify_timing_steps < 0:
            raise RematError(f"verify_timing_steps must be >= 0, got {self.verify_timing_steps}")
        if not 0.0 <= self.saving_tolerance <= 1.0:
            raise RematError(f"saving_tolerance must lie in [0, 1], got {self.saving_tolerance}")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.compile is None:
            del d["compile"]   # eager receipts read as they always did
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunSettings":
        return cls(**{**d, "frontier_plans": list(d["frontier_plans"])})


# -- per boundary ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Fixture:
    """The equivalence fixture that covers a boundary: verify's paired control/planned runs.

    ``remat check`` re-runs exactly this (same seeds, steps, tolerance)."""

    name: str                       # "paired-step": remat.verify.verify_plan
    seeds: tuple[int, ...]
    steps: int                      # training steps per seed (plus one eval step when "eval" in modes)
    modes: tuple[RunMode, ...]      # (TRAIN, EVAL)
    dtype: str
    tolerance: Tolerance            # max |planned - control| <= atol + rtol * max |control|, per tensor
    parameters: tuple[str, ...]     # the boundary's parameters whose gradients the fixture compares
    passed: bool | None             # None: not run (nothing shipped with boundaries)
    forward_calls_per_step: int | None
    replay_calls_per_step: int | None
    draws_rng: bool | None
    negative_controls: tuple[str, ...]  # the deliberately wrong runs the fixture rejected

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "seeds": list(self.seeds), "steps": self.steps, "modes": [m.value for m in self.modes],
                "dtype": self.dtype, "tolerance": self.tolerance.to_json(), "parameters": list(self.parameters),
                "passed": self.passed, "forward_calls_per_step": self.forward_calls_per_step,
                "replay_calls_per_step": self.replay_calls_per_step, "draws_rng": self.draws_rng,
                "negative_controls": list(self.negative_controls)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Fixture":
        return cls(name=d["name"], seeds=tuple(d["seeds"]), steps=d["steps"], modes=tuple(RunMode(m) for m in d["modes"]),
                   dtype=d["dtype"],
                   tolerance=Tolerance(**d["tolerance"]), parameters=tuple(d["parameters"]), passed=d["passed"],
                   forward_calls_per_step=d["forward_calls_per_step"], replay_calls_per_step=d["replay_calls_per_step"],
                   draws_rng=d["draws_rng"], negative_controls=tuple(d["negative_controls"]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundaryRecord:
    """Why one wrapper exists, and which check catches it going stale (seed 000)."""

    module: str                     # module path, e.g. "h.2"
    class_name: str
    mode: CheckpointMode            # any mode but KEEP (FULL, SELECTIVE, ...)
    guarded: bool
    revision: str                   # remat.profile.module_revision: class sources + parameter shapes
    predicted_saving_bytes: int     # the planner's figure (profile of the unmodified step)
    measured_saving_bytes: int      # NOTE [measured saving] in remat/workflow/build.py
    saving_tolerance: float         # check fails when the saving falls by more than this share
    replay_ms: float                # measured warm forward time of the module: the added backward time
    fixture: Fixture

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mode"] = self.mode.value
        d["fixture"] = self.fixture.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "BoundaryRecord":
        return cls(**{**d, "mode": _enum(CheckpointMode, d["mode"], "a boundary's mode"),
                      "fixture": Fixture.from_json(d["fixture"])})


# -- plan, decision, unsupported -------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class ReceiptTraces:
    target: StepTrace                 # the unmodified step (the control) at the target shape; blocked: where it
                                      # fits, the verified batch (its context says; NOTE [blocked receipt])
    boundary: StepTrace | None        # the unmodified step at the boundary shape
    planned: StepTrace | None         # the shipped plan's step at the target shape

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target.to_json(), "boundary": None if self.boundary is None else self.boundary.to_json(),
                "planned": None if self.planned is None else self.planned.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReceiptTraces":
        return cls(target=StepTrace.from_json(d["target"]),
                   boundary=None if d["boundary"] is None else StepTrace.from_json(d["boundary"]),
                   planned=None if d["planned"] is None else StepTrace.from_json(d["planned"]))


@dataclasses.dataclass(kw_only=True)
class ReceiptPlan:
    label: str | None                 # frontier label of the plan ("optimal", "none"); None: nothing to show
    plan: Plan | None
    boundaries: list[BoundaryRecord]
    control_held_bytes: int | None    # live bytes at the start of backward, unmodified step
    closed_loop: list[Attempt]        # the optimal planner's apply-measure-replan tries
    closed_loop_boundaries: list[str]  # what that closed loop planned ("h.1:full")
    note: str = ""
    # candidates excluded after verification found them hazardous, module -> why (NOTE [re-plan after verify])
    excluded_after_verify: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "plan": None if self.plan is None else self.plan.to_json(),
                "boundaries": [b.to_json() for b in self.boundaries], "control_held_bytes": self.control_held_bytes,
                "closed_loop": [a.to_json() for a in self.closed_loop],
                "closed_loop_boundaries": list(self.closed_loop_boundaries), "note": self.note,
                **({"excluded_after_verify": dict(self.excluded_after_verify)} if self.excluded_after_verify else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReceiptPlan":
        return cls(label=d["label"], plan=None if d["plan"] is None else Plan.from_json(d["plan"]),
                   boundaries=[BoundaryRecord.from_json(b) for b in d["boundaries"]],
                   control_held_bytes=d["control_held_bytes"], closed_loop=[Attempt.from_json(a) for a in d["closed_loop"]],
                   closed_loop_boundaries=list(d["closed_loop_boundaries"]), note=d["note"],
                   excluded_after_verify=dict(d.get("excluded_after_verify", {})))


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


def _enum(kind: type[enum.Enum], value: Any, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ReceiptError(f"receipt: {what} is {value!r}, not one of {', '.join(str(k.value) for k in kind)}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RejectedPlan:
    plan: str
    decision: Rejection
    reason: str
    peak_bytes: int | None = None
    p50_ms: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "decision", Rejection(self.decision))

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.plan, "decision": self.decision.value, "reason": self.reason,
                "peak_bytes": self.peak_bytes, "p50_ms": self.p50_ms}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RejectedPlan":
        return cls(plan=d["plan"], decision=_enum(Rejection, d["decision"], "a rejected plan's decision"),
                   reason=d["reason"], peak_bytes=d["peak_bytes"], p50_ms=d["p50_ms"])


@dataclasses.dataclass(kw_only=True)
class ReceiptDecision:
    """What ships and why (NOTE [receipt decision] in remat/workflow/build.py)."""

    status: ShipStatus
    shipped: str | None               # frontier label of the shipped plan
    boundaries: list[str]             # "h.1:full"
    budget_bytes: int
    reserve: float                    # the required reserve: share of the budget kept free
    effective_budget_bytes: int       # budget x (1 - reserve): what the peak must stay under
    control_peak_bytes: int | None
    shipped_peak_bytes: int | None
    clears: bool                      # shipped peak <= effective budget
    headroom_bytes: int | None        # effective budget - shipped peak
    reserve_left: float | None        # 1 - shipped peak / budget
    control_p50_ms: float | None
    shipped_p50_ms: float | None
    overhead_pct: float | None
    verified: bool | None             # None: nothing to verify (no boundaries)
    rejected: list[RejectedPlan]
    why: list[str]                    # the decision in a few sentences, first line first
    # the shipped plan's overhead with its interval (NOTE [overhead intervals] in frontier/model.py);
    # `remat check` re-measures the overhead itself and only checks this against the receipt's own samples
    overhead_interval: OverheadInterval | None = None

    def __post_init__(self) -> None:
        self.status = ShipStatus(self.status)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        d["rejected"] = [r.to_json() for r in self.rejected]
        if self.overhead_interval is None:
            d.pop("overhead_interval")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReceiptDecision":
        oi = d.get("overhead_interval")
        return cls(**{**d, "status": _enum(ShipStatus, d["status"], "decision.status"),
                      "overhead_interval": None if oi is None else OverheadInterval.from_json(oi),
                      "rejected": [RejectedPlan.from_json(r) for r in d["rejected"]],
                      "boundaries": list(d["boundaries"]), "why": list(d["why"])})


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnsupportedMode:
    """An execution mode the receipt's evidence does not cover."""

    mode: str                         # "torch.compile", "reentrant checkpointing", "bfloat16", ...
    status: Coverage
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Coverage(self.status))

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "status": self.status.value, "detail": self.detail}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "UnsupportedMode":
        return cls(mode=d["mode"], status=_enum(Coverage, d["status"], "an unsupported mode's status"),
                   detail=d["detail"])


# -- the receipt -----------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class Receipt:
    context: ReceiptContext
    settings: RunSettings
    traces: ReceiptTraces
    plan: ReceiptPlan
    verification: VerifyReport | None
    verification_note: str            # why verification was not run, or ""
    frontier: FrontierReport | None
    decision: ReceiptDecision
    unsupported: list[UnsupportedMode]
    world_size: WorldSizeEvidence | None = None   # NOTE [receipt at a world size] (receipt/world_size.py)
    schema_version: int = RECEIPT_SCHEMA_VERSION

    @property
    def blocked(self) -> BlockedStep | None:
        """The unplanned step's evidence when it did not fit the device at the target (NOTE [blocked receipt])."""
        return None if self.plan.plan is None else self.plan.plan.blocked

    @property
    def shipped(self) -> bool:
        return self.decision.status is ShipStatus.SHIP

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "kind": RECEIPT_KIND,
            "context": self.context.to_json(),
            "settings": self.settings.to_json(),
            "traces": self.traces.to_json(),
            "plan": self.plan.to_json(),
            "verification": None if self.verification is None else self.verification.to_json(),
            "verification_note": self.verification_note,
            "frontier": None if self.frontier is None else self.frontier.to_json(),
            "decision": self.decision.to_json(),
            "unsupported": [u.to_json() for u in self.unsupported],
            **({} if self.world_size is None else {"world_size": self.world_size.to_json()}),
        }

    @classmethod
    def from_json(cls, data: Any) -> "Receipt":
        """Validate (version, then schema, then cross-references) and build; :class:`ReceiptError` if anything is off."""
        version = check_version(data)
        validate(data)
        try:
            receipt = cls(
                schema_version=version,
                context=ReceiptContext.from_json(data["context"]),
                settings=RunSettings.from_json(data["settings"]),
                traces=ReceiptTraces.from_json(data["traces"]),
                plan=ReceiptPlan.from_json(data["plan"]),
                verification=None if data["verification"] is None else VerifyReport.from_json(data["verification"]),
                verification_note=data["verification_note"],
                frontier=None if data["frontier"] is None else FrontierReport.from_json(data["frontier"]),
                decision=ReceiptDecision.from_json(data["decision"]),
                unsupported=[UnsupportedMode.from_json(u) for u in data["unsupported"]],
                world_size=None if data.get("world_size") is None else WorldSizeEvidence.from_json(data["world_size"]),
            )
        except ReceiptError:
            raise
        except (RematError, KeyError, TypeError, ValueError) as exc:
            msg = exc.message if isinstance(exc, RematError) else f"{type(exc).__name__}: {exc}"
            raise ReceiptError(f"malformed receipt: {msg}") from exc
        receipt._check_references()
        return receipt

    def _check_references(self) -> None:
        """The parts must agree with each other (a hand-edited receipt could mix them)."""
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
        if ws is not None and (ws.report.spec != self.context.workload or ws.report.plan_boundaries != planned):
            raise ReceiptError("malformed receipt: the run at world size "
                               f"{ws.world_size} names another workload or other boundaries than the receipt")

    @classmethod
    def loads(cls, text: str | bytes) -> "Receipt":
        return cls.from_json(parse_json_bounded(text))

    @classmethod
    def load(cls, path: Path | str) -> "Receipt":
        return cls.from_json(read_json_file(path))


def load_receipt(path: Path | str) -> Receipt:
    """Read and validate ``receipt.json`` (NOTE [hostile JSON]); :class:`ReceiptError` if it is not one."""
    return Receipt.load(path)


def load_receipt_with_digest(path: Path | str) -> tuple[Receipt, str]:
    """(the validated receipt, the sha256 of the bytes it was read from): one read, so they agree."""
    data = read_bounded_bytes(path, error=ReceiptError, what="receipt file",
                              tip="remat receipt ... --out DIR writes DIR/receipt.json")
    return Receipt.from_json(parse_json_bounded(data, source=str(path))), hashlib.sha256(data).hexdigest()
