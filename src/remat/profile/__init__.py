"""Per-candidate costs (saved bytes, replay ms, hazards) measured on the real step."""

from .candidates import auto_candidates, resolve_candidates
from .fingerprint import class_source_hash, fingerprint, module_revision
from .measure import profile_simulated, profile_step, profile_workload
from .model import CandidateCost, FingerprintDiff, HazardRecord, ModelFingerprint, ParamSignature, PeakRow, ProfileReport

__all__ = ["CandidateCost", "FingerprintDiff", "HazardRecord", "ModelFingerprint", "ParamSignature", "PeakRow", "ProfileReport",
           "auto_candidates", "class_source_hash", "fingerprint", "module_revision", "profile_simulated", "profile_step",
           "profile_workload", "resolve_candidates"]
