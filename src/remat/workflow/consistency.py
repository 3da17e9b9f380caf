"""Does a receipt agree with itself? Checks that need no run, made before ``remat check`` measures anything.

NOTE [receipt consistency]
``remat receipt`` writes each figure in more than one place (the decision, the frontier's
points, the plan, the boundary records, the fixtures), computed from one another. A hand
edit that changes one copy leaves the others contradicting it, so ``check`` refuses the
receipt before running anything, one finding per contradiction:
- budget (``FindingKind.BUDGET``): the effective budget is int(budget x (1 - reserve)); the
  frontier was judged against the same budget and reserve; headroom, reserve left and
  ``clears`` follow from the shipped peak; no budget above the stated device memory, which a
  blocked step must state (NOTE [blocked receipt]);
- records (``RECORDS``): the plan's boundaries (module, mode, guarded, predicted saving) are
  the boundary records', the decision's and the shipped frontier point's; the frontier's
  shipped plan is the plan; the labels agree;
- fixture (``FIXTURE``): every fixture is the one ``remat receipt`` writes from the settings
  (seeds 0..n-1, the settings' steps, the receipt's dtype, the tolerance the verification used
  for it, the verification run under the context's autocast) and no count (seeds, steps, warm-up,
  timing steps) exceeds the gate's limits (NOTE [gate thresholds] in workflow/gate.py);
- claims (``CLAIMS``): the decision's peaks, p50s and overhead are the frontier points',
  each p50 is the median of its samples, each point ``fits`` exactly when its peak clears,
  the control does not fit when a plan with boundaries ships, a shipped plan clears and was
  verified, and each boundary's tolerance is the settings'.
Only a receipt that passes all of them may lend the gate its budget and reserve.

NOTE [receipt statements]
The sentences and lists a reviewer reads first are claims too, and each is a function of data the
receipt keeps, so check regenerates it with the code ``remat receipt`` wrote it with and compares
(``FindingKind.STATEMENTS``, before anything runs):
- ``decision.why`` (the first line of both reports): ``shipped_why`` in workflow/build.py from the
  frontier, the plan, the target trace and the verification;
- ``decision.rejected``: each entry is its frontier point's decision, reason, peak and p50, and each
  point's decision and reason are what the ship decision (``ship_decision``, frontier/pareto.py) gives
  on the frontier's own points;
- ``unsupported``: every mode ``unsupported_modes`` lists for the receipt's conditions is there, word
  for word (a world-size receipt replaces the single-process line with its own);
- the RNG policy's justification and policy: what ``_rng_policy`` (verify/runner.py) writes for the
  plan's ``preserve_rng_state`` and the boundaries that draw random numbers, which are the ones the
  verification's boundary records say draw;
- ``memory_source``: the context's and each trace's is the instrument for the receipt's device
  (``context_memory_source``); every figure's is one of that device's instruments;
- the target trace: its peak is the largest of its steps' peaks and (CPU tracker) the sum of its
  categories at the peak; every copy of the torch version agrees.
What no receipt data can re-derive (``git_revision``, ``command``, the host, the creation time, the
planner's exclusion reasons) the check lists on an "unchecked" line instead of passing it silently
(``UNCHECKED`` in workflow/check.py); the figures re-measured are listed in check.py's docstring.
"""

from __future__ import annotations

import dataclasses
import math

from ..percentile import percentile
from ..frontier.model import FrontierPoint, FrontierReport, OverheadInterval
from ..frontier.pareto import overhead_interval
from ..frontier.pareto import Verdict, ship_decision
from ..receipt.model import Receipt, ReceiptDecision, ShipStatus
from ..types import MemorySource
from ..units import mib
from .build import FIXTURE_NAME, WORLD_SIZE_MODE, context_memory_source, shipped_why, unsupported_modes
from .findings import CheckFinding, FindingKind

REL = 1e-6          # figures computed from one another agree to this (relative)
SAMPLE_REL = 1e-3   # a p50 and the median of its samples, which the frontier rounds to 0.1 us


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixtureLimits:
    """The largest fixture ``check`` runs (NOTE [gate thresholds])."""

    max_seeds: int
    max_steps: int      # steps per seed, warm-up steps and timing steps


