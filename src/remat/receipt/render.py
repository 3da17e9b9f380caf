"""Rendering a receipt for people: ``report.html`` (self-contained) and ``report.md`` (pull requests).

Both are functions of the receipt alone (``render_html(receipt)``, ``render_markdown(receipt)``
take a :class:`Receipt` or its JSON): whoever holds ``receipt.json`` can re-render them,
and nothing in them comes from anywhere else. The HTML embeds its plots as base64 PNG,
loads nothing from the network and needs no JavaScript. Every string that comes from the
receipt is escaped (HTML: ``html.escape``; Markdown: table pipes, backticks and angle
brackets), because a receipt is data someone else may have written.

Order, for a reviewer who did not run it: the decision, the frontier plot, the phase
timeline (control vs plan), the boundary table, equivalence, hazards, modes not covered,
then the context. A pipeline run's receipt (NOTE [one receipt] in remat/receipt/model.py) is
rendered here too, from its per-stage report (the last section), as is its ``pipeline.md``.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from typing import Any, Callable, Iterable, Sequence

from ..workload import shape_text
from ..frontier.model import describe_overhead, short_overhead
from ..frontier.plot import render_frontier_png
from ..trace.model import StepTrace
from ..units import MIB, fmt_bytes, mib
from ..verify.model import RunMode, VerifyReport
from ..distributed.report import (DistributedReport, PipelineEquivalence, PipelineFigures, RankFigures, SideReport,
                                  StageFigures)
from .model import Receipt, ShipStatus
from .world_size import PipelineEvidence

PHASE_COLORS = {"batch": "#9e9e9e", "forward": "#1f77b4", "backward": "#d62728", "optimizer": "#2ca02c"}


def _as_receipt(receipt: Receipt | dict[str, Any]) -> Receipt:
    return receipt if isinstance(receipt, Receipt) else Receipt.from_json(receipt)


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f} ms"


def _err(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return "0" if x == 0 else f"{x:.2e}"


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _shape(shape: dict[str, Any] | None) -> str:
    return shape_text(shape, empty="default shape")


# -- plots -----------------------------------------------------------------------------------------

def _phase_spans(trace: StepTrace) -> list[tuple[str, float, float]]:
    """(phase, start, end) as % of the traced step, from the trace's per-phase durations."""
    total = sum(p.duration_ms for p in trace.phases) or 1.0
    spans, t = [], 0.0
    for p in trace.phases:
        spans.append((p.name.value, 100.0 * t / total, 100.0 * (t + p.duration_ms) / total))
        t += p.duration_ms
    return spans


