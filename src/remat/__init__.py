"""remat: plan, apply and prove activation checkpointing for PyTorch training.

The stages (docs/DESIGN.md): workload -> memory -> trace -> measure -> simulate -> profile ->
plan -> wrap (apply) -> closed_loop -> verify -> autoplan -> integrations -> frontier -> distributed -> receipt -> workflow -> cli. The names below are the public API.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .errors import (AutoError, BudgetError, CandidateError, CheckFailed, DistributedError, FingerprintMismatch, HandleError,
                     MemoryMeasurementError, OutputError, PlanError, ReceiptError, RematError, ShapeError, UserCodeError,
                     VerificationFailed, WorkloadError)
from .types import CheckpointMode, HazardKind, MemCategory, MemorySource, Phase

__version__ = "0.1.0"

# Everything that imports torch loads on first use (``remat.Workload``, ``remat.apply``...): name ->
# module. ``import remat`` itself stays light, so the ``remat`` command can catch a Ctrl-C during
# torch's import (NOTE [exit codes] in remat.cli.main).
_LAZY = {
    "LoadedWorkload": "remat.workload",
    "TrainingStep": "remat.workload",
    "Workload": "remat.workload",
    "load_workload": "remat.workload",
    "recover_handle": "remat.wrap",
    "ApplyHandle": "remat.wrap",
    "Plan": "remat.plan",
    "trace_workload": "remat.trace",
    "StepTrace": "remat.trace",
    "apply": "remat.wrap",
    "export_check_fn": "remat.wrap",
    "profile_workload": "remat.profile",
    "make_plan": "remat.plan",
    "verify_plan": "remat.verify",
    "VerifyReport": "remat.verify",
    "auto": "remat.autoplan",
    "AutoHandle": "remat.autoplan",
    "AutoReport": "remat.autoplan",
}

__all__ = [
    "AutoError", "BudgetError", "CandidateError", "CheckFailed", "CheckpointMode", "DistributedError", "FingerprintMismatch",
    "HandleError", "HazardKind", "MemCategory", "MemoryMeasurementError", "MemorySource", "OutputError", "Phase", "PlanError",
    "ReceiptError", "RematError", "ShapeError", "UserCodeError", "VerificationFailed", "WorkloadError",
    "__version__", *_LAZY,
]


def __dir__() -> list[str]:
    """The lazy names too: ``'auto' in dir(remat)`` before anything has loaded them."""
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
