"""``pipeline.md``: a pipeline run's per-stage table and timeline, rendered from ``pipeline.json`` alone."""

from __future__ import annotations

from typing import Any

from ..units import mib as format_bytes   # one unit (MiB) for figures read side by side

# timeline letters, most specific first: a replay runs inside a backward
_LETTERS = (("replay", "R"), ("backward", "B"), ("forward", "F"), ("loss", "L"), ("optimizer", "O"))
WIDTH = 96   # characters of one stage's timeline row


def timeline_rows(side: dict[str, Any], width: int = WIDTH) -> list[str]:
    """One text row per stage over the side's last timed step: F forward, L loss, B backward, R replay inside
    backward, O optimizer, ``-`` blocked in p2p, ``.`` idle; every column is ``end / width`` ms."""
    events = [e for s in side["per_stage"] for e in s["timeline"]]
    if not events:
        return []
    t0 = min(e[2] for e in events)
    t1 = max(e[3] for e in events)
    span = max(t1 - t0, 1e-9)
    rows = []
    for s in side["per_stage"]:
        cells = ["."] * width
        for kind, letter in (("p2p", "-"),) + tuple(reversed(_LETTERS)):
            for e in s["timeline"]:
                if not (e[0] == kind or (kind == "p2p" and e[0].startswith("p2p:"))):
                    continue
                a = int((e[2] - t0) / span * width)
                b = max(a + 1, int((e[3] - t0) / span * width))
                for i in range(max(0, a), min(width, b)):
                    cells[i] = letter
        rows.append(f"stage {s['stage']} |{''.join(cells)}|")
    rows.append(f"        0 ms{' ' * (width - 10)}{span:.0f} ms")
    return rows


def _formula(d: dict[str, Any]) -> str:
    """The schedule's ideal bubble formula, as the report's figure was computed (plan/pipeline.ideal_bubble)."""
    return "(p - 1) / (m + p - 1)" if d.get("stages_per_rank", 1) == 1 else \
        f"(p - 1) / (v m + p - 1) with v = {d['stages_per_rank']} stages per rank"


def render_pipeline_markdown(d: dict[str, Any]) -> str:
    v = d.get("stages_per_rank", 1)
    where = f"{d['world_size']} stages" if v == 1 else f"{d['world_size']} ranks x {v} stages (a row is a rank)"
    out = [f"# Pipeline: {d['spec']} on {where} ({d['backend']})", "",
           f"Schedule {d['schedule']}, {d['microbatches']} microbatches of batch {d['batch_size']}, split at "
           f"{', '.join(d['split_points'])} ({d['split_source']}). Ideal bubble " + _formula(d) + " = "
           f"{d['ideal_bubble_fraction']:.3f}."
           + ("" if d["budget_bytes"] is None else f" Per-device budget {format_bytes(d['budget_bytes'])}."), ""]
    out += ["| side | stage | in flight | boundaries | peak | predicted | fits | fwd ms | bwd ms | replay ms | "
            "p2p ms | exposed p2p ms | idle ms | bubble | vs none |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, side in d["sides"].items():
        for s in side["per_stage"]:
            pred = "-" if s["predicted_peak_bytes"] is None else format_bytes(s["predicted_peak_bytes"])
            fits = "-" if s["fits_budget"] is None else ("yes" if s["fits_budget"] else "**no**")
            delta = "-" if s["bubble_delta_vs_none"] is None else f"{s['bubble_delta_vs_none']:+.3f}"
            out.append(f"| {name} | {s['stage']} | {s['in_flight']} | {', '.join(s['boundaries']) or '-'} | "
                       f"{format_bytes(s['peak_bytes'])} | {pred} | {fits} | {s['forward_ms']:.1f} | "
                       f"{s['backward_ms']:.1f} | {s['replay_ms']:.1f} | {s['p2p_ms']:.1f} | "
                       f"{s['exposed_p2p_ms']:.1f} | {s['idle_ms']:.1f} | {s['bubble_fraction']:.3f} | {delta} |")
    out += ["", "| side | step p50 ms | step p95 ms | samples/s | largest stage peak | largest bubble |",
            "|---|---|---|---|---|---|"]
    for name, side in d["sides"].items():
        out.append(f"| {name} | {side['p50_ms']:.1f} | {side['p95_ms']:.1f} | {side['samples_per_s']:.2f} | "
                   f"{format_bytes(side['max_peak_bytes'])} | {side['max_bubble_fraction']:.3f} |")
    out += ["", "## Equivalence", ""]
    for name, eq in d["equivalence"].items():
        out.append(f"- {name} vs none (same schedule and microbatches): "
                   f"{'bitwise equal' if eq['ok'] else 'DIFFERENT'} over {eq['params_compared']} parameters "
                   f"(max |diff| {eq['max_abs_diff']:.3g})" + "".join(f"; {m}" for m in eq["mismatched"][:5]))
    neg = d["negative_control_rejected"]
    if neg is not None:
        out.append(f"- negative control (a gradient perturbed by 1e-3): {'rejected' if neg else 'ACCEPTED'}")
    out += ["", "## Timelines (last timed step)", "",
            "F forward, L loss, B backward, R replay (inside backward), O optimizer, - blocked in p2p, . idle", ""]
    for name, side in d["sides"].items():
        out += [f"{name}:", "", "```", *timeline_rows(side), "```", ""]
    out += ["## Notes", "", *[f"- {n}" for n in d["notes"]], ""]
    return "\n".join(out)