def _f(kind: FindingKind, message: str, boundary: str | None = None) -> CheckFinding:
    return CheckFinding(kind=kind, message=message, boundary=boundary)


def _close(a: float | None, b: float | None, rel: float = REL) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


# -- budget ----------------------------------------------------------------------------------------

def _peak_arithmetic(d: ReceiptDecision) -> list[CheckFinding]:
    """Headroom, reserve left and clears follow from the shipped peak (bytes)."""
    peak = d.shipped_peak_bytes
    if peak is None:
        return []
    out = []
    if d.headroom_bytes != d.effective_budget_bytes - peak:
        out.append(_f(FindingKind.BUDGET, f"headroom {d.headroom_bytes} bytes is not the effective budget less the "
                                          f"shipped peak ({d.effective_budget_bytes} - {peak} bytes)"))
    if d.budget_bytes > 0 and not _close(d.reserve_left, 1.0 - peak / d.budget_bytes):
        out.append(_f(FindingKind.BUDGET, f"reserve left {d.reserve_left} is not 1 - shipped peak / budget "
                                          f"({1.0 - peak / d.budget_bytes:.6f})"))
    if d.clears != (d.status is ShipStatus.SHIP and peak <= d.effective_budget_bytes):
        out.append(_f(FindingKind.BUDGET, f"clears is {d.clears}, but the shipped peak {mib(peak)} "
                                          f"{'is' if peak <= d.effective_budget_bytes else 'is not'} under the "
                                          f"effective budget {mib(d.effective_budget_bytes)}"))
    return out


def budget_findings(receipt: Receipt) -> list[CheckFinding]:
    d, fr = receipt.decision, receipt.frontier
    out = []
    limit = int(d.budget_bytes * (1.0 - d.reserve))
    if d.effective_budget_bytes != limit:
        out.append(_f(FindingKind.BUDGET, f"effective budget {d.effective_budget_bytes} bytes is not budget x "
                                          f"(1 - reserve) = {d.budget_bytes} x (1 - {d.reserve}) = {limit} bytes"))
    if fr is not None and (fr.budget_bytes, fr.reserve) != (d.budget_bytes, d.reserve):
        out.append(_f(FindingKind.BUDGET, f"the decision's budget {d.budget_bytes} bytes, reserve {d.reserve} is not "
                                          f"the one the frontier judged against ({fr.budget_bytes} bytes, "
                                          f"{fr.reserve})"))
    return out + _peak_arithmetic(d) + _device_findings(receipt)


def _device_findings(receipt: Receipt) -> list[CheckFinding]:
    """A blocked receipt states the device it did not fit; no budget lies above the device's capacity;
    the control was verified at a batch under the target (NOTE [blocked receipt])."""
    d, device, blocked = receipt.decision, receipt.context.device_memory_bytes, receipt.blocked
    out = []
    if blocked is not None and device is None:
        out.append(_f(FindingKind.BUDGET, "the plan records a blocked step but the receipt states no device memory"))
    if device is not None and d.budget_bytes > device:
        out.append(_f(FindingKind.BUDGET, f"budget {d.budget_bytes} bytes is above the device memory {device} bytes"))
    if blocked is not None and not 1 <= blocked.verified_batch < blocked.target_batch:
        out.append(_f(FindingKind.BUDGET, f"the blocked step was verified at batch {blocked.verified_batch}, not a "
                                          f"batch under its target {blocked.target_batch}"))
    return out


# -- records ---------------------------------------------------------------------------------------

