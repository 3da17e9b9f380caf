"""remat: plan, apply and prove activation checkpointing for PyTorch training.

The stages (DESIGN.md): workload -> trace -> profile -> plan -> apply -> verify ->
frontier -> receipt, plus distributed. The names below are the public API.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .errors import (BudgetError, CandidateError, CheckFailed, DistributedError, FingerprintMismatch,
                     MemoryMeasurementError, PlanError, ReceiptError, RematError, ShapeError, VerificationFailed,
                     WorkloadError)
from .types import CheckpointMode, HazardKind, MemCategory, MemorySource, Phase
from .workload import LoadedWorkload, TrainingStep, Workload, load_workload

__version__ = "0.1.0"

# Heavier stages load on first use (``remat.apply``, ``remat.Plan``...): name -> module.
_LAZY = {
    "Plan": "remat.plan",
    "trace_workload": "remat.trace",
    "StepTrace": "remat.trace",
    "apply": "remat.apply",
    "export_check_fn": "remat.apply",
    "profile_workload": "remat.profile",
    "make_plan": "remat.plan",
    "verify_plan": "remat.verify",
    "VerifyReport": "remat.verify",
}

__all__ = [
    "BudgetError", "CandidateError", "CheckFailed", "CheckpointMode", "DistributedError", "FingerprintMismatch",
    "HazardKind", "LoadedWorkload", "MemCategory", "MemoryMeasurementError", "MemorySource", "Phase", "PlanError",
    "ReceiptError", "RematError", "ShapeError", "TrainingStep", "VerificationFailed", "Workload", "WorkloadError",
    "__version__", "load_workload", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
