"""The pipeline receipt: one pipeline run's figures (``pipeline.json``) and per-stage plans, as versioned JSON.

NOTE [pipeline receipt]
A pipeline run (``remat distributed --engine pipeline``, ``remat receipt --engine pipeline``)
has no single-process trace, frontier or paired-seed verification to put in a
:class:`~remat.receipt.Receipt`; what it proves is per stage. So it has its own receipt kind,
``remat-pipeline-receipt``: the context (the same fields as a receipt's), the whole
:class:`~remat.distributed.pipeline.report.PipelineReport` (per side and stage: peak, in-flight
count, forward/backward/replay/p2p/idle ms, bubble fraction, the last timed step's timeline;
the equivalence against the unplanned pipeline and the negative control; the per-stage
plans), and each stage boundary's revision hash. It is read through the same hardened JSON
loader and validated field by field (NOTE [hostile JSON] in remat/_json.py); ``remat check``
tells the two kinds apart by ``kind`` and re-checks a pipeline receipt with a world-size-p
launch (remat/workflow/pipeline.py). ``report.html`` (per-stage table, SVG timeline per
side) and ``report.md`` are rendered from it alone and name its sha256, as a receipt's do.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Annotated, Any

from .. import _json
from .._codec import JsonCodec, Len, from_json, json_field, schema
from .._json import MODULE_PATH, json_kind, read_bounded_bytes
from ..distributed.pipeline.report import PIPELINE_REPORT, PipelineReport
from ..errors import ReceiptError, RematError
from ..plan.pipeline import PipelinePlan, Side
from .model import ReceiptContext
from .schema import HEX16, SHORT, parse_json_bounded

PIPELINE_RECEIPT_KIND = "remat-pipeline-receipt"
PIPELINE_RECEIPT_SCHEMA_VERSION = 1
MAX_CHECK_STEPS = 100


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageBoundary(JsonCodec):
    """One boundary of remat's per-stage plans, with the revision hash ``remat check`` compares."""

    stage: Annotated[int, _json.Int(0, 1 << 20)]
    module: Annotated[str, MODULE_PATH]
    class_name: Annotated[str, SHORT]
    revision: Annotated[str, HEX16]   # remat.profile.module_revision: class sources + parameter shapes


@dataclasses.dataclass(kw_only=True)
class PipelineReceipt(JsonCodec):
    """NOTE [pipeline receipt]."""

    # checked first, for a precise message (from_json); ``kind`` is written after it
    schema_version: Annotated[int, _json.Int(0, 1000)] = json_field(default=PIPELINE_RECEIPT_SCHEMA_VERSION,
                                                                     required=True, then=("kind",))
    context: ReceiptContext
    pipeline: Annotated[PipelineReport, PIPELINE_REPORT]
    boundaries: Annotated[list[StageBoundary], Len(100_000)]
    # timed steps per side when `remat check` re-runs the pipeline
    check_steps: Annotated[int, _json.Int(1, MAX_CHECK_STEPS)] = json_field(default=1, required=True)
    # p2p/collective timeout of that re-run (s)
    check_timeout_s: Annotated[float, _json.Num(1, 86400.0)] = json_field(default=60.0, required=True)

    @property
    def kind(self) -> Annotated[str, _json.Enum(PIPELINE_RECEIPT_KIND)]:
        """What the file is: the top level's ``kind`` key (never read back)."""
        return PIPELINE_RECEIPT_KIND

    @property
    def plan(self) -> PipelinePlan | None:
        """remat's per-stage plans (None when the run had no ``remat`` side)."""
        return self.pipeline.remat_plan

    @property
    def why_not(self) -> list[str]:
        """Why this receipt proves nothing to ship (empty when it does): the decision ``check`` re-checks."""
        report = self.pipeline
        out = []
        if report.remat_plan is None:
            out.append("the run has no per-stage plans (no remat side)")
        eq = report.equivalence.get(Side.REMAT)
        if eq is None:
            out.append("the per-stage plans were not compared with the unplanned pipeline")
        elif not eq.ok:
            out.append(f"the per-stage plans' gradients differ from the unplanned pipeline's "
                       f"(max |diff| {eq.max_abs_diff:.3g})")
        if report.negative_control_rejected is False:
            out.append("the negative control (a perturbed gradient) was accepted: the comparison proves nothing")
        if report.remat_fits is False:
            out.append("a stage's measured peak is over the per-device budget: "
                       + ", ".join(f"stage {k}" for k in report.over_budget_stages))
        return out

    @property
    def holds(self) -> bool:
        return not self.why_not

    @classmethod
    def from_json(cls, data: Any) -> "PipelineReceipt":
        """A hand reader around the codec's: the version and schema checked first, the parts against each
        other after."""
        if not isinstance(data, dict):
            raise ReceiptError("malformed pipeline receipt: the top level must be a JSON object")
        v = data.get("schema_version")
        if v != PIPELINE_RECEIPT_SCHEMA_VERSION:
            raise ReceiptError(f"pipeline receipt schema_version {_json.show(v)} is not supported (this remat reads "
                               f"{PIPELINE_RECEIPT_SCHEMA_VERSION})",
                               tip="re-create it with this remat (`remat distributed --engine pipeline ...`)")
        _json.validate(data, PIPELINE_RECEIPT_SCHEMA, error=ReceiptError, what="pipeline receipt")
        try:
            receipt = from_json(cls, data)
            plan = receipt.plan
        except ReceiptError:
            raise
        except (RematError, KeyError, TypeError, ValueError) as exc:
            msg = exc.message if isinstance(exc, RematError) else f"{type(exc).__name__}: {exc}"
            raise ReceiptError(f"malformed pipeline receipt: {msg}") from exc
        # the parts must agree (a hand-edited receipt could mix them)
        planned = [] if plan is None else [(s.stage, b.module) for s in plan.stages for b in s.plan.boundaries]
        recorded = [(b.stage, b.module) for b in receipt.boundaries]
        if planned != recorded:
            raise ReceiptError(f"malformed pipeline receipt: the per-stage plans' boundaries {planned} differ from "
                               f"the boundary records {recorded}")
        if receipt.context.workload != receipt.pipeline.spec:
            raise ReceiptError("malformed pipeline receipt: the context and the pipeline report name different workloads")
        return receipt


# the pipeline receipt file's schema, from the fields (NOTE [codecs from the types] in remat/_codec.py)
PIPELINE_RECEIPT_SCHEMA = schema(PipelineReceipt)


def load_any_receipt_with_digest(path: Path | str) -> tuple[Any, str]:
    """(a :class:`Receipt` or a :class:`PipelineReceipt`, by its ``kind``; the sha256 of the bytes read)."""
    from .model import Receipt
    data = read_bounded_bytes(path, error=ReceiptError, what="receipt file",
                              tip="remat receipt ... --out DIR writes DIR/receipt.json")
    parsed = parse_json_bounded(data, source=str(path))
    digest = hashlib.sha256(data).hexdigest()
    if json_kind(parsed) == PIPELINE_RECEIPT_KIND:
        return PipelineReceipt.from_json(parsed), digest
    return Receipt.from_json(parsed), digest
