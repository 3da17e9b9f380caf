"""A pipeline receipt's ``report.html`` and ``report.md`` (NOTE [pipeline receipt]), from the receipt alone.

The HTML draws each side's last timed step as an inline SVG (no JavaScript, no network, no
plotting library): one lane per stage, a rectangle per recorded interval, coloured by kind,
replay drawn over the backward it runs in, p2p waits as a thin bar.
"""

from __future__ import annotations

import json
from pathlib import Path
from .write import ReceiptFiles, write_folder
from ..units import mib
from .pipeline_markdown import (SIDE_HEADERS, STAGE_HEADERS, _formula, equivalence_text, render_pipeline_markdown, side_cells,
                       stage_cells)
from .pipeline import PipelineReceipt
from ..distributed.pipeline.report import PipelineReport, SideReport, StageReport
from .render import _CSS, _html_table, e

# kind -> (colour, lane height share); drawn in this order, so replay lies over backward
_KINDS = (("forward", "#54aeff", 1.0), ("loss", "#bf8700", 1.0), ("backward", "#4ac26b", 1.0),
          ("replay", "#cf222e", 0.6), ("optimizer", "#8250df", 1.0), ("p2p", "#8c959f", 0.25))
LANE_PX = 26
WIDTH_PX = 960
LABEL_PX = 70


def _lane(lane: int, s: StageReport, t0: float, span: float) -> list[str]:
    """One stage's lane of the timeline: its label, background, and a rectangle per interval, by kind."""
    plot = WIDTH_PX - LABEL_PX - 10
    y = lane * LANE_PX + 2
    parts = [f'<text x="2" y="{y + LANE_PX * 0.6:.1f}">stage {int(s.stage)}</text>',
             f'<rect x="{LABEL_PX}" y="{y}" width="{plot}" height="{LANE_PX - 4}" fill="#f6f8fa"/>']
    for kind, colour, share in _KINDS:
        for ev in s.timeline:
            if ev.category != kind:
                continue
            x = LABEL_PX + (ev.start_ms - t0) / span * plot
            w = max(0.5, (ev.end_ms - ev.start_ms) / span * plot)
            h = (LANE_PX - 4) * share
            what = f"{ev.kind} mb {ev.mb}" if ev.mb >= 0 else ev.kind
            title = f"{what}: {ev.start_ms - t0:.1f}-{ev.end_ms - t0:.1f} ms"
            parts.append(f'<rect x="{x:.1f}" y="{y + (LANE_PX - 4 - h):.1f}" width="{w:.1f}" height="{h:.1f}" '
                         f'fill="{colour}"><title>{e(title)}</title></rect>')
    return parts


def timeline_svg(side: SideReport, *, t_max_ms: float | None = None) -> str:
    """One side's per-stage timeline (ms from the earliest recorded interval), as an ``<svg>`` element."""
    own_span = side.timeline_span_ms
    if own_span is None:
        return '<p class="muted">no intervals recorded</p>'
    t0 = min(ev.start_ms for s in side.per_stage for ev in s.timeline)
    span = max(t_max_ms if t_max_ms is not None else own_span, 1e-9)
    height = LANE_PX * len(side.per_stage) + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{height}" '
             f'font-family="sans-serif" font-size="11">']
    for lane, s in enumerate(side.per_stage):
        parts += _lane(lane, s, t0, span)
    axis_y = LANE_PX * len(side.per_stage) + 16
    parts.append(f'<text x="{LABEL_PX}" y="{axis_y}">0 ms</text>'
                 f'<text x="{WIDTH_PX - 10}" y="{axis_y}" text-anchor="end">{span:.0f} ms</text></svg>')
    return "".join(parts)


def _legend() -> str:
    return "<p>" + " ".join(f'<span style="display:inline-block;width:12px;height:12px;background:{c}"></span> {e(k)}'
                            for k, c, _ in _KINDS) + ' <span class="muted">(blank: idle)</span></p>'


def _headline(r: PipelineReceipt) -> str:
    if r.holds:
        return (f"HOLDS: remat's per-stage plans fit {mib(r.pipeline.budget_bytes)} per device and train bitwise "
                f"like the unplanned pipeline")
    return "DOES NOT HOLD: " + "; ".join(r.why_not)