def _frontier_records(receipt: Receipt, described: list[str]) -> list[CheckFinding]:
    fr, d = receipt.frontier, receipt.decision
    if fr is None or d.status is not ShipStatus.SHIP:
        return []
    out = []
    shipped = fr.shipped
    if shipped is None or shipped.plan != d.shipped or receipt.plan.label != d.shipped:
        out.append(_f(FindingKind.RECORDS, f"the decision ships {d.shipped!r}, the plan is labelled "
                                           f"{receipt.plan.label!r}, the frontier ships "
                                           f"{None if shipped is None else shipped.plan!r}"))
    elif shipped.boundaries != described:
        out.append(_f(FindingKind.RECORDS, f"the shipped frontier point checkpoints {shipped.boundaries}, the plan "
                                           f"{described}"))
    plan = receipt.plan.plan
    if plan is not None and (fr.shipped_plan is None or fr.shipped_plan.to_json() != plan.to_json()):
        out.append(_f(FindingKind.RECORDS, "the plan differs from the plan the frontier measured and shipped"))
    return out


def record_findings(receipt: Receipt) -> list[CheckFinding]:
    """The plan's boundaries against the boundary records, the decision and the frontier."""
    plan = receipt.plan.plan
    if plan is None:
        return []
    out = []
    for b, r in zip(plan.boundaries, receipt.plan.boundaries):   # same modules, in order (Receipt.from_json)
        theirs = (b.mode, b.guarded, b.saved_bytes)
        ours = (r.mode, r.guarded, r.predicted_saving_bytes)
        if theirs != ours:
            out.append(_f(FindingKind.RECORDS, f"boundary {b.module}: the plan says mode {b.mode.value}, guarded "
                                               f"{b.guarded}, saving {b.saved_bytes} bytes; its record says mode "
                                               f"{r.mode.value}, guarded {r.guarded}, saving "
                                               f"{r.predicted_saving_bytes} bytes", b.module))
    described = [f"{b.module}:{b.mode.value}" for b in plan.boundaries]
    d = receipt.decision
    if d.status is ShipStatus.SHIP and d.boundaries != described:
        out.append(_f(FindingKind.RECORDS, f"the decision ships {d.boundaries}, the plan {described}"))
    return out + _frontier_records(receipt, described)


# -- fixtures --------------------------------------------------------------------------------------

def _over(name: str, value: int, most: int) -> CheckFinding:
    return _f(FindingKind.FIXTURE, f"{name} is {value}, more than the {most} check runs (raise max-seeds / "
                                   "max-steps in [tool.remat] if that is meant)")


def _tolerance_findings(receipt: Receipt) -> list[CheckFinding]:
    """The verification ran under the context's autocast, and every fixture states the tolerance it used."""
    v, ctx = receipt.verification, receipt.context
    if v is None:
        return []
    out = []
    if v.autocast != ctx.autocast:
        out.append(_f(FindingKind.FIXTURE, f"the verification ran with autocast {v.autocast}, the receipt's context "
                                           f"says {ctx.autocast}"))
    used = v.tolerances.get(ctx.dtype)
    for r in receipt.plan.boundaries:
        if used is not None and r.fixture.tolerance != used:
            out.append(_f(FindingKind.FIXTURE, f"boundary {r.module}: fixture tolerance rtol {r.fixture.tolerance.rtol:g} "
                                               f"atol {r.fixture.tolerance.atol:g} is not the verification's for "
                                               f"{ctx.dtype} (rtol {used.rtol:g}, atol {used.atol:g})", r.module))
    return out


def fixture_findings(receipt: Receipt, limits: FixtureLimits) -> list[CheckFinding]:
    s, ctx = receipt.settings, receipt.context
    out = []
    if s.verify_seeds > limits.max_seeds:
        out.append(_over("verify_seeds", s.verify_seeds, limits.max_seeds))
    for name in ("verify_steps", "frontier_steps", "frontier_warmup", "saving_warmup"):
        if getattr(s, name) > limits.max_steps:
            out.append(_over(name, getattr(s, name), limits.max_steps))
    written = (FIXTURE_NAME, tuple(range(s.verify_seeds)), s.verify_steps, ctx.dtype)
    for r in receipt.plan.boundaries:
        fx = r.fixture
        if (fx.name, fx.seeds, fx.steps, fx.dtype) != written:
            out.append(_f(FindingKind.FIXTURE, f"boundary {r.module}: fixture {fx.name} seeds {list(fx.seeds)} x "
                                               f"{fx.steps} steps in {fx.dtype}, but remat receipt writes "
                                               f"{FIXTURE_NAME} seeds {list(written[1])} x {s.verify_steps} steps "
                                               f"in {ctx.dtype} from these settings", r.module))
    v = receipt.verification
    out += _tolerance_findings(receipt)
    if v is not None and (v.steps, list(v.seeds)) != (s.verify_steps, list(range(s.verify_seeds))):
        out.append(_f(FindingKind.FIXTURE, f"the verification ran seeds {list(v.seeds)} x {v.steps} steps, the "
                                           f"settings say {s.verify_seeds} x {s.verify_steps}"))
    return out


