"""The Pareto set of (peak, p50) and the ship decision. Pure: no torch, unit-testable on made-up points.

NOTE [ship decision]
Seed 000 asks which plan to ship: "the least expensive plan that clears the required
reserve". Here, among the points that were *measured* (planned, applied, timed):
- a point *fits* when its measured peak <= int(budget x (1 - reserve)) (bytes);
- the shipped point is the fitting one with the lowest warm p50 (ties: lower peak, then
  the order the plans were given in). The control (no checkpoints) ships when it fits:
  nothing is cheaper than not checkpointing;
- every other measured point is rejected with a reason, first that applies:
  "over budget" (peak over the effective budget; also names a dominating point if any),
  "dominated by X" (X has peak <= and p50 <= with one strictly lower),
  "slower than shipped X" (fits and is Pareto-optimal, but costs more time than X);
- a plan the planner could not make is INFEASIBLE with its floor, one that could not be
  measured is FAILED; neither is on the Pareto set.
The shipped point is always on the Pareto set: a point dominating it would fit (its peak
is no higher) and be no slower, so the tie-break would have picked it.
p50 differences below the timing noise still decide; the JSON keeps every sample
(``step_ms``) and p95 so a reader can judge how close a call was.
"""

from __future__ import annotations

from typing import Sequence

from ..units import mib
from .model import Decision, FrontierPoint




def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` = (peak, p50) dominates ``b``: no worse in both, strictly better in one."""
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


def pareto_flags(xy: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (peak, p50): True when no other pair dominates it (equal pairs are both kept)."""
    return [not any(dominates(q, p) for j, q in enumerate(xy) if j != i) for i, p in enumerate(xy)]


def decide(points: list[FrontierPoint], *, budget_bytes: int, reserve: float,
           control: str | None = "none") -> FrontierPoint | None:
    """Set ``fits``, ``pareto``, ``overhead_pct``, ``decision`` and ``reason`` on every point (in place).

    Returns the shipped point, or None when no measured point fits. Points that are not
    measured keep their INFEASIBLE/FAILED decision (their reason is left as given).
    See NOTE [ship decision].
    """
    limit = int(budget_bytes * (1.0 - reserve))
    measured = [p for p in points if p.measured]
    ctrl = next((p for p in measured if p.plan == control), None)
    for p in points:
        p.fits = False
        p.pareto = False
        if ctrl is not None and p.p50_ms is not None and ctrl.p50_ms:
            p.overhead_pct = (p.p50_ms - ctrl.p50_ms) / ctrl.p50_ms * 100.0
    xy = [(float(p.peak_bytes), float(p.p50_ms)) for p in measured]  # type: ignore[arg-type]
    for p, flag in zip(measured, pareto_flags(xy)):
        p.pareto = flag
        p.fits = p.peak_bytes <= limit  # type: ignore[operator]
    fitting = [p for p in measured if p.fits]
    order = {id(p): i for i, p in enumerate(points)}
    shipped = min(fitting, key=lambda p: (p.p50_ms, p.peak_bytes, order[id(p)]), default=None)

    def dominator(p: FrontierPoint) -> FrontierPoint | None:
        doms = [q for q in measured if q is not p and dominates((q.peak_bytes, q.p50_ms), (p.peak_bytes, p.p50_ms))]
        if shipped is not None and shipped in doms:
            return shipped
        return min(doms, key=lambda q: (q.p50_ms, q.peak_bytes, order[id(q)]), default=None)

    for p in measured:
        if p is shipped:
            p.decision = Decision.SHIP
            vs = f", {p.overhead_pct:+.1f}% vs control" if p.overhead_pct is not None and p is not ctrl else ""
            p.reason = (f"lowest p50 ({p.p50_ms:.2f} ms{vs}) among plans whose measured peak clears "
                        f"{mib(limit)} (budget {mib(budget_bytes)} less {reserve:.0%} reserve)")
            continue
        p.decision = Decision.REJECT
        dom = dominator(p)
        if not p.fits:
            p.reason = f"over budget: peak {mib(p.peak_bytes)} > {mib(limit)}"  # type: ignore[arg-type]
            if dom is not None:
                p.reason += f"; also dominated by {dom.plan}"
        elif dom is not None:
            p.reason = (f"dominated by {dom.plan} (peak {mib(dom.peak_bytes)} <= {mib(p.peak_bytes)}, "  # type: ignore[arg-type]
                        f"p50 {dom.p50_ms:.2f} <= {p.p50_ms:.2f} ms)")
        else:
            assert shipped is not None  # p fits, so something ships
            slower = (p.p50_ms - shipped.p50_ms) / shipped.p50_ms * 100.0 if shipped.p50_ms else 0.0  # type: ignore[operator]
            p.reason = (f"slower than shipped {shipped.plan}: p50 {p.p50_ms:.2f} ms vs {shipped.p50_ms:.2f} ms "
                        f"({slower:+.1f}%), for a lower peak than it needs")
    return shipped
