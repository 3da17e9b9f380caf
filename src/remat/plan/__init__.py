"""Planners (pure: no torch ops), the peak/overhead cost model, and the ``Plan`` type."""

from .model import PLAN_SCHEMA_VERSION, Boundary, Exclusion, Plan

__all__ = ["PLAN_SCHEMA_VERSION", "Boundary", "Exclusion", "Plan"]