# -- claimed figures -------------------------------------------------------------------------------

def _point_findings(fr: FrontierReport) -> list[CheckFinding]:
    """Each measured point: its p50 is its samples' median, and it fits exactly when its peak clears."""
    out = []
    limit = fr.effective_budget_bytes
    for p in fr.points:
        if p.step_ms and p.p50_ms is not None and not _close(p.p50_ms, percentile(p.step_ms, 50.0), SAMPLE_REL):
            out.append(_f(FindingKind.CLAIMS, f"frontier point {p.plan}: p50 {p.p50_ms:.3f} ms is not the median "
                                              f"of its samples ({percentile(p.step_ms, 50.0):.3f} ms)"))
        if p.peak_bytes is not None and p.fits != (p.peak_bytes <= limit):
            out.append(_f(FindingKind.CLAIMS, f"frontier point {p.plan}: fits is {p.fits}, but its peak "
                                              f"{mib(p.peak_bytes)} {'is' if p.peak_bytes <= limit else 'is not'} "
                                              f"under {mib(limit)}"))
    return out


def _figure(point: FrontierPoint | None, attr: str, claimed: float | None) -> float | None:
    """The frontier point's figure; the claim itself when the frontier has no such point."""
    return claimed if point is None else getattr(point, attr)


def _overhead_arithmetic(d: ReceiptDecision) -> list[CheckFinding]:
    """The overhead (%) is (shipped p50 - control p50) / control p50."""
    c, s, o = d.control_p50_ms, d.shipped_p50_ms, d.overhead_pct
    if not c or s is None or o is None or _close(o, (s - c) / c * 100.0):
        return []
    return [_f(FindingKind.CLAIMS, f"overhead {o:+.1f}% is not (shipped p50 - control p50) / control p50 = "
                                   f"{(s - c) / c * 100.0:+.1f}%")]


def _decision_vs_points(d: ReceiptDecision, control: FrontierPoint | None,
                        shipped: FrontierPoint | None) -> list[CheckFinding]:
    """The decision's peaks (bytes), p50s (ms) and overhead (%) are the frontier points'."""
    pairs = [("control peak", d.control_peak_bytes, _figure(control, "peak_bytes", d.control_peak_bytes)),
             ("control p50", d.control_p50_ms, _figure(control, "p50_ms", d.control_p50_ms)),
             ("shipped peak", d.shipped_peak_bytes, _figure(shipped, "peak_bytes", d.shipped_peak_bytes)),
             ("shipped p50", d.shipped_p50_ms, _figure(shipped, "p50_ms", d.shipped_p50_ms)),
             ("overhead", d.overhead_pct, _figure(shipped, "overhead_pct", d.overhead_pct))]
    return [_f(FindingKind.CLAIMS, f"the decision's {name} {claimed} is not the frontier's {measured}")
            for name, claimed, measured in pairs if not _close(claimed, measured)] + _overhead_arithmetic(d)


def _same_interval(a: OverheadInterval | None, b: OverheadInterval | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.resolved == b.resolved and a.samples == b.samples and _close(a.pct, b.pct, SAMPLE_REL)
            and _close(a.low_pct, b.low_pct, SAMPLE_REL) and _close(a.high_pct, b.high_pct, SAMPLE_REL))


