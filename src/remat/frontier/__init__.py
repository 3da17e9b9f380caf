"""remat.frontier: warm p50/p95, peak, capacity search, Pareto set and the ship decision (docs/DESIGN.md).

``run_frontier(loaded, FrontierSettings(budget_bytes=..., reserve=...))`` measures a set of plans
on one workload, interleaved, and returns a :class:`FrontierReport` (``to_json()`` is what
``remat frontier`` writes to ``frontier.json``). The pure parts (``pareto_flags``,
``decide``, ``search_capacity``) work on made-up data; ``Arm``/``time_round_robin``/
``probe_capacity`` are remat.measure's (re-exported here; ``probe_capacity`` as a CapacityTry),
reused by ``benchmarks/compare.py``.
"""

from .capacity import MeasureFn, search_capacity
from .measure import (Arm, PeakLimitExceeded, PlanArm, Prepared, Timings, apply_at_shape, measure_arm_peak,
                      measure_step_peak_within, percentile, prepare_arm, probe_capacity, shape_value,
                      time_round_robin)
from .model import (FRONTIER_SCHEMA_VERSION, CapacityResult, CapacityTry, Decision, FrontierPoint, FrontierReport,
                    OverheadInterval, describe_overhead, short_overhead)
from .pareto import P50Difference, decide, dominates, p50_difference, pareto_flags
from .plot import render_frontier_png
from .run import CONTROL, DEFAULT_PLANS, FrontierSettings, PlanRequest, parse_plan_requests, run_frontier

__all__ = ["CONTROL", "DEFAULT_PLANS", "FRONTIER_SCHEMA_VERSION", "Arm", "CapacityResult", "CapacityTry", "Decision",
           "FrontierPoint", "FrontierReport", "FrontierSettings", "MeasureFn", "OverheadInterval", "P50Difference",
           "PeakLimitExceeded", "describe_overhead", "short_overhead",
           "PlanArm", "PlanRequest", "Prepared",
           "Timings", "apply_at_shape", "decide", "dominates", "measure_arm_peak", "measure_step_peak_within",
           "p50_difference", "pareto_flags", "parse_plan_requests", "percentile", "prepare_arm", "probe_capacity",
           "render_frontier_png", "run_frontier", "search_capacity", "shape_value", "time_round_robin"]
