"""``pipeline.md``: a pipeline run's per-stage table and timeline, rendered from ``pipeline.json`` alone.

The table cells (:func:`stage_cells`, :func:`side_cells`) and the equivalence line are shared with
a pipeline run's ``report.html`` (remat/receipt/render.py), so both say the same thing in the same words.
"""

from __future__ import annotations

from typing import Callable

from ..units import mib as format_bytes   # one unit (MiB) for figures read side by side
from ..plan.pipeline import Side
from ..distributed.pipeline.report import PipelineEquivalence, PipelineReport, SideReport, StageReport

# timeline letters, most specific first: a replay runs inside a backward
_LETTERS = (("replay", "R"), ("backward", "B"), ("forward", "F"), ("loss", "L"), ("optimizer", "O"))
WIDTH = 96   # characters of one stage's timeline row

STAGE_HEADERS = ["side", "stage", "in flight", "boundaries", "peak", "predicted", "fits", "fwd ms", "bwd ms",
                 "replay ms", "p2p ms", "exposed p2p ms", "idle ms", "bubble", "vs none"]
SIDE_HEADERS = ["side", "step p50 ms", "step p95 ms", "samples/s", "largest stage peak", "largest bubble"]


def timeline_rows(side: SideReport, width: int = WIDTH) -> list[str]:
    """One text row per stage over the side's last timed step: F forward, L loss, B backward, R replay inside
    backward, O optimizer, ``-`` blocked in p2p, ``.`` idle; every column is ``end / width`` ms."""
    events = [e for s in side.per_stage for e in s.timeline]
    if not events:
        return []
    t0 = min(e.start_ms for e in events)
    span = max(max(e.end_ms for e in events) - t0, 1e-9)
    rows = []
    for s in side.per_stage:
        cells = ["."] * width
        for kind, letter in (("p2p", "-"),) + tuple(reversed(_LETTERS)):
            for e in s.timeline:
                if e.category != kind:
                    continue
                a = int((e.start_ms - t0) / span * width)
                b = max(a + 1, int((e.end_ms - t0) / span * width))
                for i in range(max(0, a), min(width, b)):
                    cells[i] = letter
        rows.append(f"stage {s.stage} |{''.join(cells)}|")
    rows.append(f"        0 ms{' ' * (width - 10)}{span:.0f} ms")
    return rows


def _formula(report: PipelineReport) -> str:
    """The schedule's ideal bubble formula, as the report's figure was computed (plan/pipeline.ideal_bubble)."""
    return "(p - 1) / (m + p - 1)" if report.stages_per_rank == 1 else \
        f"(p - 1) / (v m + p - 1) with v = {report.stages_per_rank} stages per rank"


def stage_cells(side: Side, s: StageReport, *, no: str) -> list[str]:
    """One row of the per-stage table (``STAGE_HEADERS``); ``no``: how a stage over the budget is marked."""
    return [side.value, str(s.stage), str(s.in_flight), ", ".join(s.boundaries) or "-", format_bytes(s.peak_bytes),
            "-" if s.predicted_peak_bytes is None else format_bytes(s.predicted_peak_bytes),
            "-" if s.fits_budget is None else ("yes" if s.fits_budget else no),
            f"{s.forward_ms:.1f}", f"{s.backward_ms:.1f}", f"{s.replay_ms:.1f}", f"{s.p2p_ms:.1f}",
            f"{s.exposed_p2p_ms:.1f}", f"{s.idle_ms:.1f}", f"{s.bubble_fraction:.3f}",
            "-" if s.bubble_delta_vs_none is None else f"{s.bubble_delta_vs_none:+.3f}"]


def side_cells(side: Side, r: SideReport) -> list[str]:
    """One row of the per-side table (``SIDE_HEADERS``)."""
    return [side.value, f"{r.p50_ms:.1f}", f"{r.p95_ms:.1f}", f"{r.samples_per_s:.2f}",
            format_bytes(r.max_peak_bytes), f"{r.max_bubble_fraction:.3f}"]


def equivalence_text(side: Side, eq: PipelineEquivalence, verdict: str,
                     escape: Callable[[str], str] = str) -> str:
    """``side`` against the unplanned pipeline, with up to five mismatches (``escape``d for HTML)."""
    return (f"{escape(side.value)} vs none (same schedule and microbatches): {verdict} over {eq.params_compared} "
            f"parameters (max |diff| {eq.max_abs_diff:.3g})" + "".join(f"; {escape(m)}" for m in eq.mismatched[:5]))


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *["| " + " | ".join(r) + " |" for r in rows]]


def _intro(report: PipelineReport) -> list[str]:
    v, p = report.stages_per_rank, report.world_size
    where = f"{p} stages" if v == 1 else f"{p} ranks x {v} stages (a row is a rank)"
    budget = "" if report.budget_bytes is None else f" Per-device budget {format_bytes(report.budget_bytes)}."
    return [f"# Pipeline: {report.spec} on {where} ({report.backend})", "",
            f"Schedule {report.schedule.value}, {report.microbatches} microbatches of batch {report.batch_size}, "
            f"split at {', '.join(report.split_points)} ({report.split_source}). Ideal bubble {_formula(report)} = "
            f"{report.ideal_bubble_fraction:.3f}." + budget, ""]


def _equivalence_lines(report: PipelineReport) -> list[str]:
    out = ["", "## Equivalence", ""]
    out += [f"- {equivalence_text(name, eq, 'bitwise equal' if eq.ok else 'DIFFERENT')}"
            for name, eq in report.equivalence.items()]
    neg = report.negative_control_rejected
    if neg is not None:
        out.append(f"- negative control (a gradient perturbed by 1e-3): {'rejected' if neg else 'ACCEPTED'}")
    return out


def render_pipeline_markdown(report: PipelineReport) -> str:
    out = _intro(report)
    out += _table(STAGE_HEADERS, [stage_cells(name, s, no="**no**") for name, side in report.sides.items()
                                  for s in side.per_stage])
    out += [""] + _table(SIDE_HEADERS, [side_cells(name, side) for name, side in report.sides.items()])
    out += _equivalence_lines(report)
    out += ["", "## Timelines (last timed step)", "",
            "F forward, L loss, B backward, R replay (inside backward), O optimizer, - blocked in p2p, . idle", ""]
    for name, side in report.sides.items():
        out += [f"{name.value}:", "", "```", *timeline_rows(side), "```", ""]
    out += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(out)
