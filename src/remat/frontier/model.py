"""Frontier results: one point per plan, the report, and their JSON form.

Units: bytes for memory, milliseconds for step time, samples per second for throughput.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from .._codec import FloatAsWritten, JsonCodec, Reading, json_field
from ..errors import RematError
from ..plan.model import Plan
from ..plan.spec import PlannerSpec, PlannerText
from ..types import MemorySource

FRONTIER_SCHEMA_VERSION = 1


class Decision(str, enum.Enum):
    """What the frontier says about one plan (NOTE [ship decision] in pareto.py)."""

    SHIP = "ship"              # the cheapest measured plan whose peak clears the budget with the reserve
    REJECT = "reject"          # measured, and not shipped: the reason says why
    INFEASIBLE = "infeasible"  # the planner found no plan for its budget (a data point: the floor)
    FAILED = "failed"          # could not be measured at the base shape (e.g. CUDA out of memory)


# NOTE [overhead intervals]
# A step-time overhead a report prints is a difference of two noisy medians. The frontier's
# points are timed in interleaved rounds, so each plan's overhead against the control carries
# the 95% bootstrap interval of its p50 difference (the same test as NOTE [resolved
# differences] in pareto.py), as a share of the control's p50. "resolved" means the interval
# excludes zero and the paired rounds agree in sign; an unresolved overhead is printed as
# "within noise", whatever its sign, so a -19% from three noisy rounds never reads as a speed-up.
# Fewer than 3 rounds give no interval, and the report says so. An interval can exclude zero and
# the difference still be unresolved: with n paired rounds all one way the two-sided sign test's
# p-value is 2^(1 - n), under 0.05 only from n = 6 (MIN_SIGN_ROUNDS), so 3 to 5 rounds never pass
# it. Such a difference is not "within noise" (every round went one way) and is not resolved
# either; the report says which of the two it is (``unresolved_why``), so a +31% the rounds agree
# on does not read as noise, nor as a measured cost.

MIN_SIGN_ROUNDS = 6   # fewest paired rounds, all one way, that pass a two-sided 95% sign test


def unresolved_why(low: float, high: float, samples: int) -> str:
    """Why a difference with this 95% interval (any unit) from ``samples`` rounds is not resolved."""
    if math.isnan(low) or math.isnan(high):
        return f"not resolved: {samples} rounds are too few for an interval"
    if low <= 0.0 <= high:
        return "within noise"
    if samples < MIN_SIGN_ROUNDS:
        return (f"not resolved: the interval excludes zero, but {samples} rounds cannot pass the sign test "
                f"(it needs {MIN_SIGN_ROUNDS} all one way)")
    return "not resolved: the interval excludes zero, but the rounds do not agree in sign often enough"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverheadInterval(JsonCodec):
    """A plan's overhead against the control, from interleaved rounds (NOTE [overhead intervals])."""

    pct: float                  # (p50 - control p50) / control p50 * 100
    low_pct: float | None       # 95% CI of that difference, % of the control p50 (None: too few rounds)
    high_pct: float | None
    resolved: bool              # the interval excludes zero (and the rounds agree in sign)
    samples: int                # interleaved rounds behind it

    def describe(self) -> str:
        """``+12.0% (95% CI +8.1% to +15.2%, 9 interleaved steps)``; unresolved: ``..., within noise``
        or ``..., not resolved: ...`` (``unresolved_why``)."""
        if self.low_pct is None or self.high_pct is None:
            return f"{self.pct:+.1f}% ({self.samples} interleaved steps: too few for an interval)"
        noise = "" if self.resolved else ", " + unresolved_why(self.low_pct, self.high_pct, self.samples)
        return (f"{self.pct:+.1f}%{noise} (95% CI {self.low_pct:+.1f}% to {self.high_pct:+.1f}%, "
                f"{self.samples} interleaved steps)")

    def short(self) -> str:
        """For a table cell: ``+12% [+8, +15]``, ``+2% (noise)``, ``+31% (unresolved, n=3)`` (the
        interval excludes zero, the sign test does not pass), ``+2% (n=2)``."""
        if self.low_pct is None or self.high_pct is None:
            return f"{self.pct:+.0f}% (n={self.samples})"
        if not self.resolved:
            if self.low_pct <= 0.0 <= self.high_pct:
                return f"{self.pct:+.0f}% (noise)"
            return f"{self.pct:+.0f}% (unresolved, n={self.samples})"
        return f"{self.pct:+.0f}% [{self.low_pct:+.0f}, {self.high_pct:+.0f}]"


