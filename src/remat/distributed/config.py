"""What one distributed run does: the workload to rebuild on every rank, the plan, the engine.

The config is plain JSON: the launcher writes it, every rank reads it and rebuilds the
workload itself from ``spec`` + ``shape`` (nothing torch is pickled across processes), so
the same file drives a local run and a multi-node torchrun job (NOTE [launcher], launch.py).
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any, ClassVar, Self

from .._json import Bool, Enum, Int, JsonValue, Map, Num, Obj, Opt, Str, read_json_file, validate
from ..errors import DistributedError, PlanError
from ..plan.model import Plan

CONFIG_SCHEMA_VERSION = 1

CONFIG_SCHEMA = Obj({
    "schema_version": Enum(CONFIG_SCHEMA_VERSION), "spec": Str(max_len=4096),
    "shape": Map(JsonValue(), key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100),
    "world_size": Int(1, 1 << 16), "engine": Enum("ddp", "fsdp2"), "plan": Opt(JsonValue()),
    "device": Str(r"cpu|cuda(:[0-9]{1,3})?"), "dtype": Enum("float32", "bfloat16", "float16"),
    "steps": Int(1, 1000), "warmup": Int(2, 100), "comm_steps": Int(1, 1000), "timeout_s": Num(1e-3, 7 * 86400.0),
    "seed": Int(0, 2 ** 63 - 1), "ablation": Bool(), "find_unused_parameters": Bool(), "use_reentrant": Bool(),
}, {"budget_bytes": Int(1, 2 ** 53), "wall_timeout_s": Num(1e-3, 7 * 86400.0)})

REENTRANT_FIND_UNUSED_TIP = (
    "use non-reentrant checkpointing (torch.utils.checkpoint.checkpoint(..., use_reentrant=False), which is what "
    "remat.apply does), or run DDP with find_unused_parameters=False"
)


class Engine(str, enum.Enum):
    """The data-parallel engine the step runs under (PyTorch's own, never a home-made one)."""

    DDP = "ddp"      # torch.nn.parallel.DistributedDataParallel
    FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard on a 1-D device mesh


@dataclasses.dataclass(kw_only=True)
class LaunchConfig:
    """What every torchrun launch carries (NOTE [launcher], launch.py): the workload each rank rebuilds from
    ``spec`` + ``shape``, the ranks, the device and dtype, the step counts and the per-collective timeout
    (``timeout_s``, seconds). :class:`DistributedConfig` and the pipeline's ``PipelineConfig`` extend it; each
    validates its own limits and keeps its own file format (``FORMAT``: its fields in its file's order)."""

    spec: str
    shape: dict[str, Any]
    world_size: int
    device: str = "cpu"
    dtype: str = "float32"
    steps: int = 10
    warmup: int = 2
    timeout_s: float = 120.0
    seed: int = 0

    FORMAT: ClassVar[Obj]   # the config file's schema; its field order is the file's, schema_version written last
    WHAT: ClassVar[str]     # what the file is called in errors, e.g. "distributed config"

    @property
    def batch_size(self) -> int:
        """The global batch: the workload's ``batch_size`` shape keyword (1 for a factory that takes none)."""
        return int(self.shape.get("batch_size", 1))

    @property
    def backend(self) -> str:
        """gloo on CPU, nccl on CUDA."""
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def to_json(self) -> dict[str, Any]:
        d = self.json_fields()
        keys = [*(k for k in self.FORMAT.required if k != "schema_version"),
                *(k for k in self.FORMAT.optional if d.get(k) is not None), "schema_version"]
        return {k: d[k] for k in keys}

    def json_fields(self) -> dict[str, Any]:
        """Every field as JSON (enums as their values), in any order."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> Self:
        """Build from the config file's JSON, checked against ``FORMAT`` (each config its own)."""
        raise NotImplementedError

    def save(self, path: Path | str) -> Path:
        from .._io import atomic_write_json
        return atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path | str) -> Self:
        return cls.from_json(read_json_file(path, error=DistributedError, what=cls.WHAT))


