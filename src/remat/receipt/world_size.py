"""The receipt's evidence at a world size: the shipped plan under DDP or FSDP2 on N ranks.

NOTE [receipt at a world size]
``remat receipt --world-size N --engine ddp|fsdp2`` runs the shipped plan against the unplanned
step on N ranks (remat.distributed: the control and the plan on every rank, first-step
gradients compared, per-rank peaks, global samples/s) and keeps the whole
:class:`~remat.distributed.DistributedReport` in the receipt as ``world_size``. Every rank's
planned peak is held to the receipt's per-device budget less its reserve, the bar the
single-process peak clears (``decision.effective_budget_bytes``): each rank holds a whole
training step. The receipt then lists world sizes *other than* N (and the other engine) as not
covered, in place of "world size > 1". ``remat check`` reads the recorded per-rank peaks against
the gate's budget (NOTE [gate thresholds] in workflow/gate.py: the repository's, never the
report's own ``budget_bytes``) and, unless ``--quick``, re-runs the same launch at N ranks
with ``check_steps`` timed steps (workflow/world_size.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import _json
from ..distributed.config import Engine
from ..distributed.report import DistributedReport
from ..errors import DistributedError, ReceiptError

MAX_CHECK_STEPS = 100
RUN_WARMUP = 2         # warm-up steps per side of a launch at the world size (remat receipt's and check's)
RUN_COMM_STEPS = 1     # overlap steps per side, after the timed ones

WORLD_SIZE_EVIDENCE = _json.Obj({
    "engine": _json.Enum("ddp", "fsdp2"), "world_size": _json.Int(1, 1 << 16),
    "report": _json.Obj({"schema_version": _json.Enum(1), "world_size": _json.Int(1, 1 << 16),
                         "engine": _json.Enum("ddp", "fsdp2")},
                        {k: _json.JsonValue() for k in (
                            "backend", "device", "dtype", "workload", "torch_version", "steps", "warmup", "comm_steps",
                            "samples_per_step", "memory_source", "comm_source", "plan_boundaries", "per_rank",
                            "global_samples_per_s", "step_ms_p50", "collectives", "exposed_comm_ms", "comm_ms",
                            "ablation_step_ms", "equivalence", "budget_bytes", "over_budget_ranks", "passed",
                            "notes")}),
    "check_steps": _json.Int(1, MAX_CHECK_STEPS), "check_timeout_s": _json.Num(1, 86400.0),
})


@dataclasses.dataclass(kw_only=True)
class WorldSizeEvidence:
    """NOTE [receipt at a world size]."""

    report: DistributedReport
    check_steps: int = 2            # timed steps per side when `remat check` re-runs it
    check_timeout_s: float = 120.0  # per-collective timeout of that re-run (s)

    @property
    def world_size(self) -> int:
        return self.report.world_size

    @property
    def engine(self) -> Engine:
        return self.report.engine

    @property
    def rerun_steps(self) -> int:
        """Steps ``remat check`` runs to re-run it, over every rank: per rank and side the warm-up, the timed
        steps, the gradient step and the overlap steps (remat/distributed/worker.py), control and plan."""
        return self.world_size * 2 * (RUN_WARMUP + self.check_steps + 1 + RUN_COMM_STEPS)

    @property
    def rerun_processes(self) -> int:
        """Processes that re-run starts: the launcher (``torch.distributed.run``) and one per rank."""
        return 1 + self.world_size

    def why_not(self, budget_bytes: int) -> list[str]:
        """What the recorded run shows against a per-device ``budget_bytes`` (empty when it holds)."""
        r, out = self.report, []
        if r.plan is None or r.equivalence is None:
            out.append(f"the run at world size {r.world_size} has no planned side")
        elif not r.equivalence.ok:
            out.append(f"at world size {r.world_size} ({r.engine.value}) the plan is not the control's training step "
                       f"(grads {'match' if r.equivalence.grads_match else 'differ'}, max |diff| "
                       f"{r.equivalence.max_abs_diff:.3g}; collective counts "
                       f"{'unchanged' if r.equivalence.collective_counts_equal else 'changed'})")
        for rank in [] if r.plan is None else r.plan.per_rank:
            if rank.peak_bytes > budget_bytes:
                out.append(f"at world size {r.world_size} rank {rank.rank}'s planned peak {rank.peak_bytes} bytes is "
                           f"over the per-device budget {budget_bytes} bytes")
        return out

    # A hand codec: the JSON is computed (``engine`` and ``world_size``, the report's own, written before it so a
    # reader sees them first), and reading it checks the report against them (NOTE [codecs from the types]
    # in remat/_codec.py).
    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine.value, "world_size": self.world_size, "report": self.report.to_json(),
                "check_steps": self.check_steps, "check_timeout_s": self.check_timeout_s}

    @classmethod
    def from_json(cls, d: Any) -> "WorldSizeEvidence":
        _json.validate(d, WORLD_SIZE_EVIDENCE, error=ReceiptError, what="receipt", root="$.world_size")
        try:
            report = DistributedReport.from_json(d["report"])
        except DistributedError as exc:
            raise ReceiptError(f"malformed receipt: $.world_size.report: {exc.message}") from None
        if (report.world_size, report.engine.value) != (d["world_size"], d["engine"]):
            raise ReceiptError("malformed receipt: $.world_size names another world size or engine than its report")
        return cls(report=report, check_steps=d["check_steps"], check_timeout_s=float(d["check_timeout_s"]))
