"""The ``Plan``: which modules to checkpoint and how, with the figures that justify it.

A plan is plain JSON (``plan.json``) that round-trips exactly and is bound to a model by
its fingerprint. ``remat.apply`` consumes it; receipts embed it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

from .._codec import Bytes, JsonCodec, Len, Ms, Reading, Short, SignedBytes, SignedMs, Text, json_field
from .._json import AUTOCAST, DEVICE, DTYPE, MAX_MODULES, MODE, MODULE_PATH, SHAPE, Enum, Int, Num, Str, read_json_file
from ..errors import PlanError
from ..measure.compile_spec import CompileSpec
from ..profile.model import SAMPLE, BlockedStep, ModelFingerprint, SampleRecord
from ..types import CheckpointMode, MemorySource
from .budget import format_bytes
from .offload import OffloadPricing
from .spec import PlannerSpec, PlannerText
from .timing import TimeRace

PLAN_SCHEMA_VERSION = 1
MAX_PLAN_BYTES = 16 * 2 ** 20   # a plan for 10,000 modules is about 2 MiB


@dataclasses.dataclass(frozen=True, kw_only=True)
class Boundary(JsonCodec):
    module: Annotated[str, MODULE_PATH]   # module path, as in model.named_modules()
    mode: Annotated[CheckpointMode, MODE]   # FULL, an op-level mode, OFFLOAD or FULL_HOST_INPUT (KEEP is never listed)
    saved_bytes: SignedBytes     # predicted bytes freed until backward
    replay_ms: SignedMs          # predicted added backward time
    guarded: bool = False        # buffers restored around the replay (BatchNorm running stats)

    def __post_init__(self) -> None:
        if self.mode is CheckpointMode.KEEP:
            raise PlanError(f"boundary {self.module}: mode 'keep' is not a boundary; leave it out of the plan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exclusion(JsonCodec):
    module: Annotated[str, Str(max_len=500)]
    reason: Text


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmallCandidate(JsonCodec):
    """A candidate the search left out as saving too little (NOTE [small boundaries] in plan/planners.py)."""

    module: Annotated[str, MODULE_PATH]
    saved_bytes: SignedBytes          # the most it frees until backward in any plannable mode (bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmallBoundaries(JsonCodec):
    """Which candidates ``optimal``/``greedy`` searched without, and whether they had to be let back in
    (NOTE [small boundaries] in plan/planners.py)."""

    threshold_bytes: Bytes            # a candidate saving under this in every mode is small (bytes)
    dropped: Annotated[list[SmallCandidate], Len(MAX_MODULES)]   # forward order
    # True: no plan without them reached the target, so the search had every candidate and the plan
    # may hold some of them (it ships, like every plan, only measured to fit)
    admitted: bool = False

    def describe(self) -> str:
        """One line: how many, under what, and whether they were let back in."""
        names = ", ".join(c.module for c in self.dropped[:3]) + (f" (+{len(self.dropped) - 3} more)"
                                                                 if len(self.dropped) > 3 else "")
        head = f"{len(self.dropped)} candidate(s) saving under {format_bytes(self.threshold_bytes)} each: {names}"
        if self.admitted:
            return f"{head}; let back in: no plan without them reached the budget"
        return f"{head}; left out: the plan reaches the budget without them"


# NOTE [plan workload]
# ``remat plan`` records in plan.json the workload it profiled (spec, shape keywords, device,
# dtype, autocast), so ``remat verify --plan plan.json`` checks the plan on the step it was made
# for without being told again. A plan file is data like a receipt (NOTE [workload spec policy]
# in remat/workflow/check.py): its spec is used only when it is a built-in (gpt, cnn, mlp); for a
# file or module spec the user names it (``--workload``), and without either verify refuses
# rather than fall back to a default workload the plan was not made for. Every flag given on the
# command line wins over the recorded value.
@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanWorkload(JsonCodec):
    """The workload a plan was made for, as ``remat plan`` loaded it (NOTE [plan workload])."""

    spec: Annotated[str, Str(max_len=4096)]   # built-in name, path/to/file.py:fn or package.module:fn, as given
    shape: Annotated[dict[str, Any], SHAPE]   # the shape keywords given
    device: Annotated[str, DEVICE]
    dtype: Annotated[str, DTYPE]
    # "bfloat16"/"float16": the forward ran under torch.autocast; in every file (null when not)
    autocast: Annotated[str, AUTOCAST] | None = json_field(default=None, required=True)

    def describe(self) -> str:
        shape = ",".join(f"{k}={v}" for k, v in self.shape.items())
        return (f"{self.spec}" + (f" --shape {shape}" if shape else "") + f" on {self.device} in {self.dtype}"
                + (f" under autocast {self.autocast}" if self.autocast else ""))


@dataclasses.dataclass(kw_only=True)
class Plan(JsonCodec, reading=Reading(error=PlanError, what="plan", version=PLAN_SCHEMA_VERSION)):
    """A plan and the figures behind it (bytes, ms). Its JSON's optional fields are those older plan
    files may lack (read as their defaults here); every other one is required. ``from_json(d, source=...)``
    checks ``d`` against its schema first (NOTE [checked reading] in remat/_codec.py): PlanError if off."""

    # the planner spec it came from ("optimal", "uniform:2", "optimal->all", ...), typed; its JSON is the
    # spec's text (NOTE [planner specs]); text given here is parsed
    planner: PlannerText
    budget_bytes: Annotated[int, Int(1, 2 ** 53)] | None   # whole-step peak budget (None: planner needs none)
    reserve: Annotated[float, Num(0, 0.999999)]   # fraction of the budget kept free (0.05 = 5%)
    boundaries: Annotated[list[Boundary], Len(10_000)]
    excluded: Annotated[list[Exclusion], Len(MAX_MODULES)]
    predicted_peak_bytes: SignedBytes
    predicted_overhead_ms: SignedMs
    baseline_peak_bytes: Bytes
    baseline_step_ms: Ms
    fingerprint: ModelFingerprint
    preserve_rng_state: bool = True       # RNG policy: replay sees the forward's RNG state
    measured_peak_bytes: Bytes | None = None
    measured_step_ms: Ms | None = None
    memory_source: MemorySource = MemorySource.CPU_LIVE_TENSORS
    simulated: bool = False               # figures from --simulate, not a measured run
    device_model: Short | None = None
    # The seven below are left out of the JSON when None, so eager, single-step plans (and those of
    # remat.auto and older files) read as they always did.
    # run compiled (torch.compile of the model; NOTE [compiled arms])
    compile: CompileSpec | None = json_field(default=None, omit=None)
    # offload priced with these bandwidths (NOTE [offload cost model])
    offload: OffloadPricing | None = json_field(default=None, omit=None)
    # what `remat plan` profiled (NOTE [plan workload]); None: not recorded
    workload: PlanWorkload | None = json_field(default=None, omit=None)
    # the steps it was made and measured on (NOTE [step sample]); None: one step
    sample: Annotated[SampleRecord, SAMPLE] | None = json_field(default=None, omit=None)
    # the unplanned step did not fit the device: its evidence and the smaller batches the plan was
    # profiled at (NOTE [blocked step] in remat/profile/blocked.py); None: the unplanned step fitted
    blocked: BlockedStep | None = json_field(default=None, omit=None)
    # the closed loop's time race against the fastest simple plan that fits (NOTE [time race] in
    # remat/closed_loop.py); None: not raced (no budget, a simple plan asked for, or the race skipped)
    time_race: TimeRace | None = json_field(default=None, omit=None)
    # the candidates optimal/greedy searched without as saving too little (NOTE [small boundaries] in
    # plan/planners.py); None: the rule did not apply (another planner, or no candidate was small)
    small_boundaries: SmallBoundaries | None = json_field(default=None, omit=None)
    schema_version: Annotated[int, Enum(PLAN_SCHEMA_VERSION)] = json_field(default=PLAN_SCHEMA_VERSION, required=True)

    def __post_init__(self) -> None:
        self.planner = PlannerSpec.parse(self.planner)
        if not 0.0 <= self.reserve < 1.0:
            raise PlanError(f"reserve must be in [0, 1), got {self.reserve}")
        names = [b.module for b in self.boundaries]
        if len(set(names)) != len(names):
            raise PlanError(f"a module is listed twice in the plan: {sorted(n for n in names if names.count(n) > 1)}")

    @property
    def effective_budget_bytes(self) -> int | None:
        """Budget less the reserve: what the predicted/measured peak must stay under."""
        return None if self.budget_bytes is None else int(self.budget_bytes * (1.0 - self.reserve))

    def save(self, path: Path | str) -> Path:
        from .._io import atomic_write_json
        return atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path | str) -> "Plan":
        """Read ``plan.json`` through the hardened loader (NOTE [hostile JSON] in remat/_json.py)."""
        data = read_json_file(path, error=PlanError, what="plan file", max_bytes=MAX_PLAN_BYTES,
                              tip="remat plan ... --out DIR writes DIR/plan.json")
        return cls.from_json(data, source=f"plan {path}")