def describe_overhead(pct: float | None, interval: "OverheadInterval | None") -> str:
    """A report's overhead: with its interval when known, else the bare figure marked as one without."""
    if interval is not None:
        return interval.describe()
    return "-" if pct is None else f"{pct:+.1f}% (no interval recorded)"


def short_overhead(pct: float | None, interval: "OverheadInterval | None") -> str:
    if interval is not None:
        return interval.short()
    return "-" if pct is None else f"{pct:+.0f}%"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapacityTry(JsonCodec):
    """One probe of the capacity search: the shape value tried and what happened."""

    value: int                     # value of the capacity key (e.g. batch_size=32)
    # measured whole-step peak; on an abort, the live bytes when it stopped
    peak_bytes: int | None = json_field(absent=None)
    oom: bool = False              # CUDA out of memory, or the CPU tracker saw the limit exceeded
    error: str | None = None       # anything else that stopped this try (the search ends there)

    def fits(self, limit_bytes: int) -> bool:
        return not self.oom and self.error is None and self.peak_bytes is not None and self.peak_bytes <= limit_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapacityResult(JsonCodec):
    """Largest fitting value of the capacity key, with every probe that led to it (NOTE [capacity search])."""

    key: str
    capacity: int                  # largest value that fit (0: not even 1 fits)
    resolved: bool                 # True: capacity + 1 was tried and did not fit, or capacity == max_value
    capped: bool                   # True: the search stopped at max_value, which fit
    limit_bytes: int               # the peak each try had to stay under
    tries: tuple[CapacityTry, ...]
    note: str = ""                 # why the search stopped early, if it did

    def inside_reserve(self, budget_bytes: int) -> int | None:
        """The largest value tried that measured under the budget itself but inside its reserve (over
        ``limit_bytes``), when it is larger than the capacity: what the reserve costs (NOTE [capacity search])."""
        over = [t.value for t in self.tries if not t.oom and t.error is None and t.peak_bytes is not None
                and self.limit_bytes < t.peak_bytes <= budget_bytes and t.value > self.capacity]
        return max(over, default=None)


