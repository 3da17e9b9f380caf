"""The Pareto set of (peak, p50) and the one ship decision. Pure: no torch, unit-testable on made-up points.

NOTE [ship decision]
Seed 000 asks which plan to ship: "the least expensive plan that clears the required
reserve". Here, among the points that were *measured* (planned, applied, timed):
- a point *fits* when its measured peak <= int(budget x (1 - reserve)) (bytes);
- the shipped point is the *simplest* fitting one that no other fitting point is resolved
  faster than (NOTE [resolved differences]): fitting points are tried by (number of
  boundaries, p50, peak, the order the plans were given in), and the first one that no
  fitting point beats by a resolved p50 difference ships. So a faster plan ships over a
  plan with fewer boundaries only when the difference is resolved, and the reasons say
  so either way. Without noise (points carrying no samples, or every difference resolved)
  this is the fitting point with the lowest p50 (ties: fewer boundaries, lower peak, order).
  The control (no checkpoints) ships when it fits: nothing is cheaper than not checkpointing;
- every other measured point is rejected with a reason, first that applies:
  "over budget" (peak over the effective budget; also names a dominating point if any),
  "dominated by X" (X has peak <= and p50 <= with one strictly lower),
  "slower than shipped X" (fits and is Pareto-optimal, but costs more time than X),
  "faster than shipped X ..., not resolved" (X has fewer boundaries, and the p50 gain is noise);
- a plan the planner could not make is INFEASIBLE with its floor, one that could not be
  measured is FAILED; neither is on the Pareto set.
When every difference is resolved the shipped point is on the Pareto set: a point
dominating it would fit (its peak is no higher) and be no slower. When a simpler plan wins
on noise it may sit a hair off the set; its reason says which plan was faster by how much.
This is one pure function, ``ship_decision``: it reads the points, each plan's max over the
step sample where one was measured (judged instead of its first-step peak: NOTE [ship over the
sample] in workflow/build.py) and the verdict of the picked plan's verification (a failed one
ships nothing: NOTE [receipt decision] in workflow/build.py), and returns a ``ShipDecision``.
Nothing is changed once it is decided: ``ShipDecision.points`` gives new points as it judged them,
which the frontier's report and the receipt hold.

NOTE [resolved differences]
Two plans' warm step times come from one interleaved round-robin (NOTE [interleaved
timing]): sample i of every plan ran in round i, so the samples are *paired*. The p50
difference ``p50(a) - p50(b)`` is resolved when its 95% bootstrap confidence interval
(``scipy.stats.bootstrap``, rounds resampled jointly when paired, percentile method,
2000 resamples, a fixed seed so the same samples always give the same call) excludes
zero and, for paired samples, a two-sided sign test on the per-round differences rejects
"either plan is as likely to be faster in a round" at the same level (with n rounds
the bootstrap alone calls noise resolved whenever all n differences share a sign, 1 in 8 at
n = 4; the sign test needs at least 6 rounds all one way, or 9 of 10). Fewer than
``MIN_SAMPLES`` samples never resolve a difference. Points made without
samples (``step_ms`` empty: made-up data) compare their
p50s as exact figures.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from ..clock import p50_along
from ..percentile import percentile
from ..units import mib
from .model import Decision, FrontierPoint, OverheadInterval, describe_overhead, unresolved_why

MIN_SAMPLES = 3          # fewer never resolve a difference (NOTE [resolved differences])
CONFIDENCE = 0.95
N_RESAMPLES = 2000
SEED = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class P50Difference:
    """``p50(a) - p50(b)`` in ms with its bootstrap confidence interval (NOTE [resolved differences])."""

    diff_ms: float
    low_ms: float              # CI bounds (nan when there were too few samples)
    high_ms: float
    resolved: bool             # the interval excludes zero
    samples: int               # the fewer of the two sample counts

    def describe(self) -> str:
        if math.isnan(self.low_ms):
            return f"{self.diff_ms:+.2f} ms from {self.samples} samples (fewer than {MIN_SAMPLES}: not resolvable)"
        why = "" if self.resolved or self.low_ms <= 0.0 <= self.high_ms else \
            "; " + unresolved_why(self.low_ms, self.high_ms, self.samples)
        return (f"{self.diff_ms:+.2f} ms, {CONFIDENCE:.0%} CI [{self.low_ms:+.2f}, {self.high_ms:+.2f}] ms "
                f"over {self.samples} interleaved steps{why}")


def _median_diff(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return p50_along(a, axis=axis) - p50_along(b, axis=axis)


def p50_difference(a: Sequence[float], b: Sequence[float], *, confidence: float = CONFIDENCE,
                   n_resamples: int = N_RESAMPLES, seed: int = SEED) -> P50Difference:
    """Bootstrap CI of ``p50(a) - p50(b)`` (paired when the lengths agree: interleaved rounds)."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.size == 0 or xb.size == 0:
        raise ValueError("p50_difference needs samples on both sides")
    diff = percentile(xa.tolist(), 50.0) - percentile(xb.tolist(), 50.0)
    n = int(min(xa.size, xb.size))
    if n < MIN_SAMPLES:
        return P50Difference(diff_ms=diff, low_ms=math.nan, high_ms=math.nan, resolved=False, samples=n)
    if np.ptp(np.concatenate([xa, xb])) == 0.0:
        return P50Difference(diff_ms=diff, low_ms=diff, high_ms=diff, resolved=diff != 0.0, samples=n)
    from scipy import stats   # imported here: scipy.stats costs ~1 s at start-up, and most commands never decide
    res = stats.bootstrap((xa, xb), _median_diff, paired=xa.size == xb.size, vectorized=True,
                          confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                          random_state=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    resolved = lo > 0.0 or hi < 0.0
    if resolved and xa.size == xb.size:
        # the rounds must also agree in sign (NOTE [resolved differences]): with n paired rounds a
        # percentile bootstrap excludes zero whenever all n differences share a sign, which noise
        # alone does with probability 2^(1 - n) (1 in 8 at n = 4)
        d = xa - xb
        wins, n_signed = int((d > 0).sum()), int((d != 0).sum())
        resolved = bool(n_signed > 0 and stats.binomtest(wins, n_signed, 0.5).pvalue < 1.0 - confidence)
    return P50Difference(diff_ms=diff, low_ms=lo, high_ms=hi, resolved=resolved, samples=n)

def overhead_interval(p: FrontierPoint, ctrl: FrontierPoint) -> OverheadInterval | None:
    """``p``'s overhead against ``ctrl`` with the CI of their p50 difference (NOTE [overhead intervals]);
    None when either has no timed samples."""
    if not p.step_ms or not ctrl.step_ms or not ctrl.p50_ms:
        return None
    d = p50_difference(p.step_ms, ctrl.step_ms)
    scale = 100.0 / ctrl.p50_ms
    known = not math.isnan(d.low_ms)
    return OverheadInterval(pct=(p.p50_ms - ctrl.p50_ms) * scale if p.p50_ms is not None else d.diff_ms * scale,
                            low_pct=d.low_ms * scale if known else None, high_pct=d.high_ms * scale if known else None,
                            resolved=d.resolved, samples=d.samples)


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` = (peak, p50) dominates ``b``: no worse in both, strictly better in one."""
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


def pareto_flags(xy: Sequence[tuple[float, float]]) -> list[bool]:
    """For each (peak, p50): True when no other pair dominates it (equal pairs are both kept)."""
    return [not any(dominates(q, p) for j, q in enumerate(xy) if j != i) for i, p in enumerate(xy)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplePeak:
    """A plan's peak over the step sample: the max over its points (bytes) and the point that reached it
    (NOTE [ship over the sample] in workflow/build.py)."""

    peak_bytes: int
    at: str                    # the sample point's label

    def describe(self) -> str:
        return f"{mib(self.peak_bytes)} at {self.at}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """The verification of the picked point's plan (NOTE [receipt decision] in workflow/build.py)."""

    passed: bool
    failures: tuple[str, ...] = ()   # why it failed, one line each


@dataclasses.dataclass(frozen=True, kw_only=True)
class PointVerdict:
    """What the decision says about one point; each field is the FrontierPoint field of that name."""

    plan: str
    peak_bytes: int | None     # the peak judged: its max over the step sample where one was measured
    fits: bool
    pareto: bool
    overhead_pct: float | None
    overhead_interval: OverheadInterval | None
    decision: Decision
    reason: str

    def fields(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShipDecision:
    """The one ship decision (NOTE [ship decision]): a verdict per point, which point ships, or why none does."""

    limit: int                           # budget x (1 - reserve), bytes
    verdicts: tuple[PointVerdict, ...]   # one per point, in the order the points were given
    picked: str | None                   # the point the measurements ship (None: no measured point fits)
    shipped: str | None                  # ``picked``, unless its plan failed verification
    unverified: str | None = None        # why ``picked`` does not ship: "failed verification: ..."
    sample_miss: str = ""                # why nothing ships over the step sample, or ""

    def points(self, points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
        """New points: each of ``points`` as this decision judged it (the points given are not changed)."""
        return [dataclasses.replace(p, **v.fields()) for p, v in zip(points, self.verdicts, strict=True)]


def ship_decision(points: Sequence[FrontierPoint], *, budget_bytes: int, reserve: float,
                  control: str | None = "none", sample_peaks: Mapping[str, SamplePeak] | None = None,
                  verdict: Verdict | None = None) -> ShipDecision:
    """The ship decision (NOTE [ship decision]), pure: ``points`` are read, never changed.

    ``sample_peaks``: label -> that plan's max over the step sample, judged instead of the peak
    the frontier measured at the sample's first point (NOTE [ship over the sample] in
    workflow/build.py). ``verdict``: the verification of the picked point's plan; a failed one
    ships nothing (NOTE [receipt decision] in workflow/build.py). Points that are not measured
    keep their INFEASIBLE/FAILED decision and reason."""
    sampled = dict(sample_peaks or {})
    limit = int(budget_bytes * (1.0 - reserve))
    judged = [p if p.plan not in sampled else dataclasses.replace(p, peak_bytes=sampled[p.plan].peak_bytes)
              for p in points]
    picked, verdicts = _judge(judged, limit, control, sampled,
                              clears=f"{mib(limit)} (budget {mib(budget_bytes)} less {reserve:.0%} reserve)")
    unverified = None if picked is None or verdict is None or verdict.passed else \
        "failed verification: " + "; ".join(verdict.failures[:3])
    return ShipDecision(limit=limit, verdicts=verdicts, picked=picked,
                        shipped=None if unverified is not None else picked, unverified=unverified,
                        sample_miss="" if picked is not None else _sample_miss(sampled, limit))


def _sample_miss(sampled: Mapping[str, SamplePeak], limit: int) -> str:
    """Why nothing ships when the plans measured over the step sample missed there (else "")."""
    missed = [f"{k}: {s.describe()}" for k, s in sampled.items() if s.peak_bytes > limit]
    if not missed:
        return ""
    return (f"every plan the frontier would ship misses over the step sample ({'; '.join(missed)}), "
            f"over the {mib(limit)} limit, though the frontier's one step cleared it (NOTE [step sample])")


def _judge(points: list[FrontierPoint], limit: int, control: str | None, sampled: Mapping[str, SamplePeak], *,
           clears: str) -> tuple[str | None, tuple[PointVerdict, ...]]:
    """(the label that ships, a verdict per point) on the peaks ``points`` carry (NOTE [ship decision]);
    the reason of a point in ``sampled`` says its peak is its max over the step sample."""
    measured = [p for p in points if p.measured]
    ctrl = next((p for p in measured if p.plan == control), None)
    xy = [(float(p.peak_bytes), float(p.p50_ms)) for p in measured]  # type: ignore[arg-type]
    pareto = {id(p): flag for p, flag in zip(measured, pareto_flags(xy))}
    fits = {id(p): p.peak_bytes <= limit for p in measured}  # type: ignore[operator]
    order = {id(p): i for i, p in enumerate(points)}
    shipped, beaten = _ship([p for p in measured if fits[id(p)]], order)
    verdicts = []
    for p in points:
        pct, interval = _overhead(p, ctrl)
        decision, reason = p.decision, p.reason
        if p is shipped:
            decision = Decision.SHIP
            reason = _ship_reason(p, beaten, pct, interval, vs_control=p is not ctrl, clears=clears)
        elif id(p) in fits:
            decision = Decision.REJECT
            reason = _reject_reason(p, fits[id(p)], shipped, beaten, _dominator(p, measured, shipped, order), limit)
        verdicts.append(PointVerdict(plan=p.plan, peak_bytes=p.peak_bytes, fits=fits.get(id(p), False),
                                     pareto=pareto.get(id(p), False), overhead_pct=pct, overhead_interval=interval,
                                     decision=decision, reason=reason + _sampled_note(sampled.get(p.plan))))
    return None if shipped is None else shipped.plan, tuple(verdicts)


def _sampled_note(peak: SamplePeak | None) -> str:
    return "" if peak is None else f" (peak: its max over the step sample, {peak.describe()}; NOTE [step sample])"


def decide(points: Sequence[FrontierPoint], *, budget_bytes: int, reserve: float,
           control: str | None = "none") -> tuple[list[FrontierPoint], FrontierPoint | None]:
    """The frontier's own decision (``ship_decision``, no sample and no verification yet): (new points,
    each with ``fits``, ``pareto``, ``overhead_pct``, ``overhead_interval``, ``decision`` and ``reason``
    as it judged them; the shipped one among them, or None when no measured point fits). ``points``
    are not changed. See NOTE [ship decision]."""
    judged = ship_decision(points, budget_bytes=budget_bytes, reserve=reserve, control=control).points(points)
    return judged, next((p for p in judged if p.decision is Decision.SHIP), None)


def _overhead(p: FrontierPoint, ctrl: FrontierPoint | None) -> tuple[float | None, OverheadInterval | None]:
    """``p``'s overhead (%) against the control and its interval; as ``p`` carries them when there is
    no control p50 to compare with."""
    if ctrl is None or p.p50_ms is None or not ctrl.p50_ms:
        return p.overhead_pct, p.overhead_interval
    pct = (p.p50_ms - ctrl.p50_ms) / ctrl.p50_ms * 100.0
    return pct, None if p is ctrl else overhead_interval(p, ctrl)


def _dominator(p: FrontierPoint, measured: list[FrontierPoint], shipped: FrontierPoint | None,
               order: dict[int, int]) -> FrontierPoint | None:
    """The point a reason names as dominating ``p``: the shipped one if it does, else the fastest."""
    at = (p.peak_bytes, p.p50_ms)
    doms = [q for q in measured if q is not p and dominates((q.peak_bytes, q.p50_ms), at)]  # type: ignore[arg-type]
    if shipped is not None and shipped in doms:
        return shipped
    return min(doms, key=lambda q: (q.p50_ms, q.peak_bytes, order[id(q)]), default=None)


def _ship_reason(p: FrontierPoint, beaten: list[tuple[FrontierPoint, P50Difference]], pct: float | None,
                 interval: OverheadInterval | None, *, vs_control: bool, clears: str) -> str:
    vs = f", {describe_overhead(pct, interval)} vs control" if pct is not None and vs_control else ""
    if not beaten:
        return f"lowest p50 ({p.p50_ms:.2f} ms{vs}) among plans whose measured peak clears {clears}"
    fastest, d = beaten[0]
    return (f"fewest boundaries ({len(p.boundaries)}) among plans whose measured peak clears {clears} "
            f"and that no plan beats by a resolved p50 difference: p50 {p.p50_ms:.2f} ms{vs}; the "
            f"fastest, {fastest.plan} ({len(fastest.boundaries)} boundaries), differs by "
            f"{d.describe()}, not resolved")


def _reject_reason(p: FrontierPoint, fits: bool, shipped: FrontierPoint | None,
                   beaten: list[tuple[FrontierPoint, P50Difference]], dom: FrontierPoint | None, limit: int) -> str:
    """The first reason that applies (NOTE [ship decision]): over budget, faster but not resolved,
    dominated, slower than shipped."""
    if not fits:
        reason = f"over budget: peak {mib(p.peak_bytes)} > {mib(limit)}"  # type: ignore[arg-type]
        return reason if dom is None else reason + f"; also dominated by {dom.plan}"
    assert shipped is not None  # p fits, so something ships
    d = next((d for q, d in beaten if q is p), None)
    if d is not None:
        return (f"faster than shipped {shipped.plan} by {-d.diff_ms:.2f} ms, not resolved "
                f"({d.describe()}): {shipped.plan} has fewer boundaries "
                f"({len(shipped.boundaries)} vs {len(p.boundaries)})")
    if dom is not None:
        peaks = f"{mib(dom.peak_bytes)} <= {mib(p.peak_bytes)}"  # type: ignore[arg-type]
        return (f"dominated by {dom.plan} (peak {peaks}, "
                f"p50 {dom.p50_ms:.2f} <= {p.p50_ms:.2f} ms)")
    slower = (p.p50_ms - shipped.p50_ms) / shipped.p50_ms * 100.0 if shipped.p50_ms else 0.0  # type: ignore[operator]
    return (f"slower than shipped {shipped.plan}: p50 {p.p50_ms:.2f} ms vs {shipped.p50_ms:.2f} ms "
            f"({slower:+.1f}%), for a lower peak than it needs")


def _resolved_faster(q: FrontierPoint, p: FrontierPoint) -> tuple[bool, P50Difference | None]:
    """Is ``q`` faster than ``p`` by a resolved p50 difference? (exact p50s when either lacks samples)"""
    if not q.step_ms or not p.step_ms:
        return q.p50_ms < p.p50_ms, None  # type: ignore[operator]
    d = p50_difference(q.step_ms, p.step_ms)
    return d.resolved and d.diff_ms < 0.0, d


def _ship(fitting: list[FrontierPoint], order: dict[int, int]
          ) -> tuple[FrontierPoint | None, list[tuple[FrontierPoint, P50Difference]]]:
    """The shipped point (NOTE [ship decision]) and the faster fitting points it was preferred to,
    fastest first, each with its unresolved difference to the shipped point (q minus shipped)."""
    if not fitting:
        return None, []
    by_speed = sorted(fitting, key=lambda p: (p.p50_ms, len(p.boundaries), p.peak_bytes, order[id(p)]))
    for c in sorted(fitting, key=lambda p: (len(p.boundaries), p.p50_ms, p.peak_bytes, order[id(p)])):
        beaten: list[tuple[FrontierPoint, P50Difference]] = []
        for q in by_speed:
            if q is c or q.p50_ms >= c.p50_ms:  # type: ignore[operator]
                continue
            faster, d = _resolved_faster(q, c)
            if faster:
                break
            if d is not None:
                beaten.append((q, d))
        else:
            return c, beaten
    return by_speed[0], []  # unreachable in practice: nothing is resolved faster than the fastest
