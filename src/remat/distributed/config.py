"""What one distributed run does: the workload to rebuild on every rank, the engine, the plan.

The config is plain JSON: the launcher writes it, every rank reads it and rebuilds the
workload itself from ``spec`` + ``shape`` (nothing torch is pickled across processes), so
the same file drives a local run and a multi-node torchrun job (NOTE [launcher], launch.py).
One config for every engine: DDP and FSDP2 run the control and a whole-model :class:`Plan`;
the pipeline engine (``distributed/pipeline/``) runs its sides with a :class:`PipelinePlan`
and its own settings (:class:`PipelineSettings`).
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Annotated, Any

from .._codec import AS_WRITTEN, JsonCodec, Len, Reading, Short, json_field, schema
from .._json import DTYPE, Enum, Int, JsonValue, Map, Num, Opt, Str, read_json_file, validate
from ..errors import DistributedError, RematError
from ..plan.model import Plan
from ..plan.pipeline import SIDES, PipelinePlan, Schedule, Side, is_pipeline_plan_json
from ..plan.schema import MODULE_PATH

CONFIG_SCHEMA_VERSION = 1

REENTRANT_FIND_UNUSED_TIP = (
    "use non-reentrant checkpointing (torch.utils.checkpoint.checkpoint(..., use_reentrant=False), which is what "
    "remat.apply does), or run DDP with find_unused_parameters=False"
)


class Engine(str, enum.Enum):
    """How the step runs at world size N (PyTorch's own parallelism, never a home-made one)."""

    DDP = "ddp"      # torch.nn.parallel.DistributedDataParallel
    FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard on a 1-D device mesh
    PIPELINE = "pipeline"   # torch.distributed.pipelining: stages of one model (NOTE [pipeline stages])


Name = Annotated[str, Str(max_len=200)]


def _all_sides() -> list[Side]:
    return list(Side)


@dataclasses.dataclass(kw_only=True)
class PipelineSettings(JsonCodec):
    """The pipeline engine's part of a run: the sides to run (``none``, ``uniform``, ``remat``) at one schedule
    and split. ``profile`` (a ProfileReport's JSON, whole model at the microbatch shape) is what the per-stage
    planner plans from; ``budget`` the per-device budget ("60%" of the largest unplanned stage peak, or bytes
    such as "40MiB"). Every key is in every config file (required by its schema though the field has a default)."""

    schedule: Schedule = json_field(default=Schedule.ONE_F_ONE_B, required=True)
    microbatches: Annotated[int, Int(1, 100_000)] = json_field(default=4, required=True)
    # stages_per_rank x world_size - 1 of them
    split_points: Annotated[list[Annotated[str, MODULE_PATH]], Len(100_000)] = json_field(default_factory=list,
                                                                                          required=True)
    split_source: Short = json_field(default="given", required=True)
    # v: interleaved schedules run stages r, r + p, ..., r + (v - 1) p on rank r
    stages_per_rank: Annotated[int, Int(1, 1000)] = json_field(default=1, required=True)
    profile: Annotated[Any, Opt(JsonValue())] = json_field(default=None, required=True)
    planner: Name = json_field(default="optimal", required=True)
    uniform_planner: Name = json_field(default="all", required=True)
    budget: Name | None = json_field(default=None, required=True)
    reserve: Annotated[float, Num(0, 0.999999), AS_WRITTEN] = json_field(default=0.05, required=True)
    sides: Annotated[list[Side], Len(3, min_len=1)] = json_field(default_factory=_all_sides, required=True)
    # the negative control: a gradient perturbed by 1e-3 must be rejected
    perturb_control: bool = json_field(default=True, required=True)

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.schedule)
        if self.microbatches < 1:
            raise DistributedError(f"microbatches must be >= 1, got {self.microbatches}")
        unknown = [s for s in self.sides if s not in SIDES]
        if unknown or not self.sides:
            raise DistributedError(f"pipeline sides must be among {SIDES}, got {self.sides}")
        self.sides = [Side(s) for s in self.sides]


def _read_plan(d: Any) -> Plan | PipelinePlan | None:
    """The config's plan: a :class:`PipelinePlan` (``"kind": "pipeline"``), a whole-model :class:`Plan`, or none;
    the config refuses the one its engine does not run (``__post_init__``)."""
    if d is None:
        return None
    if is_pipeline_plan_json(d):
        return PipelinePlan.from_json(d, source="the distributed config's plan")
    return Plan.from_json(d, source="the distributed config's plan")


Seconds = Annotated[float, Num(1e-3, 7 * 86400.0)]


# NOTE [checked reading] in remat/_codec.py: the version first (its own message), then the derived schema
_READING = Reading(error=DistributedError, what="distributed config", version=CONFIG_SCHEMA_VERSION,
                   wrap=(RematError, KeyError, TypeError, ValueError))


