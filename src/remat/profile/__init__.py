"""Per-candidate costs (saved bytes, replay ms, hazards) measured on the real step.

The result types (``model``) and fingerprints import without torch, so the plan stage reads a
profile without it; the measuring functions load torch on first use (NOTE [import cost] in remat._lazy).
"""

from .._lazy import lazy_exports
from .fingerprint import class_source_hash, fingerprint, module_revision   # eager: ``fingerprint`` is also a submodule's name
from .model import (CandidateCost, DiffKind, FingerprintDiff, HazardRecord, ModelFingerprint, ParamSignature, PeakRow, ProfileReport,
                    SampleRecord, StepSample)

_LAZY = {
    "auto_candidates": "remat.profile.candidates",
    "resolve_candidates": "remat.profile.candidates",
    "profile_simulated": "remat.profile.step",
    "profile_step": "remat.profile.step",
    "profile_workload": "remat.profile.step",
    "profile_sample": "remat.profile.sample",
    "UnsampledBlockWarning": "remat.profile.twins",
}

__all__ = ["CandidateCost", "DiffKind", "FingerprintDiff", "HazardRecord", "ModelFingerprint", "ParamSignature", "PeakRow", "ProfileReport",
           "SampleRecord", "StepSample", "UnsampledBlockWarning", "auto_candidates", "class_source_hash", "fingerprint", "module_revision", "profile_sample", "profile_simulated", "profile_step",
           "profile_workload", "resolve_candidates"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