def _interval_findings(d: ReceiptDecision, fr: FrontierReport, control: FrontierPoint | None) -> list[CheckFinding]:
    """Every overhead interval is the one its points' own samples give (the bootstrap is seeded, so a
    recomputation is exact), and the decision's is the shipped point's (NOTE [overhead intervals]):
    an edited receipt cannot call a noisy overhead resolved."""
    out = []
    for p in fr.points:
        if p.overhead_interval is None or p is control:
            continue
        again = None if control is None else overhead_interval(p, control)
        if not _same_interval(p.overhead_interval, again):
            out.append(_f(FindingKind.CLAIMS, f"frontier point {p.plan}: overhead {p.overhead_interval.describe()} "
                                              "is not what its interleaved samples give"
                                              + ("" if again is None else f" ({again.describe()})")))
    shipped = fr.shipped
    if d.overhead_interval is not None and (shipped is None or not _same_interval(d.overhead_interval,
                                                                                 shipped.overhead_interval)):
        out.append(_f(FindingKind.CLAIMS, f"the decision's overhead {d.overhead_interval.describe()} is not the "
                                          "shipped frontier point's"))
    return out


def _verified_findings(receipt: Receipt) -> list[CheckFinding]:
    """The decision's ``verified`` is the verification report's verdict."""
    d, v = receipt.decision, receipt.verification
    if d.verified == (None if v is None else v.passed):
        return []
    return [_f(FindingKind.CLAIMS, f"verified is {d.verified}, but the verification report says "
                                   f"{'nothing' if v is None else ('passed' if v.passed else 'failed')}")]


def _shipped_findings(receipt: Receipt) -> list[CheckFinding]:
    """What ships must clear, be verified, and be needed (the control does not fit)."""
    d, plan = receipt.decision, receipt.plan.plan
    if d.status is not ShipStatus.SHIP or plan is None:
        return []
    out = []
    limit = d.effective_budget_bytes
    if d.shipped_peak_bytes is not None and d.shipped_peak_bytes > limit:
        out.append(_f(FindingKind.CLAIMS, f"the shipped peak {mib(d.shipped_peak_bytes)} does not clear the "
                                          f"effective budget {mib(limit)}, yet it ships"))
    if plan.boundaries and d.verified is not True:
        out.append(_f(FindingKind.CLAIMS, "a plan with boundaries ships unverified"))
    control = d.control_peak_bytes
    if plan.boundaries and control is not None and control <= limit:
        out.append(_f(FindingKind.CLAIMS, f"the unmodified step's peak {mib(control)} already clears the effective "
                                          f"budget {mib(limit)}, so nothing would be checkpointed; yet "
                                          f"{len(plan.boundaries)} boundaries ship"))
    return out


def claim_findings(receipt: Receipt) -> list[CheckFinding]:
    d, fr = receipt.decision, receipt.frontier
    out = []
    if fr is not None:
        control = next((p for p in fr.points if p.plan == fr.control), None)
        out += _point_findings(fr) + _decision_vs_points(d, control, fr.shipped) + _interval_findings(d, fr, control)
    out += _verified_findings(receipt) + _shipped_findings(receipt)
    for r in receipt.plan.boundaries:
        if r.saving_tolerance != receipt.settings.saving_tolerance:
            out.append(_f(FindingKind.CLAIMS, f"boundary {r.module}: saving tolerance {r.saving_tolerance} is not the "
                                              f"settings' {receipt.settings.saving_tolerance}", r.module))
    return out


# -- statements (NOTE [receipt statements]) -----------------------------------------------------------

def _st(message: str, boundary: str | None = None) -> CheckFinding:
    return _f(FindingKind.STATEMENTS, message, boundary)


def _short(text: str, n: int = 100) -> str:
    return repr(text if len(text) <= n else text[:n - 3] + "...")


