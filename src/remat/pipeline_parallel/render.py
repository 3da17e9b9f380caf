"""A pipeline receipt's ``report.html`` and ``report.md`` (NOTE [pipeline receipt]), from the receipt alone.

The HTML draws each side's last timed step as an inline SVG (no JavaScript, no network, no
plotting library): one lane per stage, a rectangle per recorded interval, coloured by kind,
replay drawn over the backward it runs in, p2p waits as a thin bar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..receipt.write import ReceiptFiles, write_folder
from ..units import mib
from .markdown import _formula, render_pipeline_markdown
from .receipt import PipelineReceipt
from ..receipt.render import _CSS, _html_table, e

# kind -> (colour, lane height share); drawn in this order, so replay lies over backward
_KINDS = (("forward", "#54aeff", 1.0), ("loss", "#bf8700", 1.0), ("backward", "#4ac26b", 1.0),
          ("replay", "#cf222e", 0.6), ("optimizer", "#8250df", 1.0), ("p2p", "#8c959f", 0.25))
LANE_PX = 26
WIDTH_PX = 960
LABEL_PX = 70


def _kind(name: str) -> str:
    return "p2p" if name.startswith("p2p:") else name


def timeline_svg(side: dict[str, Any], *, t_max_ms: float | None = None) -> str:
    """One side's per-stage timeline (ms from the earliest recorded interval), as an ``<svg>`` element."""
    events = [ev for s in side["per_stage"] for ev in s["timeline"]]
    if not events:
        return '<p class="muted">no intervals recorded</p>'
    t0 = min(ev[2] for ev in events)
    span = max(t_max_ms if t_max_ms is not None else max(ev[3] for ev in events) - t0, 1e-9)
    plot = WIDTH_PX - LABEL_PX - 10
    height = LANE_PX * len(side["per_stage"]) + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{height}" '
             f'font-family="sans-serif" font-size="11">']
    for lane, s in enumerate(side["per_stage"]):
        y = lane * LANE_PX + 2
        parts.append(f'<text x="2" y="{y + LANE_PX * 0.6:.1f}">stage {int(s["stage"])}</text>')
        parts.append(f'<rect x="{LABEL_PX}" y="{y}" width="{plot}" height="{LANE_PX - 4}" fill="#f6f8fa"/>')
        for kind, colour, share in _KINDS:
            for ev in s["timeline"]:
                if _kind(ev[0]) != kind:
                    continue
                x = LABEL_PX + (ev[2] - t0) / span * plot
                w = max(0.5, (ev[3] - ev[2]) / span * plot)
                h = (LANE_PX - 4) * share
                title = f"{ev[0]} mb {ev[1]}: {ev[2] - t0:.1f}-{ev[3] - t0:.1f} ms" if ev[1] >= 0 else \
                    f"{ev[0]}: {ev[2] - t0:.1f}-{ev[3] - t0:.1f} ms"
                parts.append(f'<rect x="{x:.1f}" y="{y + (LANE_PX - 4 - h):.1f}" width="{w:.1f}" height="{h:.1f}" '
                             f'fill="{colour}"><title>{e(title)}</title></rect>')
    axis_y = LANE_PX * len(side["per_stage"]) + 16
    parts.append(f'<text x="{LABEL_PX}" y="{axis_y}">0 ms</text>'
                 f'<text x="{WIDTH_PX - 10}" y="{axis_y}" text-anchor="end">{span:.0f} ms</text></svg>')
    return "".join(parts)


def _legend() -> str:
    return "<p>" + " ".join(f'<span style="display:inline-block;width:12px;height:12px;background:{c}"></span> {e(k)}'
                            for k, c, _ in _KINDS) + ' <span class="muted">(blank: idle)</span></p>'


