"""remat.receipt: the versioned JSON receipt, its schema and its HTML/Markdown rendering (docs/DESIGN.md).

The runs that make and check a receipt are remat.workflow's (``make_receipt``, ``check_receipt``).
``write_receipt(receipt, out_dir)`` writes ``receipt.json``, ``report.html`` and ``report.md``
atomically (a single-process run's, or a pipeline run's: NOTE [one receipt] in remat/receipt/model.py);
``load_receipt(path)`` reads either back, validated against its schema (a malformed
or hostile file raises :class:`~remat.errors.ReceiptError`). ``render_html``/``render_markdown`` need nothing but the receipt.
"""

from .model import (RECEIPT_SCHEMA, BoundaryRecord, Fixture, Receipt, ReceiptContext, ReceiptDecision, ReceiptPlan, ReceiptTraces,
                    RejectedPlan, Rejection, RunSettings, ShipStatus, Coverage, UnsupportedMode, git_revision, load_receipt, load_receipt_with_digest,
                    resolved_shape)
from .render import render_html, render_markdown, timeline_png
from .world_size import PipelineEvidence, StageBoundary, WorldSizeEvidence
from .schema import RECEIPT_SCHEMA_VERSION, parse_json_bounded, validate
from .write import ReceiptFiles, write_receipt

__all__ = ["BoundaryRecord", "Coverage", "Fixture", "PipelineEvidence", "RECEIPT_SCHEMA", "RECEIPT_SCHEMA_VERSION", "Receipt", "ReceiptContext",
           "ReceiptDecision", "ReceiptFiles", "ReceiptPlan", "ReceiptTraces", "RejectedPlan", "Rejection", "RunSettings", "ShipStatus",
           "StageBoundary", "WorldSizeEvidence",
           "UnsupportedMode", "git_revision", "load_receipt", "load_receipt_with_digest", "parse_json_bounded",
           "render_html", "render_markdown", "resolved_shape", "timeline_png", "validate", "write_receipt"]