@dataclasses.dataclass(kw_only=True)
class DistributedConfig(LaunchConfig):
    """One distributed measurement: control (no plan) and, when ``plan`` is given, the plan.

    ``steps`` warm steps are timed per side (after ``warmup`` >= 2 untimed ones, since DDP
    rebuilds its buckets after the first iteration); ``comm_steps`` more run with the
    compute timer on, for exposed communication (NOTE [exposed communication]).
    ``timeout_s`` bounds every collective (``init_process_group(timeout=...)``).
    ``budget_bytes`` is the per-device peak budget every rank's planned peak is held to (None:
    the plan's own ``budget_bytes``). ``wall_timeout_s`` is each rank's own wall-clock limit
    for the whole run (NOTE [rank wall clock], worker.py): the multi-node path sets it, since no
    launcher watches the ranks there; None leaves it to the local launcher.
    """

    engine: Engine = Engine.DDP
    plan: Plan | None = None
    comm_steps: int = 3
    ablation: bool = True                 # also time a no-op comm hook (same compute, no communication)
    find_unused_parameters: bool = False  # DDP only
    use_reentrant: bool = False           # the workload checkpoints itself with use_reentrant=True
    budget_bytes: int | None = None       # per-device budget, bytes (None: the plan's)
    wall_timeout_s: float | None = None   # seconds, each rank's own limit (None: the launcher's)
    schema_version: int = CONFIG_SCHEMA_VERSION

    FORMAT = CONFIG_SCHEMA
    WHAT = "distributed config"

    def __post_init__(self) -> None:
        self.engine = Engine(self.engine)
        if self.world_size < 1:
            raise DistributedError(f"world size must be >= 1, got {self.world_size}")
        if self.warmup < 2:
            raise DistributedError(
                f"warm-up must be at least 2 steps, got {self.warmup}",
                tip="DDP rebuilds its gradient buckets after the first iteration; the second step is the first warm one",
            )
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
            raise DistributedError("find_unused_parameters is a DDP option; it does not apply to fsdp2")
        reentrant = self.use_reentrant or bool(getattr(self.plan, "use_reentrant", False))
        if self.engine is Engine.DDP and self.find_unused_parameters and reentrant:
            raise DistributedError(
                "refusing reentrant activation checkpointing with DDP find_unused_parameters=True: the reentrant "
                "replay runs its own backward, DDP marks the replayed parameters ready a second time and the first "
                "backward fails with 'Expected to mark a variable ready only once'",
                tip=REENTRANT_FIND_UNUSED_TIP,
            )

    @property
    def device_budget_bytes(self) -> int | None:
        """The per-device budget each rank's planned peak must stay within (bytes), or None (nothing to hold it to)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        return None if self.plan is None else self.plan.budget_bytes

    def json_fields(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["engine"] = self.engine.value
        d["plan"] = None if self.plan is None else self.plan.to_json()
        return d

    @classmethod
    def from_json(cls, d: Any) -> "DistributedConfig":
        """Build from config JSON checked against :data:`CONFIG_SCHEMA` (NOTE [hostile JSON]); DistributedError if off."""
        if not isinstance(d, dict):
            raise DistributedError("distributed config JSON must be an object")
        version = d.get("schema_version")
        if type(version) is not int or version != CONFIG_SCHEMA_VERSION:
            raise DistributedError(f"distributed config schema_version {str(version)[:40]} is not supported "
                                   f"(this remat reads {CONFIG_SCHEMA_VERSION})")
        validate(d, CONFIG_SCHEMA, error=DistributedError, what="distributed config")
        d = {k: v for k, v in d.items() if k != "schema_version"}
        if d.get("plan") is not None:
            try:
                d["plan"] = Plan.from_json(d["plan"], source="the distributed config's plan")
            except PlanError as exc:
                raise DistributedError(exc.message) from None
        return cls(**d)