def timeline_png(receipt: Receipt | dict[str, Any]) -> bytes:
    """Live bytes over one step, control vs shipped plan, with the budget and phase strips (PNG bytes).

    x is the share of each step's own traced duration: under the live-tensor tracker absolute
    times are inflated and noisy (the frontier has the real, interleaved step times), while
    the share shows where in the step memory rises, and how the plan's backward grows."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # OO API: no pyplot, no global backend switch
    from matplotlib.patches import Patch

    r = _as_receipt(receipt)
    curves = [("control", "control (no checkpointing)", r.traces.target, "#555555")]
    if r.traces.planned is not None:
        curves.append(("plan", f"plan {r.plan.label or ''}".strip(), r.traces.planned, "#2ca02c"))
    fig = Figure(figsize=(9, 5.0), dpi=100)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 1, height_ratios=[8, 1.2], hspace=0.06)
    ax = fig.add_subplot(gs[0])
    strip = fig.add_subplot(gs[1], sharex=ax)
    for short, label, trace, color in curves:
        total = sum(p.duration_ms for p in trace.phases) or (trace.timeline[-1].t_ms if trace.timeline else 1.0) or 1.0
        xs = [100.0 * p.t_ms / total for p in trace.timeline]
        ys = [p.live_bytes / MIB for p in trace.timeline]
        ax.plot(xs, ys, color=color, linewidth=1.4, drawstyle="steps-post",
                label=f"{label}: peak {trace.peak_bytes / MIB:.1f} MiB")
        if trace.timeline:
            i = max(range(len(ys)), key=ys.__getitem__)
            ax.scatter([xs[i]], [ys[i]], color=color, s=28, zorder=4)
    d = r.decision
    ax.axhline(d.budget_bytes / MIB, color="#d62728", linewidth=1, label=f"budget {d.budget_bytes / MIB:.1f} MiB")
    if d.reserve > 0:
        ax.axhline(d.effective_budget_bytes / MIB, color="#d62728", linestyle="--", linewidth=1,
                   label=f"less {d.reserve:.0%} reserve: {d.effective_budget_bytes / MIB:.1f} MiB")
    ax.set_ylabel(f"live bytes (MiB, {r.context.memory_source})")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower center")
    ax.set_title(f"one training step: {r.context.workload} ({_shape(r.context.shape)})", fontsize=10)
    ax.tick_params(labelbottom=False)
    for row, (short, _, trace, _) in enumerate(curves):
        for name, a, b in _phase_spans(trace):
            strip.broken_barh([(a, max(b - a, 0.05))], (row + 0.12, 0.76), color=PHASE_COLORS.get(name, "#999"))
    strip.set_yticks([i + 0.5 for i in range(len(curves))], [c[0] for c in curves], fontsize=8)
    strip.set_ylim(0, len(curves))
    strip.invert_yaxis()
    strip.set_xlabel("% of the step (each curve scaled to its own traced duration)")
    strip.legend(handles=[Patch(color=c, label=n) for n, c in PHASE_COLORS.items()], fontsize=7, ncol=4,
                 loc="upper right", bbox_to_anchor=(1.0, -0.75), frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def frontier_png(receipt: Receipt | dict[str, Any]) -> bytes | None:
    r = _as_receipt(receipt)
    if r.frontier is None or not any(p.measured for p in r.frontier.points):
        return None
    return render_frontier_png(r.frontier)


# -- shared content --------------------------------------------------------------------------------

def _summary_rows(r: Receipt) -> list[tuple[str, str, str]]:
    d = r.decision
    tc = r.traces.target
    tp = r.traces.planned
    blocked = r.blocked
    refused = None if blocked is None or blocked.refusal is None else blocked.refusal.phase
    return [
        ("step peak (measured)", fmt_bytes(d.control_peak_bytes) if blocked is None else "does not fit",
         fmt_bytes(d.shipped_peak_bytes)),
        ("blocking phase (trace)" if blocked is None else "blocking phase (refusal)",
         (tc.peak_phase.value if tc.peak_phase else "-") if blocked is None else (refused.value if refused else "-"),
         tp.peak_phase.value if tp is not None and tp.peak_phase else "-"),
        ("warm step time p50", _ms(d.control_p50_ms), _ms(d.shipped_p50_ms)),
        ("step time vs control", "", describe_overhead(d.overhead_pct, d.overhead_interval)),
        ("held at start of backward", fmt_bytes(r.plan.control_held_bytes),
         fmt_bytes(None if r.plan.control_held_bytes is None or tp is None else
                   next((ph.start_bytes for ph in tp.phases if ph.name.value == "backward"), None))),
    ]


def _verify_rows(v: VerifyReport) -> list[list[str]]:
    return [[str(s.seed), str(s.step), s.mode, f"{s.loss[0]:.6f}", _err(abs(s.loss[1] - s.loss[0])),
             _err(s.grad_max_abs), _err(s.grad_max_rel), "yes" if s.bitwise else "no",
             "ok" if s.passed else "DIFF: " + ", ".join(s.divergent[:3])] for s in v.per_step]


def _boundary_rows(r: Receipt) -> list[list[str]]:
    rows = []
    for b in r.plan.boundaries:
        f = b.fixture
        seeds = f"{_n(len(f.seeds), 'seed')} x {_n(f.steps, 'step')}" + (" + eval" if RunMode.EVAL in f.modes else "")
        calls = "" if f.replay_calls_per_step is None else \
            f"; {f.forward_calls_per_step} fwd + {f.replay_calls_per_step} replay/step"
        rows.append([b.module, b.class_name, b.mode.value + (" (guarded)" if b.guarded else ""), b.revision,
                     fmt_bytes(b.measured_saving_bytes), fmt_bytes(b.predicted_saving_bytes),
                     f"{b.replay_ms:.1f}", f"{f.name}: {seeds}{calls}" + ("; draws RNG" if f.draws_rng else ""),
                     f"rtol {f.tolerance.rtol:g}, atol {f.tolerance.atol:g} ({f.dtype}"
                     + (f" under autocast {r.context.autocast}" if r.context.autocast else "")
                     + f"); saving -{b.saving_tolerance:.0%}",
                     {True: "pass", False: "FAIL", None: "not run"}[f.passed]])
    return rows


BOUNDARY_HEADERS = ["module", "class", "mode", "revision", "saves (measured)", "saves (predicted)", "replay ms",
                    "fixture", "tolerance", "result"]
FRONTIER_HEADERS = ["plan", "boundaries", "peak", "p50 / p95", "vs control", "capacity", "samples/s", "decision",
                    "reason"]
VERIFY_HEADERS = ["seed", "step", "mode", "loss", "|dloss|", "grad abs err", "grad rel err", "bitwise", "result"]


def _frontier_rows(r: Receipt) -> list[list[str]]:
    f = r.frontier
    if f is None:
        return []
    rows = []
    for p in f.points:
        cap = p.capacity_text(f.budget_bytes, f.capacity_key or "")
        bnd = ", ".join(p.boundaries) if len(p.boundaries) <= 4 else f"{', '.join(p.boundaries[:3])} +{len(p.boundaries) - 3}"
        rows.append([p.plan, bnd or "(none)", fmt_bytes(p.peak_bytes),
                     "-" if p.p50_ms is None else f"{p.p50_ms:.1f} / {p.p95_ms:.1f} ms",
                     short_overhead(p.overhead_pct, p.overhead_interval), cap,
                     "-" if p.samples_per_s is None else f"{p.samples_per_s:.1f}",
                     p.decision.value + (" (Pareto)" if p.pareto else ""), p.reason])
    return rows


def _frontier_caption(r: Receipt) -> str:
    f, s = r.frontier, r.settings
    if f is None:
        return ""
    key = f.capacity_key or "capacity"
    return (f"Peaks: each plan alone, one warm step ({f.context.get('memory_source', r.context.memory_source)}). "
            f"Times: warm whole steps, all plans interleaved round-robin, {s.frontier_steps} per plan. "
            f"capacity: the largest {key} whose peak still clears the budget less the reserve "
            f"(+: the search stopped before finding the limit, {s.capacity_tries} probes per plan); samples/s at "
            f"that capacity. Pareto: no other plan has both a lower peak and a lower p50.")


def _hazard_lines(r: Receipt) -> list[str]:
    out = []
    if r.verification is not None:
        out += [f"{h.module} ({h.kind.value}, {h.mode}, seed {h.seed} step {h.step}): {h.detail}"
                for h in r.verification.hazards]
    return out


def _excluded_lines(r: Receipt) -> list[str]:
    plan = r.plan.plan
    return [] if plan is None else [f"{e.module}: {e.reason}" for e in plan.excluded]


def _context_rows(r: Receipt) -> list[tuple[str, str]]:
    c, s = r.context, r.settings
    rows = [
        ("workload", c.workload), ("shape", _shape(c.shape)),
        ("resolved shape", _shape(c.resolved_shape)),
        ("boundary shape", _shape(c.boundary_shape) if c.boundary_shape else "-"),
        ("dtype / device", f"{c.dtype} / {c.device}" + (f", forward under autocast {c.autocast}" if c.autocast else "")),
        ("memory source", c.memory_source),
        ("torch / python", f"{c.torch_version} / {c.python_version}"),
        ("host", f"{c.hostname} ({c.platform}, {c.cpu_count} CPUs, {c.threads} torch threads)"),
        ("remat", c.remat_version),
        ("git revision", "-" if c.git_revision is None else c.git_revision + (" (uncommitted changes)" if c.git_dirty else "")),
        ("created", c.created), ("command", c.command or "-"),
        ("traces", f"{s.trace_warmup} warm-up + {_n(s.trace_steps, 'traced step')} per shape"),
        ("verification", f"{_n(s.verify_seeds, 'seed')} x {_n(s.verify_steps, 'step')} + eval; RNG timing "
                         f"{_n(s.verify_timing_steps, 'step')}"),
        ("frontier", f"{len(s.frontier_plans)} plans, {s.frontier_warmup} warm-up + {s.frontier_steps} timed steps "
                     f"each (interleaved); capacity {s.capacity_key or 'not searched'}"
                     + (f" ({s.capacity_tries} tries, {s.capacity_steps} timed steps)" if s.capacity_key else "")),
    ]
    if c.device_memory_bytes is not None:
        rows.insert(4, ("device memory", fmt_bytes(c.device_memory_bytes) + (", enforced" if c.device == "cpu" else "")))
    if r.blocked is not None:
        rows.insert(5, ("blocked", r.blocked.describe()))
    if s.note:
        rows.append(("note", s.note))
    return rows


def _title(r: Receipt) -> str:
    return f"remat receipt: {r.context.workload} ({_shape(r.context.shape)})"


def _headline(r: Receipt) -> str:
    d = r.decision
    if d.status is ShipStatus.SHIP and d.boundaries:
        return f"SHIP {d.shipped}: checkpoint {_n(len(d.boundaries), 'module')}"
    if d.status is ShipStatus.SHIP:
        return "SHIP no checkpointing: the step already fits"
    return "NOTHING SHIPS"


# -- HTML ------------------------------------------------------------------------------------------

def e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _html_table(headers: Sequence[str] | None, rows: Iterable[Sequence[str]], *, cls: str = "") -> str:
    head = "" if headers is None else "<thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr></thead>"
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{e(cls)}">{head}<tbody>{body}</tbody></table>'


def _img(png: bytes | None, alt: str) -> str:
    if png is None:
        return f'<p class="muted">{e(alt)}: nothing to plot.</p>'
    return f'<img alt="{e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _ul(lines: list[str], empty: str) -> str:
    if not lines:
        return f'<p class="muted">{e(empty)}</p>'
    return "<ul>" + "".join(f"<li>{e(x)}</li>" for x in lines) + "</ul>"


_CSS = """
body{font:15px/1.5 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:#1b1f24;max-width:1180px;margin:24px auto;padding:0 20px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.muted{color:#57606a}.verdict{border-radius:8px;padding:14px 18px;margin:14px 0}
.ship{background:#dafbe1;border:1px solid #4ac26b}.noplan{background:#ffebe9;border:1px solid #ff8182}
.verdict h2{border:0;margin:0 0 6px;font-size:20px}.verdict ol{margin:6px 0 0 0;padding-left:22px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right}table.kv td:first-child{color:#57606a;white-space:nowrap}
img{max-width:100%;border:1px solid #d0d7de;border-radius:6px}code{background:#f6f8fa;padding:1px 4px;border-radius:4px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}.fail{color:#cf222e;font-weight:600}.pass{color:#1a7f37;font-weight:600}
"""


def _html_head(r: Receipt) -> str:
    """The document head, the title and the line of context under it."""
    c = r.context
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{e(_title(r))}</title>"
            f"<style>{_CSS}</style></head><body>"
            f"<h1>{e(_title(r))}</h1><p class=\"muted\">{e(c.created)} · remat {e(c.remat_version)}"
            f" · {e(c.device)} {e(c.dtype)} · git {e(c.git_revision or 'n/a')}</p>")


def _html_decision(r: Receipt) -> str:
    """1. the verdict and its reasons, control vs shipped, the budget arithmetic."""
    d = r.decision
    cls = "ship" if d.status is ShipStatus.SHIP else "noplan"
    return (f'<div class="verdict {cls}"><h2>{e(_headline(r))}</h2><ol>'
            + "".join(f"<li>{e(w)}</li>" for w in d.why) + "</ol></div>"
            + _html_table(["", "control", f"shipped ({d.shipped or '-'})"], _summary_rows(r), cls="kv")
            + _html_table(["budget", "required reserve", "peak must stay under", "clears", "headroom"],
                          [[fmt_bytes(d.budget_bytes), f"{d.reserve:.0%}", fmt_bytes(d.effective_budget_bytes),
                            "yes" if d.clears else "no", fmt_bytes(d.headroom_bytes)]]))


def _html_frontier(r: Receipt) -> str:
    """2. the frontier plot and table; the optimal planner's closed-loop tries."""
    out = ("<h2>Frontier: peak vs step time</h2>" + _img(frontier_png(r), "frontier plot")
           + _html_table(FRONTIER_HEADERS, _frontier_rows(r)) + f"<p class=\"muted\">{e(_frontier_caption(r))}</p>")
    if r.plan.closed_loop:
        tries = "; ".join(f"predicted {fmt_bytes(a.predicted_peak_bytes)}, measured {fmt_bytes(a.measured_peak_bytes)}"
                          f"{' (fits)' if a.fits else ' (misses)'}" for a in r.plan.closed_loop)
        out += (f"<p class=\"muted\">Optimal planner, closed loop ({e(', '.join(r.plan.closed_loop_boundaries))}):"
                f" {e(tries)}.</p>")
    return out


def _phase_rows(r: Receipt) -> list[list[str]]:
    """Per phase: peak bytes and traced time, control vs plan."""
    planned = {p.name.value: p for p in r.traces.planned.phases} if r.traces.planned else {}
    rows = []
    for p in r.traces.target.phases:
        q = planned.get(p.name.value)
        rows.append([p.name.value, fmt_bytes(p.peak_bytes), fmt_bytes(q.peak_bytes if q else None),
                     _ms(p.duration_ms), _ms(q.duration_ms if q else None)])
    return rows


def _blocked_caption(r: Receipt) -> str:
    """Where the control's figures come from when it does not fit at the target (NOTE [blocked receipt])."""
    return (f"The control does not fit the device at {_shape(r.context.shape)}: its curve, its held bytes and the "
            f"boundaries' measured savings are at {_shape(r.traces.target.context.shape)}, the largest batch at which it "
            "fits (where equivalence is proved too); the plan's curve is at the target.")


def _html_timeline(r: Receipt) -> str:
    """3. the phase timeline plot, the per-phase table, the boundary-shape trace."""
    out = ("<h2>Phase timeline: live bytes over one step</h2>" + _img(timeline_png(r), "phase timeline, control vs plan")
           + _html_table(["phase", "peak: control", "peak: plan", "time: control (traced)", "time: plan (traced)"],
                         _phase_rows(r)))
    if r.blocked is not None:
        out += (f"<p class=\"muted\">{e(_blocked_caption(r))}</p>")
    b = r.traces.boundary
    if b is not None:
        out += (f"<p class=\"muted\">Boundary shape {e(_shape(b.context.shape))} (unmodified): peak "
                f"{e(fmt_bytes(b.peak_bytes))} in {e(b.peak_phase.value if b.peak_phase else '-')}.</p>")
    return out


def _html_boundaries(r: Receipt) -> str:
    """4. why each wrapper exists."""
    out = "<h2>Boundaries: why each wrapper exists</h2>"
    if not r.plan.boundaries:
        return out + f"<p class=\"muted\">{e(r.plan.note or 'No boundaries: nothing is checkpointed.')}</p>"
    return (out + _html_table(BOUNDARY_HEADERS, _boundary_rows(r))
            + "<p class=\"muted\">saves (measured): live bytes at the start of backward, control minus this "
              "boundary alone checkpointed. remat check fails when a revision changes or a saving falls by more "
              "than its tolerance.</p>")


def _html_verification(v: VerifyReport) -> str:
    """The verdict, per-step table, negative controls, RNG policy, failures and warnings of one verification."""
    verdict = '<span class="pass">PASSED</span>' if v.passed else '<span class="fail">FAILED</span>'
    out = (f"<p>{verdict}: {e(_n(len(v.seeds), 'seed'))} x {e(_n(v.steps, 'step'))} + an eval step per seed; "
           f"tolerance per tensor max|planned - control| &lt;= atol + rtol x max|control| "
           f"({e(', '.join(f'{k}: rtol {t.rtol:g}, atol {t.atol:g}' for k, t in v.tolerances.items() if k == v.dtype))}"
           f"{e(f', widened to autocast {v.autocast}: its rounding' if v.autocast else '')}); "
           f"control repeatable: {e('yes' if v.repeatable else 'NO')}.</p>")
    out += _html_table(VERIFY_HEADERS, _verify_rows(v))
    out += _html_table(["negative control", "result", "detail"],
                       [[n.name, ("rejected" if n.rejected else "NOT rejected") if n.applicable else "n/a", n.detail]
                        for n in v.negative_controls])
    timing = "" if v.rng_timing is None else f"; preservation costs {v.rng_timing.overhead_ms:+.2f} ms/step"
    out += f"<p>RNG policy: <b>{e(v.rng_policy.policy)}</b>: {e(v.rng_policy.justification)}{e(timing)}</p>"
    if v.failures:
        out += "<p class=\"fail\">Failures:</p>" + _ul(list(v.failures), "")
    if v.warnings:
        out += _ul(list(v.warnings), "")
    return out


def _html_equivalence(r: Receipt) -> str:
    """5. equivalence with the unmodified step."""
    out = "<h2>Equivalence with the unmodified step</h2>"
    if r.verification is None:
        return out + f"<p class=\"muted\">{e(r.verification_note)}</p>"
    return out + _html_verification(r.verification)


def _html_hazards(r: Receipt) -> str:
    """6. replay hazards, and the candidates the planner excluded (the first 30)."""
    out = "<h2>Hazards</h2>" + _ul(_hazard_lines(r), "No replay hazard was observed in the checkpointed regions.")
    excluded = _excluded_lines(r)
    if excluded:
        more = [f"... {len(excluded) - 30} more in receipt.json"] if len(excluded) > 30 else []
        out += f"<p class=\"muted\">Candidates the planner excluded ({len(excluded)}):</p>" + _ul(excluded[:30] + more, "")
    return out


def _world_size_rows(r: Receipt) -> list[list[str]]:
    """Per rank at the receipt's world size: control and planned peak, against the per-device budget."""
    ws = r.world_size
    if ws is None or ws.report.plan is None:
        return []
    limit = r.decision.effective_budget_bytes
    return [[str(c.rank), fmt_bytes(c.peak_bytes), fmt_bytes(p.peak_bytes), "yes" if p.peak_bytes <= limit else "NO",
             _ms(p.p50_ms)] for c, p in zip(ws.report.control.per_rank, ws.report.plan.per_rank)]


WORLD_SIZE_HEADERS = ["rank", "control peak", "planned peak", "within budget", "planned p50 ms"]


def _world_size_caption(r: Receipt) -> str:
    ws = r.world_size
    assert ws is not None
    rep, eq = ws.report, ws.report.equivalence
    same = "no planned side" if eq is None else ("the control's training step" if eq.ok else "NOT the control's step")
    samples = "" if rep.plan is None else f"{rep.plan.global_samples_per_s:.1f} samples/s planned vs "
    return (f"{rep.engine.value} on {rep.world_size} ranks ({rep.backend}, {rep.memory_source}): {same} "
            f"({'-' if eq is None else eq.criterion}); {samples}{rep.control.global_samples_per_s:.1f} control, "
            f"global; per-device budget {fmt_bytes(r.decision.effective_budget_bytes)} (budget less reserve)")


def _html_world_size(r: Receipt) -> str:
    """At a world size (NOTE [receipt at a world size] in remat/receipt/world_size.py)."""
    if r.world_size is None:
        return ""
    return (f"<h2>At world size {r.world_size.world_size}</h2><p>{e(_world_size_caption(r))}</p>"
            + _html_table(WORLD_SIZE_HEADERS, _world_size_rows(r)))


def _html_unsupported(r: Receipt) -> str:
    """7. the modes this receipt does not cover."""
    return ("<h2>Not covered by this receipt</h2>"
            + _html_table(["mode", "status", "detail"], [[u.mode, u.status, u.detail] for u in r.unsupported]))


def _html_context(r: Receipt) -> str:
    """8. where and how it ran; how to re-check it."""
    return ("<h2>Context</h2>" + _html_table(None, _context_rows(r), cls="kv")
            + "<p class=\"muted\">Re-check in CI: <code>remat check receipt.json</code> (add <code>--quick</code> "
              "for revision hashes and equivalence only). Rendered from receipt.json alone.</p>")


_HTML_SECTIONS = (_html_head, _html_decision, _html_frontier, _html_timeline, _html_boundaries, _html_equivalence,
                  _html_hazards, _html_world_size, _html_unsupported, _html_context)


def render_html(receipt: Receipt | dict[str, Any]) -> str:
    """The self-contained report (plots embedded, no network, no JavaScript), from the receipt alone; a pipeline
    run's (NOTE [one receipt] in remat/receipt/model.py) is its per-stage tables and timelines."""
    r = _as_receipt(receipt)
    if r.pipeline is not None:
        return _pipeline_html(r, r.pipeline)
    return "".join(section(r) for section in _HTML_SECTIONS) + "</body></html>\n"


# -- Markdown --------------------------------------------------------------------------------------

# NOTE [markdown escaping]
# A receipt string in report.md is text, never markup: a pull request may have written it, and the
# report may be posted as a comment where an image loads a beacon and a link runs a script. md()
# turns every character CommonMark or GitHub gives a meaning into a backslash escape or an entity:
# emphasis and strikethrough, code spans (a backtick becomes a quote), cell breaks, links and images
# (``[``, ``]``, ``(``, ``)``, ``!``), raw HTML and ``<...>`` autolinks (entities), the bare
# autolinks GitHub adds (``://`` becomes ``:\/\/`` and ``www.`` ``www\.``), mentions and issue
# references (``@``, ``#``), a list marker or setext underline at the start of the string (it may
# start a line), and every line break (CR, LF, the Unicode separators; any control character becomes
# a space), so a string stays inside its cell or line. Escaped, each still reads the same.
_MD_ESCAPES = str.maketrans({**{c: "\\" + c for c in "\\*_[]()!#~@"}, "|": "\\|", "`": "'",
                             "&": "&amp;", "<": "&lt;", ">": "&gt;"})
_MD_BREAKS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MD_LINE_START = re.compile(r"^(\s*)([-+=]|\d+(?=[.)]))")   # a list marker, setext underline, ordered list


def md(x: Any) -> str:
    """Escape a receipt string for Markdown: a table cell or a line of text (NOTE [markdown escaping])."""
    s = _MD_BREAKS.sub(" ", str(x)).translate(_MD_ESCAPES).replace("://", ":\\/\\/").replace("www.", "www\\.")
    return _MD_LINE_START.sub(lambda m: m[1] + (m[2] + "\\" if m[2][0].isdigit() else "\\" + m[2]), s, count=1)


def _md_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(md(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(md(c) for c in row) + " |" for row in rows]
    return out


def _md_decision(r: Receipt) -> list[str]:
    """The title, the verdict and its reasons, control vs shipped, the budget arithmetic."""
    d = r.decision
    headroom = f" (headroom {md(fmt_bytes(d.headroom_bytes))})." if d.headroom_bytes is not None else "."
    return [f"## {md(_title(r))}", "", f"**{md(_headline(r))}**", "",
            *[f"{i}. {md(w)}" for i, w in enumerate(d.why, 1)],
            "", *_md_table(["", "control", f"shipped ({d.shipped or '-'})"], _summary_rows(r)), "",
            f"Budget {md(fmt_bytes(d.budget_bytes))}, required reserve {d.reserve:.0%}: the peak must stay under "
            f"{md(fmt_bytes(d.effective_budget_bytes))}; clears: **{'yes' if d.clears else 'no'}**" + headroom, ""]


def _md_boundaries(r: Receipt) -> list[str]:
    head = ["### Boundaries", ""]
    if not r.plan.boundaries:
        return [*head, md(r.plan.note or "No boundaries: nothing is checkpointed.")]
    caption = [] if r.blocked is None else ["", md(_blocked_caption(r))]
    return [*head, *_md_table(BOUNDARY_HEADERS, _boundary_rows(r)), *caption]


def _md_frontier(r: Receipt) -> list[str]:
    head = ["", "### Frontier", ""]
    if not r.frontier:
        return [*head, "not run"]
    return [*head, *_md_table(FRONTIER_HEADERS, _frontier_rows(r)), "", md(_frontier_caption(r))]


def _md_verification(v: VerifyReport) -> list[str]:
    """One verification: the verdict line, then each negative control and failure."""
    bitwise = all(s.bitwise for s in v.per_step)
    verdict = (f"**{'PASSED' if v.passed else 'FAILED'}**: {_n(len(v.seeds), 'seed')} x {_n(v.steps, 'step')} + eval, "
               f"{'bitwise equal' if bitwise else 'within tolerance'}; control repeatable: "
               f"{'yes' if v.repeatable else 'NO'}; RNG policy: {md(v.rng_policy.policy)}.")
    controls = [f"- negative control {md(n.name)}: "
                + md(("rejected" if n.rejected else "NOT rejected") if n.applicable else "n/a") + f" ({md(n.detail)})"
                for n in v.negative_controls]
    return [verdict, "", *controls, *[f"- failure: {md(f)}" for f in v.failures]]


def _md_equivalence(r: Receipt) -> list[str]:
    head = ["", "### Equivalence", ""]
    if r.verification is None:
        return [*head, md(r.verification_note)]
    return [*head, *_md_verification(r.verification)]


def _md_hazards(r: Receipt) -> list[str]:
    return ["", "### Hazards", "",
            *([f"- {md(h)}" for h in _hazard_lines(r)] or ["No replay hazard was observed in the checkpointed regions."])]


def _md_world_size(r: Receipt) -> list[str]:
    if r.world_size is None:
        return []
    return ["", f"### At world size {r.world_size.world_size}", "", md(_world_size_caption(r)), "",
            *_md_table(WORLD_SIZE_HEADERS, _world_size_rows(r))]


def _md_unsupported(r: Receipt) -> list[str]:
    return ["", "### Not covered", "", *[f"- **{md(u.mode)}** ({md(u.status)}): {md(u.detail)}" for u in r.unsupported]]


def _md_footer(r: Receipt) -> list[str]:
    c = r.context
    return ["", f"<sub>{md(c.workload)} · {md(c.dtype)} on {md(c.device)} · torch {md(c.torch_version)} · "
                f"remat {md(c.remat_version)} · git {md(c.git_revision or 'n/a')} · {md(c.created)}. "
                f"Re-check: remat check receipt.json. Full report: report.html.</sub>", ""]


_MD_SECTIONS = (_md_decision, _md_boundaries, _md_frontier, _md_equivalence, _md_hazards, _md_world_size,
                _md_unsupported, _md_footer)


def render_markdown(receipt: Receipt | dict[str, Any]) -> str:
    """The pull-request summary: decision, boundaries, frontier, equivalence, what is not covered (a pipeline
    run's: its verdict, per-stage tables, timelines and boundaries)."""
    r = _as_receipt(receipt)
    if r.pipeline is not None:
        return _pipeline_markdown(r, r.pipeline)
    return "\n".join(line for section in _MD_SECTIONS for line in section(r))


# -- a pipeline run (NOTE [one receipt] in remat/receipt/model.py) -----------------------------------
# ``pipeline.md`` (render_pipeline_markdown) is the run's per-stage table and text timeline, from
# ``pipeline.json`` alone; the receipt's report.md is it with the verdict and boundaries, and its report.html
# the same cells (stage_cells, side_cells, equivalence_text), so all say the same thing in the same words,
# and each side's last timed step as an inline SVG (no JavaScript, no network, no plotting library): one
# lane per stage, a rectangle per recorded interval, coloured by kind, replay drawn over the backward it
# runs in, p2p waits as a thin bar. Figures in MiB, one unit for figures read side by side.

# timeline letters, most specific first: a replay runs inside a backward
_LETTERS = (("replay", "R"), ("backward", "B"), ("forward", "F"), ("loss", "L"), ("optimizer", "O"))
WIDTH = 96   # characters of one stage's timeline row

STAGE_HEADERS = ["side", "stage", "in flight", "boundaries", "peak", "predicted", "fits", "fwd ms", "bwd ms",
                 "replay ms", "p2p ms", "exposed p2p ms", "idle ms", "bubble", "vs none"]
SIDE_HEADERS = ["side", "step p50 ms", "step p95 ms", "samples/s", "largest stage peak", "largest bubble"]


def _stages(side: SideReport) -> list[StageFigures]:
    """A pipeline side's stages, in row order."""
    return [r.stage for r in side.per_rank if r.stage is not None]


def timeline_rows(side: SideReport, width: int = WIDTH) -> list[str]:
    """One text row per stage over the side's last timed step: F forward, L loss, B backward, R replay inside
    backward, O optimizer, ``-`` blocked in p2p, ``.`` idle; every column is ``end / width`` ms."""
    events = [e for s in _stages(side) for e in s.timeline]
    if not events:
        return []
    t0 = min(e.start_ms for e in events)
    span = max(max(e.end_ms for e in events) - t0, 1e-9)
    rows = []
    for s in _stages(side):
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


def _formula(p: PipelineFigures) -> str:
    """The schedule's ideal bubble formula, as the report's figure was computed (plan/pipeline.ideal_bubble)."""
    return "(p - 1) / (m + p - 1)" if p.stages_per_rank == 1 else \
        f"(p - 1) / (v m + p - 1) with v = {p.stages_per_rank} stages per rank"


def stage_cells(side: str, r: RankFigures, budget_bytes: int | None, *, no: str) -> list[str]:
    """One row of the per-stage table (``STAGE_HEADERS``); ``no``: how a stage over the budget is marked."""
    s = r.stage
    assert s is not None, "a pipeline row"
    return [side, str(s.stage), str(s.in_flight), ", ".join(s.boundaries) or "-", mib(r.peak_bytes),
            "-" if s.predicted_peak_bytes is None else mib(s.predicted_peak_bytes),
            "-" if budget_bytes is None else ("yes" if r.peak_bytes <= budget_bytes else no),
            f"{s.forward_ms:.1f}", f"{s.backward_ms:.1f}", f"{s.replay_ms:.1f}", f"{r.comm_ms or 0.0:.1f}",
            f"{r.exposed_comm_ms or 0.0:.1f}", f"{s.idle_ms:.1f}", f"{s.bubble_fraction:.3f}",
            "-" if s.bubble_delta_vs_none is None else f"{s.bubble_delta_vs_none:+.3f}"]


def side_cells(side: str, r: SideReport) -> list[str]:
    """One row of the per-side table (``SIDE_HEADERS``)."""
    return [side, f"{r.step_ms_p50:.1f}", f"{r.step_ms_p95 or 0.0:.1f}", f"{r.global_samples_per_s:.2f}",
            mib(r.max_peak_bytes), f"{r.max_bubble_fraction or 0.0:.3f}"]


def stage_rows(report: DistributedReport, *, no: str) -> list[list[str]]:
    """Every side's per-stage rows (``STAGE_HEADERS``)."""
    return [stage_cells(name, r, report.budget_bytes, no=no) for name, side in sides_of(report)
            for r in side.per_rank]


def sides_of(report: DistributedReport) -> list[tuple[str, SideReport]]:
    """(name, side) of every side run, in order."""
    return [(name, side) for name in report.sides if (side := report.side(name)) is not None]


def equivalence_text(side: str, eq: PipelineEquivalence, verdict: str,
                     escape: Callable[[str], str] = str) -> str:
    """``side`` against the unplanned pipeline, with up to five mismatches (``escape``d for HTML)."""
    return (f"{escape(side)} vs none (same schedule and microbatches): {verdict} over {eq.params_compared} "
            f"parameters (max |diff| {eq.max_abs_diff:.3g})" + "".join(f"; {escape(m)}" for m in eq.mismatched[:5]))


def _figures(report: DistributedReport) -> PipelineFigures:
    assert report.pipeline is not None, "a pipeline run's report"
    return report.pipeline


def _pipe_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *["| " + " | ".join(r) + " |" for r in rows]]


def _intro(report: DistributedReport) -> list[str]:
    f = _figures(report)
    v, p = f.stages_per_rank, report.world_size
    where = f"{p} stages" if v == 1 else f"{p} ranks x {v} stages (a row is a rank)"
    budget = "" if report.budget_bytes is None else f" Per-device budget {mib(report.budget_bytes)}."
    return [f"# Pipeline: {report.spec} on {where} ({report.backend})", "",
            f"Schedule {f.schedule.value}, {f.microbatches} microbatches of batch {f.batch_size}, "
            f"split at {', '.join(f.split_points)} ({f.split_source}). Ideal bubble {_formula(f)} = "
            f"{f.ideal_bubble_fraction:.3f}." + budget, ""]


def _equivalence_lines(report: DistributedReport) -> list[str]:
    out = ["", "## Equivalence", ""]
    out += [f"- {equivalence_text(name.value, eq, 'bitwise equal' if eq.ok else 'DIFFERENT')}"
            for name, eq in _figures(report).equivalence.items()]
    neg = _figures(report).negative_control_rejected
    if neg is not None:
        out.append(f"- negative control (a gradient perturbed by 1e-3): {'rejected' if neg else 'ACCEPTED'}")
    return out


def render_pipeline_markdown(report: DistributedReport) -> str:
    out = _intro(report)
    out += _pipe_table(STAGE_HEADERS, stage_rows(report, no="**no**"))
    out += [""] + _pipe_table(SIDE_HEADERS, [side_cells(name, side) for name, side in sides_of(report)])
    out += _equivalence_lines(report)
    out += ["", "## Timelines (last timed step)", "",
            "F forward, L loss, B backward, R replay (inside backward), O optimizer, - blocked in p2p, . idle", ""]
    for name, side in sides_of(report):
        out += [f"{name}:", "", "```", *timeline_rows(side), "```", ""]
    out += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(out)



# kind -> (colour, lane height share); drawn in this order, so replay lies over backward
_KINDS = (("forward", "#54aeff", 1.0), ("loss", "#bf8700", 1.0), ("backward", "#4ac26b", 1.0),
          ("replay", "#cf222e", 0.6), ("optimizer", "#8250df", 1.0), ("p2p", "#8c959f", 0.25))
LANE_PX = 26
WIDTH_PX = 960
LABEL_PX = 70


def _lane(lane: int, s: StageFigures, t0: float, span: float) -> list[str]:
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
    stages = _stages(side)
    t0 = min(ev.start_ms for s in stages for ev in s.timeline)
    span = max(t_max_ms if t_max_ms is not None else own_span, 1e-9)
    height = LANE_PX * len(stages) + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{height}" '
             f'font-family="sans-serif" font-size="11">']
    for lane, s in enumerate(stages):
        parts += _lane(lane, s, t0, span)
    axis_y = LANE_PX * len(stages) + 16
    parts.append(f'<text x="{LABEL_PX}" y="{axis_y}">0 ms</text>'
                 f'<text x="{WIDTH_PX - 10}" y="{axis_y}" text-anchor="end">{span:.0f} ms</text></svg>')
    return "".join(parts)


def _legend() -> str:
    return "<p>" + " ".join(f'<span style="display:inline-block;width:12px;height:12px;background:{c}"></span> {e(k)}'
                            for k, c, _ in _KINDS) + ' <span class="muted">(blank: idle)</span></p>'


def _pipeline_headline(p: PipelineEvidence) -> str:
    why = p.why_not
    if not why:
        return (f"HOLDS: remat's per-stage plans fit {mib(p.report.budget_bytes)} per device and train bitwise "
                f"like the unplanned pipeline")
    return "DOES NOT HOLD: " + "; ".join(why)


def _pipeline_head(r: Receipt, pe: PipelineEvidence) -> list[str]:
    """The page's head, title, provenance line and verdict."""
    p, f, c = pe.report, pe.figures, r.context
    title = (f"remat pipeline receipt: {p.spec} on {p.world_size} stages, {f.schedule.value}, {f.microbatches} "
             f"microbatches")
    return [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>"
            f'<p class="muted">{e(c.created)} · remat {e(c.remat_version)} · {e(p.backend)} · {e(c.dtype)} · git '
            f"{e(c.git_revision or 'n/a')} · torch {e(p.torch_version)}</p>",
            f'<div class="verdict {"noplan" if pe.why_not else "ship"}"><h2>{e(_pipeline_headline(pe))}</h2></div>']


def _pipeline_settings(r: Receipt, p: DistributedReport) -> str:
    f = _figures(p)
    return _html_table(None, [
        ["split", f"{', '.join(f.split_points)} ({f.split_source})"],
        ["batch", f"{f.batch_size} in {f.microbatches} microbatches"],
        ["ideal bubble " + _formula(f), f"{f.ideal_bubble_fraction:.3f}"],
        ["per-device budget", "-" if p.budget_bytes is None else mib(p.budget_bytes)],
        ["memory source", p.memory_source], ["command", r.context.command or "-"]], cls="kv")


def _pipeline_figures(p: DistributedReport) -> list[str]:
    """The per-stage and per-side tables, and every side's timeline on one time axis (a side that replays is
    visibly longer)."""
    parts = ["<h2>Per stage</h2>",
             _html_table(STAGE_HEADERS, stage_rows(p, no="NO")),
             _html_table(SIDE_HEADERS, [side_cells(name, side) for name, side in sides_of(p)]),
             "<h2>Per-stage timelines (last timed step)</h2>" + _legend()]
    t_max = p.timeline_span_ms
    parts += [f"<h3>{e(name)}</h3>" + timeline_svg(side, t_max_ms=t_max) for name, side in sides_of(p)]
    return parts


def _pipeline_equivalence(p: DistributedReport) -> list[str]:
    parts = ["<h2>Equivalence</h2><ul>"]
    for name, eq in _figures(p).equivalence.items():
        verdict = '<span class="pass">bitwise equal</span>' if eq.ok else '<span class="fail">DIFFERENT</span>'
        parts.append(f"<li>{equivalence_text(name.value, eq, verdict, escape=e)}</li>")
    neg = _figures(p).negative_control_rejected
    if neg is not None:
        verdict = "rejected" if neg else '<span class="fail">ACCEPTED</span>'
        parts.append(f"<li>negative control (a gradient perturbed by 1e-3): {verdict}</li>")
    return parts + ["</ul>"]


def _pipeline_html(r: Receipt, pe: PipelineEvidence) -> str:
    p = pe.report
    parts = [*_pipeline_head(r, pe), _pipeline_settings(r, p), *_pipeline_figures(p), *_pipeline_equivalence(p),
             "<h2>Boundaries</h2>"]
    parts.append(_html_table(["stage", "module", "class", "revision"],
                             [[str(b.stage), b.module, b.class_name, b.revision] for b in pe.boundaries])
                 if pe.boundaries else '<p class="muted">no boundaries</p>')
    parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in p.notes) + "</ul>")
    check_steps = r.world_size.check_steps if r.world_size is not None else 1
    parts.append(f'<p class="muted">re-check: <code>remat check receipt.json</code> re-runs the unplanned and the '
                 f"planned pipeline ({check_steps} timed step(s) each) at world size {p.world_size}.</p>")
    parts.append("</body></html>")
    return "".join(parts)


def _pipeline_markdown(r: Receipt, pe: PipelineEvidence) -> str:
    head = [f"**{_pipeline_headline(pe)}**", "",
            f"remat {r.context.remat_version}, git {r.context.git_revision or 'n/a'}, {r.context.created}; "
            f"`{r.context.command or '-'}`", ""]
    bounds = ["## Boundaries", "", "| stage | module | class | revision |", "|---|---|---|---|",
              *[f"| {b.stage} | {b.module} | {b.class_name} | {b.revision} |" for b in pe.boundaries], ""]
    return "\n".join(head) + render_pipeline_markdown(pe.report) + "\n" + "\n".join(bounds)