def _why_findings(receipt: Receipt) -> list[CheckFinding]:
    d, fr, plan = receipt.decision, receipt.frontier, receipt.plan.plan
    if d.status is not ShipStatus.SHIP or fr is None or fr.shipped is None or plan is None:
        return []
    try:
        want = shipped_why(fr, plan, receipt.traces.target, receipt.verification, receipt.blocked,
                           receipt.plan.excluded_after_verify)
    except (AssertionError, KeyError, LookupError, TypeError, ValueError, ZeroDivisionError):
        return [_st("decision.why cannot be regenerated from the receipt's frontier and plan")]
    have = list(d.why)
    for i, line in enumerate(want):
        got = have[i] if i < len(have) else None
        ok = got is not None and (got == line or (line.startswith("Re-planned without") and got.startswith(line)))
        if not ok:
            return [_st(f"decision.why line {i + 1} is {_short(got) if got is not None else 'missing'}; the receipt's "
                        f"own data give {_short(line)}")]
    return []


def _rejected_findings(receipt: Receipt) -> list[CheckFinding]:
    d, fr = receipt.decision, receipt.frontier
    if fr is None:
        return []
    out = []
    points = {p.plan: p for p in fr.points}
    for r in d.rejected:
        p = points.get(r.plan)
        if r.decision.value == "unverified":   # the picked plan that failed verification: its reason is its own
            continue
        if p is None or (r.decision.value, r.reason, r.peak_bytes, r.p50_ms) != \
                (p.decision.value, p.reason, p.peak_bytes, p.p50_ms):
            out.append(_st(f"rejected plan {r.plan}: the decision says {r.decision.value} ({_short(r.reason)}); its "
                           f"frontier point says " + ("nothing (no such point)" if p is None else
                                                     f"{p.decision.value} ({_short(p.reason)})")))
    verdict = None if receipt.verification is None else Verdict(passed=receipt.verification.passed,
                                                                failures=tuple(receipt.verification.failures))
    try:
        again = ship_decision(fr.points, budget_bytes=fr.budget_bytes, reserve=fr.reserve, control=fr.control,
                              verdict=verdict)
    except (KeyError, LookupError, TypeError, ValueError, ZeroDivisionError):
        return out + [_st("the frontier's verdicts cannot be re-judged from its points")]
    for p, v in zip(fr.points, again.verdicts):
        # a plan judged over the step sample carries a note on its peak the frontier's one step does not give
        reason = p.reason.split(" (peak: its max over the step sample")[0]
        if (p.decision, reason) != (v.decision, v.reason):
            out.append(_st(f"frontier point {p.plan}: {p.decision.value} ({_short(p.reason)}), but its measured "
                           f"figures give {v.decision.value} ({_short(v.reason)})"))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Conditions:
    """What ``unsupported_modes`` reads of a loaded workload, from the receipt's context."""

    autocast: str | None
    dtype: str
    device: str
    shape: dict


def _unsupported_findings(receipt: Receipt) -> list[CheckFinding]:
    ctx, plan, fr = receipt.context, receipt.plan.plan, receipt.frontier
    compiled = (plan is not None and plan.compile is not None) or (fr is not None and fr.context.get("compile") is not None)
    want = unsupported_modes(_Conditions(autocast=ctx.autocast, dtype=ctx.dtype, device=ctx.device,  # type: ignore[arg-type]
                                         shape=dict(ctx.shape)),
                             plan, ctx.boundary_shape, compiled=compiled, blocked=receipt.blocked)
    have = {(u.mode, u.status, u.detail) for u in receipt.unsupported}
    out = []
    for u in want:
        if u.mode == WORLD_SIZE_MODE and receipt.world_size is not None:
            continue   # replaced by the world sizes not run (NOTE [receipt at a world size])
        if (u.mode, u.status, u.detail) not in have:
            out.append(_st(f"unsupported: the receipt leaves out or rewrites {u.mode!r} ({u.status.value}), which "
                           f"remat receipt lists for these conditions: {_short(u.detail)}"))
    return out


