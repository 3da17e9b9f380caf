"""remat's one percentile (p50, p95): pure Python, so the torch-free modules (``remat.plan``, the step
sample's records) use the same definition as the device-correct clock (NOTE [device-correct timing])."""

from __future__ import annotations

from typing import Iterable


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (q in [0, 100]) by linear interpolation between closest ranks
    (numpy's default): remat's one definition of p50 and p95. ValueError for no samples."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def p50(xs: Iterable[float]) -> float:
    return percentile(xs, 50.0)


def p95(xs: Iterable[float]) -> float:
    return percentile(xs, 95.0)