def _stage_rows(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, side in d["sides"].items():
        for s in side["per_stage"]:
            rows.append([name, str(s["stage"]), str(s["in_flight"]), ", ".join(s["boundaries"]) or "-",
                         mib(s["peak_bytes"]),
                         "-" if s["predicted_peak_bytes"] is None else mib(s["predicted_peak_bytes"]),
                         "-" if s["fits_budget"] is None else ("yes" if s["fits_budget"] else "NO"),
                         f"{s['forward_ms']:.1f}", f"{s['backward_ms']:.1f}", f"{s['replay_ms']:.1f}",
                         f"{s['p2p_ms']:.1f}", f"{s['exposed_p2p_ms']:.1f}", f"{s['idle_ms']:.1f}",
                         f"{s['bubble_fraction']:.3f}",
                         "-" if s["bubble_delta_vs_none"] is None else f"{s['bubble_delta_vs_none']:+.3f}"])
    return rows


STAGE_HEADERS = ["side", "stage", "in flight", "boundaries", "peak", "predicted", "fits", "fwd ms", "bwd ms",
                 "replay ms", "p2p ms", "exposed p2p ms", "idle ms", "bubble", "vs none"]


def _headline(r: PipelineReceipt) -> str:
    d = r.pipeline.data
    if r.holds:
        return (f"HOLDS: remat's per-stage plans fit {mib(d['budget_bytes'])} per device and train bitwise like the "
                f"unplanned pipeline")
    return "DOES NOT HOLD: " + "; ".join(r.why_not)


def render_pipeline_html(r: PipelineReceipt) -> str:
    d = r.pipeline.data
    c = r.context
    title = f"remat pipeline receipt: {d['spec']} on {d['world_size']} stages, {d['schedule']}, {d['microbatches']} microbatches"
    parts = [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
             f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>"
             f'<p class="muted">{e(c.created)} · remat {e(c.remat_version)} · {e(d["backend"])} · {e(c.dtype)} · git '
             f"{e(c.git_revision or 'n/a')} · torch {e(d['torch_version'])}</p>"]
    cls = "ship" if r.holds else "noplan"
    parts.append(f'<div class="verdict {cls}"><h2>{e(_headline(r))}</h2></div>')
    parts.append(_html_table(None, [
        ["split", f"{', '.join(d['split_points'])} ({d['split_source']})"],
        ["batch", f"{d['batch_size']} in {d['microbatches']} microbatches"],
        ["ideal bubble " + _formula(d), f"{d['ideal_bubble_fraction']:.3f}"],
        ["per-device budget", "-" if d["budget_bytes"] is None else mib(d["budget_bytes"])],
        ["memory source", d["memory_source"]], ["command", c.command or "-"]], cls="kv"))
    parts.append("<h2>Per stage</h2>")
    parts.append(_html_table(STAGE_HEADERS, _stage_rows(d)))
    parts.append(_html_table(["side", "step p50 ms", "step p95 ms", "samples/s", "largest stage peak", "largest bubble"],
                             [[n, f"{s['p50_ms']:.1f}", f"{s['p95_ms']:.1f}", f"{s['samples_per_s']:.2f}",
                               mib(s["max_peak_bytes"]), f"{s['max_bubble_fraction']:.3f}"]
                              for n, s in d["sides"].items()]))
    parts.append("<h2>Per-stage timelines (last timed step)</h2>" + _legend())
    # one time axis for every side, so a side that replays is visibly longer
    spans = [max(ev[3] for st in s["per_stage"] for ev in st["timeline"])
             - min(ev[2] for st in s["per_stage"] for ev in st["timeline"])
             for s in d["sides"].values() if any(st["timeline"] for st in s["per_stage"])]
    t_max = max(spans) if spans else None
    for name, side in d["sides"].items():
        parts.append(f"<h3>{e(name)}</h3>" + timeline_svg(side, t_max_ms=t_max))
    parts.append("<h2>Equivalence</h2><ul>")
    for name, eq in d["equivalence"].items():
        verdict = '<span class="pass">bitwise equal</span>' if eq["ok"] else '<span class="fail">DIFFERENT</span>'
        parts.append(f"<li>{e(name)} vs none (same schedule and microbatches): {verdict} over "
                     f"{eq['params_compared']} parameters (max |diff| {eq['max_abs_diff']:.3g})"
                     + "".join(f"; {e(m)}" for m in eq["mismatched"][:5]) + "</li>")
    neg = d["negative_control_rejected"]
    if neg is not None:
        verdict = "rejected" if neg else '<span class="fail">ACCEPTED</span>'
        parts.append(f"<li>negative control (a gradient perturbed by 1e-3): {verdict}</li>")
    parts.append("</ul><h2>Boundaries</h2>")
    parts.append(_html_table(["stage", "module", "class", "revision"],
                             [[str(b.stage), b.module, b.class_name, b.revision] for b in r.boundaries])
                 if r.boundaries else '<p class="muted">no boundaries</p>')
    parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in d["notes"]) + "</ul>")
    parts.append(f'<p class="muted">re-check: <code>remat check receipt.json</code> re-runs the unplanned and the '
                 f"planned pipeline ({r.check_steps} timed step(s) each) at world size {d['world_size']}.</p>")
    parts.append("</body></html>")
    return "".join(parts)


def render_pipeline_receipt_markdown(r: PipelineReceipt) -> str:
    d = r.pipeline.data
    head = [f"**{_headline(r)}**", "",
            f"remat {r.context.remat_version}, git {r.context.git_revision or 'n/a'}, {r.context.created}; "
            f"`{r.context.command or '-'}`", ""]
    bounds = ["## Boundaries", "", "| stage | module | class | revision |", "|---|---|---|---|",
              *[f"| {b.stage} | {b.module} | {b.class_name} | {b.revision} |" for b in r.boundaries], ""]
    return "\n".join(head) + render_pipeline_markdown(d) + "\n" + "\n".join(bounds)


def write_pipeline_receipt(receipt: PipelineReceipt, out_dir: Path | str) -> ReceiptFiles:
    """A :class:`PipelineReceipt`'s folder (NOTE [pipeline receipt]), written as ``write_receipt`` writes one."""
    data = (json.dumps(receipt.to_json(), indent=1, allow_nan=False) + "\n").encode("utf-8")
    PipelineReceipt.from_json(json.loads(data))   # never publish a receipt `remat check` would refuse
    return write_folder(out_dir, data, lambda: render_pipeline_html(receipt),
                        lambda: render_pipeline_receipt_markdown(receipt))
