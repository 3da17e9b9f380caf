"""Per-candidate costs (saved bytes, replay ms, hazards) measured on the real step."""

from .fingerprint import class_source_hash, fingerprint, module_revision
from .model import CandidateCost, HazardRecord, ModelFingerprint, ParamSignature, PeakRow, ProfileReport

__all__ = ["CandidateCost", "HazardRecord", "ModelFingerprint", "ParamSignature", "PeakRow", "ProfileReport",
           "class_source_hash", "fingerprint", "module_revision"]
