"""The ``Plan``: which modules to checkpoint and how, with the figures that justify it.

A plan is plain JSON (``plan.json``) that round-trips exactly and is bound to a model by
its fingerprint. ``remat.apply`` consumes it; receipts embed it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..profile.model import ModelFingerprint
from ..types import CheckpointMode

PLAN_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Boundary:
    module: str                  # module path, as in model.named_modules()
    mode: CheckpointMode         # FULL or SELECTIVE (KEEP is never listed)
    saved_bytes: int             # predicted bytes freed until backward
    replay_ms: float             # predicted added backward time
    guarded: bool = False        # buffers restored around the replay (BatchNorm running stats)

    def __post_init__(self) -> None:
        if self.mode is CheckpointMode.KEEP:
            raise PlanError(f"boundary {self.module}: mode 'keep' is not a boundary; leave it out of the plan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exclusion:
    module: str
    reason: str


@dataclasses.dataclass(kw_only=True)
class Plan:
    planner: str                          # "optimal", "greedy", "sqrt", "uniform:2", "all", "none", ...
    budget_bytes: int | None              # whole-step peak budget (None: planner needs none)
    reserve: float                        # fraction of the budget kept free (0.05 = 5%)
    boundaries: list[Boundary]
    excluded: list[Exclusion]
    predicted_peak_bytes: int
    predicted_overhead_ms: float
    baseline_peak_bytes: int
    baseline_step_ms: float
    fingerprint: ModelFingerprint
    preserve_rng_state: bool = True       # RNG policy: replay sees the forward's RNG state
    measured_peak_bytes: int | None = None
    measured_step_ms: float | None = None
    memory_source: str = "cpu-live-tensors"
    simulated: bool = False               # figures from --simulate (issue 8), not a measured run
    device_model: str | None = None
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve < 1.0:
            raise PlanError(f"reserve must be in [0, 1), got {self.reserve}")
        names = [b.module for b in self.boundaries]
        if len(set(names)) != len(names):
            raise PlanError(f"a module is listed twice in the plan: {sorted(n for n in names if names.count(n) > 1)}")

    @property
    def effective_budget_bytes(self) -> int | None:
        """Budget less the reserve: what the predicted/measured peak must stay under."""
        return None if self.budget_bytes is None else int(self.budget_bytes * (1.0 - self.reserve))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["boundaries"] = [{**dataclasses.asdict(b), "mode": b.mode.value} for b in self.boundaries]
        d["excluded"] = [dataclasses.asdict(e) for e in self.excluded]
        d["fingerprint"] = self.fingerprint.to_json()
        return d

    @classmethod
    def from_json(cls, d: Any) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("plan JSON must be an object")
        try:
            version = int(d["schema_version"])
            if version != PLAN_SCHEMA_VERSION:
                raise PlanError(f"plan schema_version {version} is not supported (this remat reads {PLAN_SCHEMA_VERSION})")
            return cls(
                planner=str(d["planner"]),
                budget_bytes=None if d["budget_bytes"] is None else int(d["budget_bytes"]),
                reserve=float(d["reserve"]),
                boundaries=[Boundary(module=str(b["module"]), mode=CheckpointMode(b["mode"]),
                                     saved_bytes=int(b["saved_bytes"]), replay_ms=float(b["replay_ms"]),
                                     guarded=bool(b.get("guarded", False))) for b in d["boundaries"]],
                excluded=[Exclusion(module=str(e["module"]), reason=str(e["reason"])) for e in d["excluded"]],
                predicted_peak_bytes=int(d["predicted_peak_bytes"]),
                predicted_overhead_ms=float(d["predicted_overhead_ms"]),
                baseline_peak_bytes=int(d["baseline_peak_bytes"]),
                baseline_step_ms=float(d["baseline_step_ms"]),
                fingerprint=ModelFingerprint.from_json(d["fingerprint"]),
                preserve_rng_state=bool(d.get("preserve_rng_state", True)),
                measured_peak_bytes=None if d.get("measured_peak_bytes") is None else int(d["measured_peak_bytes"]),
                measured_step_ms=None if d.get("measured_step_ms") is None else float(d["measured_step_ms"]),
                memory_source=str(d.get("memory_source", "cpu-live-tensors")),
                simulated=bool(d.get("simulated", False)),
                device_model=d.get("device_model"),
                schema_version=version,
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed plan JSON: {type(exc).__name__}: {exc}") from exc

    def save(self, path: Path | str) -> Path:
        from .._io import atomic_write_json
        return atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path | str) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"plan file not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_json(data)