def _rng_findings(receipt: Receipt) -> list[CheckFinding]:
    from ..verify.runner import _rng_policy
    v, plan = receipt.verification, receipt.plan.plan
    if v is None or plan is None or v.rng_policy is None:
        return []
    rp = v.rng_policy
    out = []
    drawers = [b.module for b in v.boundaries if b.draws_rng]
    if sorted(rp.boundaries_drawing_rng) != sorted(drawers):
        out.append(_st(f"the RNG policy names {list(rp.boundaries_drawing_rng)} as drawing random numbers; the "
                       f"verification's boundary records say {drawers}"))
    want = _rng_policy(plan, list(rp.boundaries_drawing_rng))
    if (rp.preserve_rng_state, rp.policy, rp.justification) != (want.preserve_rng_state, want.policy,
                                                                 want.justification):
        out.append(_st(f"the RNG policy says {rp.policy.value}: {_short(rp.justification)}; the plan "
                       f"(preserve_rng_state={plan.preserve_rng_state}) and its drawers give {want.policy.value}: "
                       f"{_short(want.justification)}"))
    return out


def _memory_source_findings(receipt: Receipt) -> list[CheckFinding]:
    ctx = receipt.context
    want = context_memory_source(ctx.device)
    prefix = "cuda-" if ctx.device.startswith("cuda") else "cpu-"
    out = []
    traces = [("traces." + k, t) for k, t in (("target", receipt.traces.target), ("boundary", receipt.traces.boundary),
                                              ("planned", receipt.traces.planned)) if t is not None]
    for where, got in [("context", ctx.memory_source)] + [(w, t.memory_source) for w, t in traces]:
        if str(got) != want.value:
            out.append(_st(f"{where}.memory_source is {got}; a receipt made on {ctx.device} measures with {want}"))
    figures = [] if receipt.frontier is None else \
        [(f"frontier point {p.plan}", p.memory_source) for p in receipt.frontier.points if p.memory_source]
    plan = receipt.plan.plan
    if plan is not None and plan.memory_source is not None:
        figures.append(("the plan", plan.memory_source))
    for where, got in figures:
        if str(got) != MemorySource.SIMULATED.value and not str(got).startswith(prefix):
            out.append(_st(f"{where}'s memory_source is {got}, not an instrument of {ctx.device}"))
    return out


def _trace_findings(receipt: Receipt) -> list[CheckFinding]:
    out = []
    ctx = receipt.context
    named = [("traces." + k, t) for k, t in (("target", receipt.traces.target), ("boundary", receipt.traces.boundary),
                                             ("planned", receipt.traces.planned)) if t is not None]
    for where, t in named:
        if t.step_peaks and t.peak_bytes != max(t.step_peaks):
            out.append(_st(f"{where}: peak {t.peak_bytes} bytes is not the largest of its steps' peaks "
                           f"({max(t.step_peaks)} bytes)"))
        if t.memory_source is MemorySource.CPU_LIVE_TENSORS and t.categories_at_peak and \
                sum(t.categories_at_peak.values()) != t.peak_bytes:
            out.append(_st(f"{where}: peak {t.peak_bytes} bytes is not the sum of its categories at the peak "
                           f"({sum(t.categories_at_peak.values())} bytes)"))
    versions = {("context", ctx.torch_version)} | {(w, t.context.torch_version) for w, t in named}
    if receipt.frontier is not None:
        versions.add(("frontier", str(receipt.frontier.context.get("torch_version"))))
    if len({v for _, v in versions}) > 1:
        out.append(_st("the torch version differs between copies: " + ", ".join(f"{w} {v}" for w, v in sorted(versions))))
    return out


def statement_findings(receipt: Receipt) -> list[CheckFinding]:
    """The receipt's sentences and lists against what its own data give (NOTE [receipt statements])."""
    return (_why_findings(receipt) + _rejected_findings(receipt) + _unsupported_findings(receipt)
            + _rng_findings(receipt) + _memory_source_findings(receipt) + _trace_findings(receipt))


def consistency_findings(receipt: Receipt, limits: FixtureLimits) -> list[CheckFinding]:
    """Every contradiction inside ``receipt`` (NOTE [receipt consistency], NOTE [receipt statements]); [] when it
    agrees with itself."""
    return (budget_findings(receipt) + record_findings(receipt) + fixture_findings(receipt, limits)
            + claim_findings(receipt) + statement_findings(receipt))