@dataclasses.dataclass(kw_only=True)
class FrontierPoint(JsonCodec):
    """One plan measured on the workload at the base shape, plus its capacity under the budget.

    Its times are read as the JSON holds them (``FloatAsWritten``: a receipt read and written
    again keeps its bytes)."""

    plan: str                                  # label: "none", "uniform:2", "optimal@50%", ...
    # the planner spec the plan came from, typed; its JSON is the spec's text (NOTE [planner specs])
    planner: PlannerText
    plan_budget_bytes: int | None = None       # budget the planner was given (optimal/greedy)
    predicted_peak_bytes: int | None = None    # the cost model's figure (None: infeasible)
    predicted_overhead_ms: FloatAsWritten | None = None  # the cost model's added time (sum of boundary replay ms)
    predicted_step_ms: FloatAsWritten | None = None     # the control's p50 in this run + predicted_overhead_ms
    boundaries: list[str] = dataclasses.field(default_factory=list)  # "h.0:full", "blocks.3:selective"
    peak_bytes: int | None = None              # measured whole-step peak at the base shape
    memory_source: MemorySource | None = None  # the instrument of peak_bytes
    num_alloc_retries: int | None = None       # CUDA only: retries in the measured steps
    p50_ms: FloatAsWritten | None = None                # warm whole-step median (interleaved round-robin)
    p95_ms: FloatAsWritten | None = None
    step_ms: list[FloatAsWritten] = dataclasses.field(default_factory=list)   # the warm samples, in round order
    overhead_pct: FloatAsWritten | None = None          # (p50 - control p50) / control p50 * 100
    overhead_interval: OverheadInterval | None = None  # its CI from the interleaved rounds (NOTE [overhead intervals])
    capacity: int | None = None                # largest capacity-key value that fits (None: not searched)
    capacity_search: CapacityResult | None = None
    capacity_p50_ms: FloatAsWritten | None = None       # warm step median at the capacity shape
    samples_per_s: FloatAsWritten | None = None         # batch_size at capacity / capacity p50
    fits: bool = False                         # measured peak <= budget x (1 - reserve)
    pareto: bool = False                       # on the Pareto set of (peak, p50) among measured points
    decision: Decision = Decision.REJECT
    reason: str = ""
    compile: dict[str, Any] | None = None      # CompileSpec JSON: this point ran compiled (NOTE [compiled arms])
    compile_s: FloatAsWritten | None = None             # compiled: first step's wall time less a warm step's (s)

    def __post_init__(self) -> None:
        self.planner = PlannerSpec.parse(self.planner)   # its text still reads: FrontierPoint(planner="optimal")

    @property
    def measured(self) -> bool:
        return self.peak_bytes is not None and self.p50_ms is not None

    @property
    def step_prediction_ratio(self) -> float | None:
        """predicted / measured p50 (goal: within 0.9-1.1); None when either is missing."""
        if self.predicted_step_ms is None or not self.p50_ms:
            return None
        return self.predicted_step_ms / self.p50_ms

    def capacity_text(self, budget_bytes: int, key: str = "") -> str:
        """The capacity as a table shows it: ``batch_size=12`` (``+``: not resolved), and what the reserve
        costs when a larger value measured under the budget itself (NOTE [capacity search])."""
        if self.capacity is None:
            return "-"
        search = self.capacity_search
        text = f"{key + '=' if key else ''}{self.capacity}" + ("" if search is None or search.resolved else "+")
        inside = None if search is None else search.inside_reserve(budget_bytes)
        return text if inside is None else f"{text} ({inside} inside the reserve)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetTry(JsonCodec):
    """One try of the search for torch's ``activation_memory_budget`` aimed at a peak (NOTE [budget aimed at a peak])."""

    ratio: float                   # activation_memory_budget tried, in [0, 1]
    peak_bytes: int | None         # measured whole-step peak of the compiled step (None: it failed)
    fits: bool                     # peak <= budget x (1 - reserve)
    compile_s: FloatAsWritten | None = None  # recompile cost of this ratio (s)
    error: str | None = None


@dataclasses.dataclass(kw_only=True)
class FrontierReport(JsonCodec, reading=Reading(
        # its schema is the receipt's (FRONTIER in remat/receipt/schema.py), checked where a frontier is read
        error=RematError, what="frontier", version=FRONTIER_SCHEMA_VERSION, schema=False,
        wrap=(KeyError, TypeError, ValueError))):
    """Every plan's point, the budget they were judged against, and where they were measured;
    ``from_json`` checks the version first (NOTE [checked reading] in remat/_codec.py)."""

    schema_version: int = FRONTIER_SCHEMA_VERSION
    context: dict[str, Any]                    # workload, shape, device, versions, host, date, settings
    budget_bytes: int
    reserve: float = json_field(then=("effective_budget_bytes",))   # the JSON adds the budget less the reserve
    capacity_key: str
    # label of the unmodified step (overheads are against it); the JSON adds the shipped point's label
    control: str = json_field(default="none", then=(("shipped", "shipped_label"),))
    points: list[FrontierPoint]
    shipped_plan: Plan | None = None           # the shipped point's plan (for receipts / remat.apply)
    # --compile: torch's budget aimed at the peak; left out of the JSON when empty
    budget_search: list[BudgetTry] = json_field(default_factory=list, omit=[])
    # In-process only (not in the JSON, which keeps the shipped plan): the Plan each measured point
    # ran, by label, so a caller can verify or apply a point that did not ship.
    plans: dict[str, Plan] = json_field(default_factory=dict, repr=False, compare=False, skip=True)

    @property
    def effective_budget_bytes(self) -> int:
        return int(self.budget_bytes * (1.0 - self.reserve))

    @property
    def shipped(self) -> FrontierPoint | None:
        return next((p for p in self.points if p.decision is Decision.SHIP), None)

    @property
    def shipped_label(self) -> str | None:
        """The shipped point's label (None: nothing shipped)."""
        shipped = self.shipped
        return None if shipped is None else shipped.plan

    def point(self, label: str) -> FrontierPoint:
        for p in self.points:
            if p.plan == label:
                return p
        raise KeyError(label)
