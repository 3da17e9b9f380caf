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
"""

from __future__ import annotations

import dataclasses
import math

from ..clock import percentile
from ..frontier.model import FrontierPoint, FrontierReport, OverheadInterval
from ..frontier.pareto import overhead_interval
from ..receipt.model import Receipt, ReceiptDecision, ShipStatus
from ..units import mib
from .build import FIXTURE_NAME
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


def consistency_findings(receipt: Receipt, limits: FixtureLimits) -> list[CheckFinding]:
    """Every contradiction inside ``receipt`` (NOTE [receipt consistency]); [] when it agrees with itself."""
    return (budget_findings(receipt) + record_findings(receipt) + fixture_findings(receipt, limits)
            + claim_findings(receipt))
