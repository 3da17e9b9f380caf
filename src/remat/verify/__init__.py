"""Prove the checkpointed step is the same training procedure as the control (docs/DESIGN.md: ``remat.verify``)."""

from .compare import TensorDiff, diff_tensor, python_state
from .model import (COMPILED_TOLERANCES, PERTURBATION, TOLERANCES, VERIFY_SCHEMA_VERSION, BoundaryActivity, Hazard, NegativeControl,
                    RngPolicy, RngTiming, StepComparison, Tolerance, VerifyReport, tolerance_table)
from .probe import DeviceMoveDetector, RegionProbe
from .runner import GradientPerturbation, measure_rng_overhead, verify_plan

__all__ = ["BoundaryActivity", "DeviceMoveDetector", "GradientPerturbation", "Hazard", "NegativeControl", "PERTURBATION",
           "RegionProbe", "RngPolicy", "RngTiming", "StepComparison", "TOLERANCES", "COMPILED_TOLERANCES", "TensorDiff",
           "Tolerance", "VERIFY_SCHEMA_VERSION", "VerifyReport", "diff_tensor", "measure_rng_overhead", "python_state",
           "tolerance_table", "verify_plan"]
