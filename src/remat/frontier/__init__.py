"""remat.frontier: warm p50/p95, peak, capacity search, Pareto set and the ship decision (docs/DESIGN.md).

``run_frontier(loaded, FrontierSettings(budget_bytes=..., reserve=...))`` measures a set of plans
on one workload, interleaved, and returns a :class:`FrontierReport` (``to_json()`` is what
``remat frontier`` writes to ``frontier.json``). The pure parts (``pareto_flags``,
``decide``, ``search_capacity``) work on made-up data. Arms, the scheduler and the peaks are
remat.measure's; a plan becomes an arm through remat.wrap.PlanArm. The model and the capacity
search import without torch; the rest loads on first use (NOTE [import cost] in remat._lazy).
"""

from .._lazy import lazy_exports
from .capacity import MeasureFn, search_capacity
from .model import (FRONTIER_SCHEMA_VERSION, CapacityResult, CapacityTry, Decision, FrontierPoint, FrontierReport,
                    OverheadInterval, describe_overhead, short_overhead)

_LAZY = {   # name -> the module that defines it
    **dict.fromkeys(["P50Difference", "decide", "dominates", "p50_difference", "pareto_flags"], "remat.frontier.pareto"),
    "render_frontier_png": "remat.frontier.plot",
    **dict.fromkeys(["CONTROL", "DEFAULT_PLANS", "FrontierSettings", "PlanRequest", "capacity_try", "parse_plan_requests",
                     "run_frontier"], "remat.frontier.run"),
}

__all__ = ["FRONTIER_SCHEMA_VERSION", "CapacityResult", "CapacityTry", "Decision", "FrontierPoint", "FrontierReport",
           "MeasureFn", "OverheadInterval", "describe_overhead", "search_capacity", "short_overhead", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