@dataclasses.dataclass(kw_only=True)
class DistributedConfig(JsonCodec, reading=_READING):
    """One distributed measurement: the control (no plan) and, when ``plan`` is given, the plan.

    ``steps`` warm steps are timed per side (after ``warmup`` untimed ones: >= 2 for DDP and FSDP2,
    since DDP rebuilds its buckets after the first iteration); ``comm_steps`` more run with the
    compute timer on, for exposed communication (NOTE [exposed communication]).
    ``timeout_s`` bounds every collective and p2p op (``init_process_group(timeout=...)``).
    ``budget_bytes`` is the per-device peak budget every rank's planned peak is held to (None:
    the plan's own ``budget_bytes``). ``wall_timeout_s`` is each rank's own wall-clock limit
    for the whole run (NOTE [rank wall clock], worker.py): the multi-node path sets it, since no
    launcher watches the ranks there; None leaves it to the local launcher. ``engine`` pipeline:
    ``pipeline`` holds its settings and ``plan`` is a :class:`PipelinePlan` to run as the ``remat``
    side instead of planning one.
    """


    # every key but the last three is in every file (required by the schema though its field has a default)
    spec: Annotated[str, Str(max_len=4096)]
    shape: Annotated[dict[str, Any], Map(JsonValue(), key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100)]
    world_size: Annotated[int, Int(1, 1 << 16)]
    engine: Engine = json_field(default=Engine.DDP, required=True)
    # its own JSON, checked by its own reader; the engine's kind (a pipeline's: per-stage plans)
    plan: Annotated[Plan | PipelinePlan | None, Opt(JsonValue())] = json_field(default=None, required=True,
                                                                              decode=_read_plan)
    device: Annotated[str, Str(r"cpu|cuda(:[0-9]{1,3})?")] = json_field(default="cpu", required=True)
    dtype: Annotated[str, DTYPE] = json_field(default="float32", required=True)
    steps: Annotated[int, Int(1, 1000)] = json_field(default=10, required=True)
    warmup: Annotated[int, Int(1, 100)] = json_field(default=2, required=True)
    comm_steps: Annotated[int, Int(1, 1000)] = json_field(default=3, required=True)
    timeout_s: Seconds = json_field(default=120.0, required=True)
    seed: Annotated[int, Int(0, 2 ** 63 - 1)] = json_field(default=0, required=True)
    # also time a no-op comm hook (same compute, no communication)
    ablation: bool = json_field(default=True, required=True)
    find_unused_parameters: bool = json_field(default=False, required=True)   # DDP only
    # the workload checkpoints itself with use_reentrant=True
    use_reentrant: bool = json_field(default=False, required=True)
    # the three below are left out of the file when None: the per-device budget, bytes (None: the plan's);
    # each rank's own wall-clock limit, s (None: the launcher's); engine pipeline's settings
    budget_bytes: Annotated[int | None, Int(1, 2 ** 53)] = json_field(default=None, omit=None)
    wall_timeout_s: Annotated[float | None, Num(1e-3, 7 * 86400.0)] = json_field(default=None, omit=None)
    pipeline: Annotated[PipelineSettings | None, schema(PipelineSettings)] = json_field(default=None, omit=None)
    schema_version: Annotated[int, Enum(CONFIG_SCHEMA_VERSION)] = json_field(default=CONFIG_SCHEMA_VERSION,
                                                                            required=True)

    def __post_init__(self) -> None:
        self.engine = Engine(self.engine)
        if self.world_size < 1:
            raise DistributedError(f"world size must be >= 1, got {self.world_size}")
        if self.steps < 1 or self.comm_steps < 1:
            raise DistributedError(f"steps and comm_steps must be >= 1, got steps={self.steps} comm_steps={self.comm_steps}")
        if self.timeout_s <= 0:
            raise DistributedError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.budget_bytes is not None and self.budget_bytes < 1:
            raise DistributedError(f"budget_bytes must be >= 1 byte, got {self.budget_bytes}")
        if self.wall_timeout_s is not None and self.wall_timeout_s <= 0:
            raise DistributedError(f"wall_timeout_s must be > 0 s, got {self.wall_timeout_s}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise DistributedError(f"device must be cpu or cuda, got {self.device!r}")
        if self.engine is not Engine.DDP and self.find_unused_parameters:
            raise DistributedError(f"find_unused_parameters is a DDP option; it does not apply to {self.engine.value}")
        if self.engine is Engine.PIPELINE:
            self._check_pipeline()
        else:
            self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        if self.pipeline is not None or isinstance(self.plan, PipelinePlan):
            raise DistributedError(f"pipeline settings and per-stage plans are for engine pipeline, not "
                                   f"{self.engine.value}")
        if self.warmup < 2:
            raise DistributedError(
                f"warm-up must be at least 2 steps, got {self.warmup}",
                tip="DDP rebuilds its gradient buckets after the first iteration; the second step is the first warm one",
            )
        reentrant = self.use_reentrant or bool(getattr(self.plan, "use_reentrant", False))
        if self.engine is Engine.DDP and self.find_unused_parameters and reentrant:
            raise DistributedError(
                "refusing reentrant activation checkpointing with DDP find_unused_parameters=True: the reentrant "
                "replay runs its own backward, DDP marks the replayed parameters ready a second time and the first "
                "backward fails with 'Expected to mark a variable ready only once'",
                tip=REENTRANT_FIND_UNUSED_TIP,
            )

    def _check_pipeline(self) -> None:
        """NOTE [pipeline stages] (distributed/pipeline/engine.py): the stages, split and sides fit together."""
        pp = self.pipeline
        if pp is None:
            raise DistributedError("engine pipeline needs its settings (schedule, microbatches, split points)")
        if isinstance(self.plan, Plan):
            raise DistributedError("--engine pipeline takes per-stage plans, not a whole-model plan",
                                   tip="a pipeline plan is the plan.json that `remat distributed --engine pipeline` writes")
        if self.world_size < 2:
            raise DistributedError(f"a pipeline needs at least 2 stages (world size >= 2), got {self.world_size}")
        check_stages_per_rank(pp.schedule, pp.stages_per_rank, self.world_size, pp.microbatches)
        if len(pp.split_points) != self.n_stages - 1:
            raise DistributedError(f"{len(pp.split_points)} split points make {len(pp.split_points) + 1} stages, "
                                   f"but {self.world_size} ranks x {pp.stages_per_rank} stage(s) per rank make "
                                   f"{self.n_stages}",
                                   tip="give world size x stages per rank - 1 split points, e.g. --split-points h.2 "
                                       "for 2 ranks of one stage")
        if not self.device.startswith("cpu"):
            raise DistributedError("the pipeline engine runs on CPU (gloo) only so far", tip="use --device cpu")
        if Side.REMAT in pp.sides and self.plan is None and pp.profile is None:
            raise DistributedError("the remat side needs a profile to plan from, or a pipeline plan")
        if Side.UNIFORM in pp.sides and pp.profile is None:
            raise DistributedError("the uniform side needs a profile to plan from")

    @property
    def n_stages(self) -> int:
        """Pipeline stages over every rank (1 per rank but for interleaved schedules)."""
        return self.world_size * (self.pipeline.stages_per_rank if self.pipeline is not None else 1)

    @property
    def batch_size(self) -> int:
        """The global batch: the workload's ``batch_size`` shape keyword (1 for a factory that takes none)."""
        return int(self.shape.get("batch_size", 1))

    @property
    def backend(self) -> str:
        """gloo on CPU, nccl on CUDA."""
        return "nccl" if self.device.startswith("cuda") else "gloo"

    @property
    def device_budget_bytes(self) -> int | None:
        """The per-device budget each rank's planned peak must stay within (bytes), or None (nothing to hold it to)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        return None if self.plan is None else self.plan.budget_bytes

    def save(self, path: Path | str) -> Path:
        from .._io import atomic_write_json
        return atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path | str) -> "DistributedConfig":
        return cls.from_json(read_json_file(path, error=DistributedError, what="distributed config"))


CONFIG_SCHEMA = schema(DistributedConfig)   # the config file's schema, from the fields (NOTE [codecs from the types])


def check_stages_per_rank(schedule: Schedule | str, v: int, world_size: int, microbatches: int) -> None:
    """Interleaved schedules need v >= 2 stages per rank (and torch's rounds to divide the microbatches);
    GPipe and 1F1B run one."""
    schedule = Schedule(schedule)
    if schedule.multi and v < 2:
        raise DistributedError(f"{schedule.value} runs several stages per rank; --stages-per-rank is {v}",
                               tip="--stages-per-rank 2")
    if not schedule.multi and v != 1:
        raise DistributedError(f"{schedule.value} runs one stage per rank; --stages-per-rank is {v}",
                               tip="use --schedule interleaved-1f1b for several stages per rank")
    if schedule.multi:
        rounds = max(1, microbatches // world_size)
        if microbatches % rounds:
            raise DistributedError(f"torch's {schedule.value} needs the microbatches ({microbatches}) to be a multiple "
                                   f"of its rounds (max(1, m // p) = {rounds})",
                                   tip=f"use a multiple of the world size ({world_size}) microbatches")