def _head(r: PipelineReceipt) -> list[str]:
    """The page's head, title, provenance line and verdict."""
    p, c = r.pipeline, r.context
    title = (f"remat pipeline receipt: {p.spec} on {p.world_size} stages, {p.schedule.value}, {p.microbatches} "
             f"microbatches")
    return [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>"
            f'<p class="muted">{e(c.created)} · remat {e(c.remat_version)} · {e(p.backend)} · {e(c.dtype)} · git '
            f"{e(c.git_revision or 'n/a')} · torch {e(p.torch_version)}</p>",
            f'<div class="verdict {"ship" if r.holds else "noplan"}"><h2>{e(_headline(r))}</h2></div>']


def _settings(r: PipelineReceipt) -> str:
    p = r.pipeline
    return _html_table(None, [
        ["split", f"{', '.join(p.split_points)} ({p.split_source})"],
        ["batch", f"{p.batch_size} in {p.microbatches} microbatches"],
        ["ideal bubble " + _formula(p), f"{p.ideal_bubble_fraction:.3f}"],
        ["per-device budget", "-" if p.budget_bytes is None else mib(p.budget_bytes)],
        ["memory source", p.memory_source], ["command", r.context.command or "-"]], cls="kv")


def _figures(p: PipelineReport) -> list[str]:
    """The per-stage and per-side tables, and every side's timeline on one time axis (a side that replays is
    visibly longer)."""
    parts = ["<h2>Per stage</h2>",
             _html_table(STAGE_HEADERS, [stage_cells(name, s, no="NO") for name, side in p.sides.items()
                                         for s in side.per_stage]),
             _html_table(SIDE_HEADERS, [side_cells(name, side) for name, side in p.sides.items()]),
             "<h2>Per-stage timelines (last timed step)</h2>" + _legend()]
    t_max = p.timeline_span_ms
    parts += [f"<h3>{e(name.value)}</h3>" + timeline_svg(side, t_max_ms=t_max) for name, side in p.sides.items()]
    return parts


def _equivalence(p: PipelineReport) -> list[str]:
    parts = ["<h2>Equivalence</h2><ul>"]
    for name, eq in p.equivalence.items():
        verdict = '<span class="pass">bitwise equal</span>' if eq.ok else '<span class="fail">DIFFERENT</span>'
        parts.append(f"<li>{equivalence_text(name, eq, verdict, escape=e)}</li>")
    neg = p.negative_control_rejected
    if neg is not None:
        verdict = "rejected" if neg else '<span class="fail">ACCEPTED</span>'
        parts.append(f"<li>negative control (a gradient perturbed by 1e-3): {verdict}</li>")
    return parts + ["</ul>"]


def render_pipeline_html(r: PipelineReceipt) -> str:
    parts = [*_head(r), _settings(r), *_figures(r.pipeline), *_equivalence(r.pipeline), "<h2>Boundaries</h2>"]
    parts.append(_html_table(["stage", "module", "class", "revision"],
                             [[str(b.stage), b.module, b.class_name, b.revision] for b in r.boundaries])
                 if r.boundaries else '<p class="muted">no boundaries</p>')
    parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in r.pipeline.notes) + "</ul>")
    parts.append(f'<p class="muted">re-check: <code>remat check receipt.json</code> re-runs the unplanned and the '
                 f"planned pipeline ({r.check_steps} timed step(s) each) at world size {r.pipeline.world_size}.</p>")
    parts.append("</body></html>")
    return "".join(parts)


def render_pipeline_receipt_markdown(r: PipelineReceipt) -> str:
    head = [f"**{_headline(r)}**", "",
            f"remat {r.context.remat_version}, git {r.context.git_revision or 'n/a'}, {r.context.created}; "
            f"`{r.context.command or '-'}`", ""]
    bounds = ["## Boundaries", "", "| stage | module | class | revision |", "|---|---|---|---|",
              *[f"| {b.stage} | {b.module} | {b.class_name} | {b.revision} |" for b in r.boundaries], ""]
    return "\n".join(head) + render_pipeline_markdown(r.pipeline) + "\n" + "\n".join(bounds)


def write_pipeline_receipt(receipt: PipelineReceipt, out_dir: Path | str) -> ReceiptFiles:
    """A :class:`PipelineReceipt`'s folder (NOTE [pipeline receipt]), written as ``write_receipt`` writes one."""
    data = (json.dumps(receipt.to_json(), indent=1, allow_nan=False) + "\n").encode("utf-8")
    # never publish a receipt `remat check` would refuse; render what it loads, as check does (NOTE [reports
    # checked against the receipt] in remat/workflow/check.py)
    loaded = PipelineReceipt.from_json(json.loads(data))
    return write_folder(out_dir, data, lambda: render_pipeline_html(loaded),
                        lambda: render_pipeline_receipt_markdown(loaded))
