"""remat.receipt: the versioned JSON receipt, its HTML/Markdown rendering, and ``check`` (DESIGN.md).

``make_receipt(loaded, budget=...)`` runs the whole pipeline and returns a :class:`Receipt`;
``write_receipt(receipt, out_dir)`` writes ``receipt.json``, ``report.html`` and ``report.md``
atomically; ``load_receipt(path)`` reads one back, validated against its schema (a malformed
or hostile file raises :class:`~remat.errors.ReceiptError`); ``check_receipt(receipt)`` re-runs
the fixtures it names. ``render_html``/``render_markdown`` need nothing but the receipt.
"""

from .build import held_bytes_at_backward, make_receipt, measure_savings, trace_planned, unsupported_modes
from .check import (CheckFinding, CheckReport, ChosenWorkload, check_receipt, choose_workload, project_workload,
                    report_findings, same_workload)
from .model import (BoundaryRecord, Fixture, Receipt, ReceiptContext, ReceiptDecision, ReceiptPlan, ReceiptTraces,
                    RejectedPlan, RunSettings, UnsupportedMode, git_revision, load_receipt, load_receipt_with_digest,
                    resolved_shape)
from .render import render_html, render_markdown, timeline_png
from .schema import RECEIPT_SCHEMA, RECEIPT_SCHEMA_VERSION, parse_json_bounded, validate
from .write import ReceiptFiles, write_receipt

__all__ = ["BoundaryRecord", "CheckFinding", "CheckReport", "ChosenWorkload", "Fixture", "RECEIPT_SCHEMA", "RECEIPT_SCHEMA_VERSION",
           "Receipt", "ReceiptContext", "ReceiptDecision", "ReceiptFiles", "ReceiptPlan", "ReceiptTraces",
           "RejectedPlan", "RunSettings", "UnsupportedMode", "check_receipt", "choose_workload", "git_revision",
           "held_bytes_at_backward", "load_receipt", "load_receipt_with_digest", "project_workload", "report_findings",
           "same_workload", "make_receipt", "measure_savings", "parse_json_bounded", "render_html", "render_markdown",
           "resolved_shape", "timeline_png", "trace_planned", "unsupported_modes", "validate",
           "write_receipt"]
