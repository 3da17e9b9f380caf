"""remat.workflow: the end-to-end runs, just below the CLI (docs/DESIGN.md's *workflow* row).

``make_receipt(loaded, budget=...)`` runs trace -> profile -> plan (closed loop) -> frontier
-> verify and assembles a :class:`remat.receipt.Receipt` (``remat receipt``, ``remat demo``);
``check_receipt(receipt)`` re-runs the fixtures a receipt names (``remat check``). The
receipt package keeps only the receipt's model, schema and rendering.
"""

from .build import held_bytes_at_backward, make_receipt, measure_savings, trace_planned, unsupported_modes
from .check import (CheckReport, ChosenWorkload, ReportStamps, check_receipt, choose_workload, fixture_plan,
                    project_workload, report_findings, same_workload)
from .findings import CheckFinding, FindingKind
from .gate import GateSettings

__all__ = ["CheckFinding", "CheckReport", "ChosenWorkload", "FindingKind", "GateSettings", "ReportStamps",
           "check_receipt", "choose_workload", "fixture_plan", "held_bytes_at_backward", "make_receipt",
           "measure_savings", "project_workload", "report_findings", "same_workload", "trace_planned",
           "unsupported_modes"]
