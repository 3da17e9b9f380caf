"""Time intervals: unions, differences, and exposed communication.

NOTE [exposed communication]
One definition for every engine: within one training step,

    exposed = | union(communication intervals) - union(compute intervals) |

i.e. the wall time during which at least one collective was in flight and the rank's main
thread ran no compute op. Communication intervals are (start, end) of each collective as
stamped by the engine's comm hook (see NOTE [collective timing] in instrument.py); compute
intervals are the (start, end) of each operator the rank's own thread dispatched, c10d ops
excluded (see ComputeTimer). A collective that fully overlaps backward compute is hidden
(exposed 0); the wait for the last gradient bucket at the end of backward, or a blocking
reduce-scatter, is exposed. All times are ``time.perf_counter_ns`` of the same process.
"""

from __future__ import annotations

from typing import Iterable

Interval = tuple[int, int]  # (start_ns, end_ns), end >= start


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the input (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """union(a) minus union(b), as sorted disjoint intervals."""
    ua, ub = union(a), union(b)
    out: list[Interval] = []
    j = 0
    for s, e in ua:
        cur = s
        while j < len(ub) and ub[j][1] <= cur:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < e:
            bs, be = ub[k]
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def total_ns(intervals: Iterable[Interval]) -> int:
    return sum(e - s for s, e in union(intervals))


def exposed_ns(comm: Iterable[Interval], compute: Iterable[Interval]) -> int:
    """NOTE [exposed communication]: communication time not hidden under compute, in ns."""
    return sum(e - s for s, e in subtract(comm, compute))
