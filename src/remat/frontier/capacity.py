"""Capacity search: the largest value of a shape keyword whose measured peak fits. Pure.

NOTE [capacity search]
``search_capacity(measure, start=..., limit_bytes=..., max_value=..., max_tries=...)``
finds the largest integer v <= max_value with ``measure(v).fits(limit_bytes)``, assuming
the peak does not decrease as v grows (true of batch size and sequence length).
- Start at ``start`` (the workload's current value, capped at max_value). If it fits,
  double until a value does not fit or max_value is reached (max_value fitting ends the
  search: ``capped``). If it does not fit, halve until one fits or 1 does not (then the
  capacity is 0).
- Then bisect between the largest fitting and the smallest failing value until they
  are ``granularity`` apart or closer (``resolved``; granularity 1, the default, means
  adjacent: the exact capacity) or ``max_tries`` probes have been made. Bisection points
  are rounded down to a multiple of ``granularity`` (a batch of 2048 need not be resolved
  to the sample). The capacity is always a value that was measured to fit (or 0), never
  an interpolation.
- An out-of-memory is a data point: ``measure`` returns a ``CapacityTry`` with
  ``oom=True`` (the caller turns CUDA OOM, or the CPU tracker seeing the limit crossed,
  into that), and the search treats it as "does not fit". Any other failure
  (``error`` set, e.g. the plan's modules do not exist at that shape) ends the search
  with a ``note``: it is not evidence about memory, so no bound is inferred from it.
- The reserve: the frontier stops a probe only past the budget itself, and judges it against the
  budget less its reserve, so a value that measured under the budget but inside the reserve is
  a measured miss, not an out-of-memory; the tables say what the reserve costs
  (``CapacityResult.inside_reserve``: "12 (14 inside the reserve)").
- ``first`` lets the caller hand in a probe it already made at ``start`` (the frontier
  measured every plan at the base shape), saving one measurement.
Bounded: at most ``max_tries`` calls of ``measure`` (a handed-in ``first`` counts as one).
"""

from __future__ import annotations

from typing import Callable

from ..errors import RematError
from .model import CapacityResult, CapacityTry

MeasureFn = Callable[[int], CapacityTry]


def search_capacity(measure: MeasureFn, *, key: str, start: int, limit_bytes: int, max_value: int,
                    max_tries: int = 8, first: CapacityTry | None = None, granularity: int = 1) -> CapacityResult:
    """Largest ``key`` value whose measured peak <= ``limit_bytes`` (bytes); see NOTE [capacity search]."""
    if start < 1 or max_value < 1 or max_tries < 1 or granularity < 1:
        raise RematError(f"capacity search needs start >= 1, max_value >= 1, max_tries >= 1 and granularity >= 1; "
                         f"got start={start}, max_value={max_value}, max_tries={max_tries}, granularity={granularity}")
    tries: list[CapacityTry] = []
    lo, hi = 0, None          # lo: largest value known to fit (0: none); hi: smallest known not to
    note = ""

    def probe(v: int) -> bool | None:
        """True/False: fits or not; None: an error ended the search."""
        nonlocal lo, hi, note
        t = first if (first is not None and not tries and v == first.value) else measure(v)
        if t.value != v:
            raise RematError(f"capacity measure returned a try for {key}={t.value}, asked for {v}")
        tries.append(t)
        if t.error is not None:
            note = f"stopped at {key}={v}: {t.error}"
            return None
        if t.fits(limit_bytes):
            lo = max(lo, v)
            return True
        hi = v if hi is None else min(hi, v)
        return False

    v = min(start, max_value)
    ok = probe(v)
    while ok is not None and len(tries) < max_tries:
        if hi is None:                     # everything tried fits: grow
            if lo >= max_value:
                break
            ok = probe(min(2 * lo, max_value))
        elif lo == 0:                      # nothing fits yet: shrink
            if hi <= 1:
                break
            ok = probe(hi // 2)
        elif hi - lo > granularity:        # bracketed: bisect
            mid = (lo + hi) // 2
            mid = max(lo + 1, mid - mid % granularity)
            ok = probe(mid)
        else:
            break
    capped = hi is None and lo >= max_value
    resolved = capped or (hi is not None and hi - lo <= granularity)
    if not resolved and not note:
        bound = "unknown" if hi is None else str(hi)
        note = f"max_tries={max_tries} reached: capacity is at least {lo}, the first failing value {bound}"
    return CapacityResult(key=key, capacity=lo, resolved=resolved, capped=capped, limit_bytes=limit_bytes,
                          tries=tuple(tries), note=note)
