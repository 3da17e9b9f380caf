"""remat: plan, apply and prove activation checkpointing for PyTorch training.

The stages (docs/DESIGN.md): workload -> memory -> trace -> measure -> simulate -> profile ->
plan -> wrap (apply) -> closed_loop -> verify -> autoplan -> integrations -> frontier -> distributed -> receipt -> workflow -> cli. The names below are the public API.
"""

from __future__ import annotations

from ._lazy import lazy_exports
from .errors import (AutoError, BudgetError, CandidateError, CheckFailed, CheckTimeout, ChildBug, DeviceTooSmall, DistributedError,
                     FingerprintMismatch,
                     HandleError, JobFault, MemoryMeasurementError, NewShapeError, OutputError, PlanError, ReceiptError, RematError, ShapeError,
                     StaleReceiptFormat, StaleReportFormat, TrainableChangedError, UserCodeError, VerificationFailed, WorkloadError,
                     WorkloadProcessDied)
from .types import CheckpointMode, HazardKind, MemCategory, MemorySource, Phase

__version__ = "0.1.0"

# Everything that imports torch loads on first use (``remat.Workload``, ``remat.apply``...): name ->
# module. ``import remat`` itself stays light, so the ``remat`` command can catch a Ctrl-C during
# torch's import (NOTE [exit codes] in remat.cli.main; NOTE [import cost] in remat._lazy).
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
    "PlanCheckFn": "remat.wrap",
    "profile_workload": "remat.profile",
    "make_plan": "remat.plan",
    "ProfileReport": "remat.profile",
    "verify_plan": "remat.verify",
    "VerifyReport": "remat.verify",
    "auto": "remat.autoplan",
    "AutoHandle": "remat.autoplan",
    "AutoReport": "remat.autoplan",
    "ShapePolicy": "remat.autoplan",
    "NewShapeWarning": "remat.autoplan",
    "TrainableChangedWarning": "remat.autoplan",
    "UnsampledBlockWarning": "remat.profile",
    "ExampleBatches": "remat.autoplan",
    "StepSample": "remat.profile",
    # errors and warnings raised outside remat.errors that a remat.auto caller may meet
    "InfeasibleBudget": "remat.plan",
    "BudgetMissed": "remat.closed_loop",
    "PeakLimitExceeded": "remat.measure",
    "PlanCacheWarning": "remat.autoplan",
    "BrokenCacheEntryWarning": "remat.autoplan",
    "StaleCacheEntryWarning": "remat.autoplan",
    "UnusableCacheDirWarning": "remat.autoplan",
    # a device capacity on the CPU, and the step that does not fit it (NOTE [blocked step])
    "CpuCapacity": "remat.memory.capacity",
    "CapacityError": "remat.memory.capacity",
    "BlockedStep": "remat.profile.model",
    # the device model that prices a profile's replays (NOTE [prices from counts]) loads its error class
    "SimulationError": "remat.simulate",
}

__all__ = [
    # errors and enums (imported above)
    "AutoError", "BudgetError", "CandidateError", "CheckFailed", "CheckTimeout", "CheckpointMode", "DistributedError", "FingerprintMismatch",
    "HandleError", "HazardKind", "JobFault", "MemCategory", "MemoryMeasurementError", "MemorySource", "NewShapeError", "OutputError",
    "Phase", "PlanError",
    "ReceiptError", "RematError", "ShapeError", "TrainableChangedError", "UserCodeError", "VerificationFailed", "WorkloadError", "__version__",
    "ChildBug", "StaleReceiptFormat", "StaleReportFormat", "WorkloadProcessDied",
    # loaded on first use (_LAZY): the stage functions and the results they hand back
    "ApplyHandle", "AutoHandle", "AutoReport", "ExampleBatches", "LoadedWorkload", "NewShapeWarning", "Plan", "PlanCheckFn",
    "ProfileReport", "ShapePolicy", "StepTrace",
    "TrainingStep", "VerifyReport", "Workload", "apply", "auto", "export_check_fn", "load_workload", "make_plan",
    "StepSample", "TrainableChangedWarning", "UnsampledBlockWarning", "profile_workload", "recover_handle", "trace_workload", "verify_plan",
    "BrokenCacheEntryWarning", "BudgetMissed", "InfeasibleBudget", "PeakLimitExceeded", "PlanCacheWarning",
    "UnusableCacheDirWarning", "StaleCacheEntryWarning", "CpuCapacity", "CapacityError", "DeviceTooSmall", "BlockedStep",
    "SimulationError",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)   # dir(remat) lists the lazy names too
