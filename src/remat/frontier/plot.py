"""``frontier.png``: peak vs warm p50 per plan, the budget line, the Pareto set highlighted.

The figure is drawn on an explicit Agg canvas (no display, and no ``matplotlib.use``: a
library must not switch the user's global backend) and rendered to PNG bytes so the
caller can write it atomically.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from ..units import MIB
from .model import Decision, FrontierPoint, FrontierReport

if TYPE_CHECKING:
    from matplotlib.axes import Axes



def render_frontier_png(report: FrontierReport, *, title: str | None = None) -> bytes:
    """The frontier plot as PNG bytes (x: warm p50 ms, y: measured peak MiB)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # the OO API: no pyplot, no global backend switch

    fig = Figure(figsize=(8, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    pts = [p for p in report.points if p.measured]
    for p in pts:
        _draw_point(ax, p)
    _draw_pareto_set(ax, pts)
    _draw_budget(ax, report)
    _label(ax, report, pts, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _draw_point(ax: Axes, p: FrontierPoint) -> None:
    """One measured point: a star when shipped, blue and outlined on the Pareto set; a p50..p95 whisker."""
    x, y = p.p50_ms, p.peak_bytes / MIB  # type: ignore[operator]
    shipped = p.decision is Decision.SHIP
    ax.scatter([x], [y], s=140 if shipped else 50, marker="*" if shipped else "o", zorder=3,
               color="tab:green" if shipped else ("tab:blue" if p.pareto else "0.6"),
               edgecolors="black" if p.pareto else "none", linewidths=0.8)
    if p.p95_ms is not None and p.p95_ms > x:
        ax.plot([x, p.p95_ms], [y, y], color="0.75", linewidth=1, zorder=1)  # p50..p95 whisker
    ax.annotate(p.plan + (" (ship)" if shipped else ""), (x, y), textcoords="offset points", xytext=(6, 4),
                fontsize=8, color="black" if p.pareto else "0.4")


def _draw_pareto_set(ax: Axes, pts: list[FrontierPoint]) -> None:
    front = sorted((p for p in pts if p.pareto), key=lambda p: (p.p50_ms, p.peak_bytes))
    if len(front) > 1:
        ax.step([p.p50_ms for p in front], [p.peak_bytes / MIB for p in front], where="post",  # type: ignore[operator]
                color="tab:blue", linewidth=1.2, alpha=0.7, zorder=2, label="Pareto set")


def _draw_budget(ax: Axes, report: FrontierReport) -> None:
    """The budget line, and the effective budget (less the reserve) dashed."""
    ax.axhline(report.budget_bytes / MIB, color="tab:red", linestyle="-", linewidth=1,
               label=f"budget {report.budget_bytes / MIB:.1f} MiB")
    if report.reserve > 0:
        ax.axhline(report.effective_budget_bytes / MIB, color="tab:red", linestyle="--", linewidth=1,
                   label=f"less {report.reserve:.0%} reserve")


def _label(ax: Axes, report: FrontierReport, pts: list[FrontierPoint], title: str | None) -> None:
    """Axis labels, title, legend, and the plans that are not on the plot (not measured)."""
    infeasible = [p.plan for p in report.points if not p.measured]
    if infeasible:
        ax.text(0.01, 0.01, "not on the plot: " + ", ".join(infeasible), transform=ax.transAxes, fontsize=7,
                color="0.4", va="bottom")
    ax.set_xlabel("warm step time p50 (ms; whisker to p95)")
    ax.set_ylabel(f"measured step peak (MiB, {pts[0].memory_source if pts else '?'})")
    ctx = report.context
    ax.set_title(title or f"remat frontier: {ctx.get('workload', '?')} {ctx.get('shape') or '(default shape)'}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
