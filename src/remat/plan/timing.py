"""The time race's arithmetic (NOTE [time race] in remat/closed_loop.py), pure: no torch.

What a race records on the plan (:class:`TimeRace`), the paired ratio and its interval
(:func:`paired_ratio`), the verdict and what ships (:func:`race_verdict`), and the measured time
error fed back into the profile's replay prices per checkpoint mode (:func:`time_scales`,
:func:`calibrate_replay_ms`).

NOTE [paired ratio interval]
Round i of the interleaved round-robin (NOTE [interleaved timing] in remat/measure/run.py) ran one
step of remat's plan and one of the simple plan back to back, so r_i = remat_i / simple_i are
paired ratios that the machine's drift between rounds cancels out of. The figure is their median;
its interval is the distribution-free one for a median, from order statistics: with n rounds,
[r_(k), r_(n+1-k)] (sorted, 1-based) for the largest k with 2 P(Binomial(n, 1/2) < k) <= 0.05,
i.e. at least 95% confidence. It needs no resampling, so it is exact and deterministic: the same
samples always give the same call. The difference is *resolved* when the interval excludes 1. With
fewer than ``MIN_RACE_ROUNDS`` (6) rounds no k qualifies (even [min, max] covers only 1 - 2^(1-n)),
so nothing resolves; at 6 rounds a resolved difference is one all six rounds agree on (the sign
test of NOTE [resolved differences] in remat/frontier/pareto.py at the same level), at 20 rounds
the interval is [r_(6), r_(15)].
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING, Annotated, Sequence

from .._codec import JsonCodec, Len, Ms, Short
from .._json import Int, Num
from ..percentile import p50
from ..profile.model import ProfileReport
from ..types import CheckpointMode

if TYPE_CHECKING:   # model.py imports TimeRace from here
    from .model import Plan

MIN_RACE_ROUNDS = 6            # NOTE [paired ratio interval]: fewer never resolve at 95%
RACE_CONFIDENCE = 0.95
# a measured/predicted time factor outside these is not believed: the prediction stands (NOTE [time race])
TIME_SCALE_BOUNDS = (0.25, 4.0)

Ratio = Annotated[float, Num(0, 1e6)]


class RaceVerdict(enum.Enum):
    """remat's plan against the fastest simple plan that fits (NOTE [time race])."""

    WON = "won"              # resolved faster: remat's plan ships
    LOST = "lost"            # resolved slower: the simple plan ships
    TIE = "tie"              # not resolved: the simpler ships
    SAME = "same"            # the simple plan is remat's plan: nothing to race
    UNTIMED = "untimed"      # the arms could not run side by side (out of memory): remat's plan ships


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimeRace(JsonCodec):
    """What the time race measured (NOTE [time race] in remat/closed_loop.py); ``ratio`` < 1: remat's plan faster."""

    simple: Short                    # the simple plan's spec: "first-k:2", "uniform:2", "checkpoint_sequential:3", "all"
    simple_boundaries: Annotated[int, Int(0, 100_000)]
    verdict: RaceVerdict
    shipped_simple: bool             # the simple plan shipped (lost, or a tie with the simpler)
    rounds: Annotated[int, Int(0, 100_000)]   # interleaved timed rounds (0: not timed)
    ratio: Ratio = 1.0               # median over rounds of remat's step / the simple plan's (NOTE [paired ratio interval])
    low: Ratio = 1.0                 # its interval (at least 95%)
    high: Ratio = 1.0
    remat_ms: Ms = 0.0               # p50 warm step times over the rounds (ms)
    simple_ms: Ms = 0.0
    unplanned_ms: Ms = 0.0
    # measured / predicted added time, per checkpoint mode, fed back into the profile's replay prices
    time_scale: Annotated[tuple[tuple[CheckpointMode, Ratio], ...], Len(16)] = ()

    def describe(self) -> str:
        """One line: against what, by how much, and what shipped."""
        what = f"{self.simple} ({self.simple_boundaries} boundaries)"
        if self.verdict is RaceVerdict.SAME:
            return f"remat's plan is the simple plan {what}"
        if self.verdict is RaceVerdict.UNTIMED:
            return f"not timed against {what}: the plans did not fit side by side"
        pct = (self.ratio - 1.0) * 100.0
        interval = f"{(self.low - 1) * 100:+.1f}%..{(self.high - 1) * 100:+.1f}%"
        ship = "the simple plan shipped" if self.shipped_simple else "remat's plan shipped"
        return (f"{self.verdict.value} against {what}: remat's step {pct:+.1f}% [{interval}] over {self.rounds} "
                f"interleaved rounds; {ship}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairedRatio:
    """The median paired ratio a/b over rounds and its order-statistic interval (NOTE [paired ratio interval])."""

    ratio: float
    low: float           # the interval; [min, max] of the ratios when too few rounds to reach 95%
    high: float
    rounds: int
    resolvable: bool     # enough rounds for the interval's confidence (MIN_RACE_ROUNDS)

    @property
    def resolved(self) -> bool:
        return self.resolvable and (self.low > 1.0 or self.high < 1.0)


def order_statistic_k(n: int, confidence: float = RACE_CONFIDENCE) -> int:
    """The largest k with 2 P(Binomial(n, 1/2) < k) <= 1 - confidence; 0 when none (too few rounds)."""
    k, below = 0, 0.0          # below: P(X < k + 1) accumulated
    for j in range(n + 1):
        below += math.comb(n, j) / 2 ** n
        if 2.0 * below > 1.0 - confidence:
            break
        k = j + 1
    return min(k, (n + 1) // 2)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> PairedRatio:
    """The median of a_i / b_i over paired rounds and its interval (NOTE [paired ratio interval])."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs paired samples, got {len(a)} and {len(b)}")
    if min(b) <= 0.0 or min(a) < 0.0:
        raise ValueError("paired_ratio needs positive step times")
    ratios = sorted(x / y for x, y in zip(a, b))
    k = order_statistic_k(len(ratios))
    return PairedRatio(ratio=p50(ratios), low=ratios[max(k, 1) - 1], high=ratios[len(ratios) - max(k, 1)],
                       rounds=len(ratios), resolvable=k > 0)


def race_verdict(r: PairedRatio, remat_plan: Plan, simple: Plan) -> tuple[RaceVerdict, bool]:
    """(verdict, ship the simple plan): the faster when resolved, else the simpler, i.e. the simple plan unless
    remat's has fewer boundaries (NOTE [time race])."""
    if r.resolved:
        return (RaceVerdict.WON, False) if r.high < 1.0 else (RaceVerdict.LOST, True)
    return RaceVerdict.TIE, len(simple.boundaries) <= len(remat_plan.boundaries)


def _added_by_mode(plan: Plan) -> dict[CheckpointMode, float]:
    """The plan's predicted added time (ms) per checkpoint mode."""
    out: dict[CheckpointMode, float] = {}
    for b in plan.boundaries:
        out[b.mode] = out.get(b.mode, 0.0) + b.replay_ms
    return out


def time_scales(remat_plan: Plan, remat_added_ms: float, simple: Plan, simple_added_ms: float) -> dict[CheckpointMode, float]:
    """Measured / predicted added time per checkpoint mode, from two plans' measured added times (ms over the
    unplanned step, interleaved): FULL from the simple plan (every boundary FULL), then the other modes of
    remat's plan from what FULL leaves of its measured time (one factor for them together: one equation).
    A factor outside ``TIME_SCALE_BOUNDS``, or from a prediction under 0.05 ms, is left out (NOTE [time race])."""
    out: dict[CheckpointMode, float] = {}
    simple_pred = _added_by_mode(simple)
    full_scale = _scale(simple_added_ms, simple_pred.get(CheckpointMode.FULL, 0.0)) \
        if set(simple_pred) == {CheckpointMode.FULL} else None
    if full_scale is not None:
        out[CheckpointMode.FULL] = full_scale
    pred = _added_by_mode(remat_plan)
    full_part = pred.pop(CheckpointMode.FULL, 0.0) * (full_scale if full_scale is not None else 1.0)
    other = _scale(remat_added_ms - full_part, sum(pred.values())) if pred else None
    if other is not None:
        out.update(dict.fromkeys(pred, other))
    return out


def _scale(measured_ms: float, predicted_ms: float) -> float | None:
    if predicted_ms < 0.05 or measured_ms <= 0.0:
        return None
    s = measured_ms / predicted_ms
    return s if TIME_SCALE_BOUNDS[0] <= s <= TIME_SCALE_BOUNDS[1] else None


def calibrate_replay_ms(report: ProfileReport, scales: dict[CheckpointMode, float]) -> None:
    """Scale every candidate's replay price (ms) of each mode in ``scales``, in place: the measured time error
    fed back into the cost model (NOTE [time race]), as the closed-loop margin feeds back the peak's."""
    for c in report.candidates:
        for mode, s in scales.items():
            if mode in c.replay_ms:
                c.replay_ms[mode] *= s
