"""Planners (pure: no torch ops), the peak/overhead cost model, and the ``Plan`` type."""

from .budget import (InfeasibleBudget, budget_on_device, check_budget_syntax, effective_budget, format_bytes, min_budget_for,
                     parse_budget, parse_capacity, parse_reserve)
from .cost import CostModel, peak_floor, predict_overhead_ms, predict_peak
from .model import PLAN_SCHEMA_VERSION, Boundary, Exclusion, Plan, PlanWorkload
from .offload import OffloadPricing, with_offload
from .planners import (Eligibility, Planner, classify_candidates, correction_margin, make_plan, planner_from_spec,
                       replan_with_correction)
from .spec import BUDGET_PLANNERS, PLANNER_SPECS, PlannerKind, PlannerSpec

__all__ = ["BUDGET_PLANNERS", "PLANNER_SPECS", "PLAN_SCHEMA_VERSION", "Boundary", "CostModel", "Eligibility",
           "Exclusion", "InfeasibleBudget", "budget_on_device", "parse_capacity", "OffloadPricing", "Plan", "PlanWorkload", "Planner", "PlannerKind", "PlannerSpec", "classify_candidates",
           "correction_margin", "check_budget_syntax", "effective_budget", "format_bytes", "make_plan", "min_budget_for", "parse_budget",
           "parse_reserve",
           "peak_floor", "planner_from_spec", "predict_overhead_ms", "predict_peak", "replan_with_correction", "with_offload"]
