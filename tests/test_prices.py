"""Sane and stable replay prices (NOTE [sane replay prices], NOTE [stable prices] in remat/profile/prices.py)."""

from __future__ import annotations

import copy
import random

from remat.plan import make_plan
from remat.profile.prices import PRICE_GRID, sane_replay_prices, snap_price
from remat.types import CheckpointMode

from .test_plan import F, S, cand, chain_report, report, row


def test_replay_prices_are_bounded_by_the_forward_and_the_parent():
    """A FULL replay priced under the module's own forward is raised to it; a child priced above its parent is
    lowered to the parent's; a selective mode never above FULL. The safe twin: sane prices stay, up to the grid."""
    rep = chain_report(3, 0)
    a, b, c = rep.candidates
    a.fwd_ms, a.replay_ms[F] = 2.0, 0.00014                    # "free": a timing artefact
    b.fwd_ms, b.replay_ms[F], b.replay_ms[S] = 1.0, 1.5, 9.0   # selective above full
    c.parent, c.fwd_ms, c.replay_ms[F] = b.name, 0.5, 152.0    # a child above its parent
    sane = chain_report(3, 0)
    for x in sane.candidates:
        x.fwd_ms = 0.1
    before = [dict(x.replay_ms) for x in sane.candidates]
    sane_replay_prices(rep)
    sane_replay_prices(sane)
    assert a.replay_ms[F] == snap_price(2.0) and 0.9 * 2.0 <= a.replay_ms[F] <= 1.1 * 2.0
    assert b.replay_ms[S] == b.replay_ms[F] == snap_price(1.5)
    assert c.replay_ms[F] == b.replay_ms[F]
    after = [dict(x.replay_ms) for x in sane.candidates]
    assert [{m: snap_price(v) for m, v in d.items()} for d in before] == after
    assert all(abs(after[i][m] - before[i][m]) <= 0.1 * before[i][m] for i in range(3) for m in before[i])


def test_a_composed_segment_stays_its_members_sum_after_the_bounds():
    """NOTE [composed segment replays] survives the bounds (the reverted first attempt broke it): a member raised
    to its forward raises the segment with it. Ground truth: the sum of the members' bounded prices."""
    rep = report([cand("h.0", 0, saved={F: 10}, ms={F: 0.001}), cand("h.1", 1, saved={F: 10}, ms={F: 3.0}),
                  cand("h[0:2]", 2, saved={F: 20}, ms={F: 3.001})], [row(100, live=("h.0", "h.1", "h[0:2]"))])
    rep.candidates[0].fwd_ms = 2.0
    rep.replay_composed["h[0:2]"] = ["h.0", "h.1"]
    sane_replay_prices(rep)
    h0, h1, seg = rep.candidates
    assert h0.replay_ms[F] == snap_price(2.0)
    assert seg.replay_ms[F] == h0.replay_ms[F] + h1.replay_ms[F] > 3.001 * 1.2


def test_identical_blocks_take_one_forward_bound():
    """Candidates sharing one measurement (NOTE [shared replay measurements]) are bounded by their group's median
    forward, so they price alike though their own forwards were timed apart. The twin: a block alone keeps its own."""
    rep = report([cand(f"h.{i}", i, saved={F: 10}, ms={F: 0.001}) for i in range(4)], [row(100)])
    for c, fwd in zip(rep.candidates, (1.0, 1.3, 0.9, 5.0)):
        c.fwd_ms = fwd
    rep.replay_shared.update({"h.1": "h.0", "h.2": "h.0"})
    sane_replay_prices(rep)
    prices = [c.replay_ms[F] for c in rep.candidates]
    assert prices[0] == prices[1] == prices[2] == snap_price(1.0)
    assert prices[3] == snap_price(5.0)


def _identical_chain(n: int, ms: float, selective_ms: float):
    """n identical blocks in a chain, each saving 10 MiB at 1 ms forward: a budget that needs k of them leaves the
    planner a free choice of which, decided by prices alone."""
    mib = 2 ** 20
    cands = [cand(f"h.{i}", i, saved={F: 10 * mib, S: 5 * mib}, extra={F: mib, S: mib // 2}, ms={F: ms, S: selective_ms})
             for i in range(n)]
    names = [c.name for c in cands]
    rows = [row(100 * mib + 10 * mib * (i + 1), names[:i + 1]) for i in range(n)]
    rows += [row(100 * mib + 10 * mib * (i + 1) + mib, names[:i], (names[i],)) for i in reversed(range(n))]
    return report(cands, rows)


def test_noise_in_the_replay_times_does_not_change_the_plan():
    """NOTE [stable prices], with injected noise: 12 profiles of one step whose replay times wobble by up to 7%
    around prices on the grid all give the plan of the noise-free profile. The wrong case: the raw noisy prices
    (not snapped) give more than one plan over the same 12 draws."""
    truth = _identical_chain(8, PRICE_GRID ** 2, PRICE_GRID ** -3)
    budget = int(truth.baseline_peak_bytes * 0.8)
    expected = make_plan(truth, "optimal", budget_bytes=budget, reserve=0.0)
    assert expected.boundaries and len(expected.boundaries) < 8
    key = lambda p: [(b.module, b.mode) for b in p.boundaries]   # noqa: E731
    rng = random.Random(0)
    raw_plans, stable_plans = set(), set()
    for _ in range(12):
        noisy = copy.deepcopy(truth)
        for c in noisy.candidates:
            for m in (F, S):
                c.replay_ms[m] *= rng.uniform(0.93, 1.07)
            c.fwd_ms = 0.0
        raw_plans.add(tuple(key(make_plan(noisy, "optimal", budget_bytes=budget, reserve=0.0))))
        sane_replay_prices(noisy)
        stable_plans.add(tuple(key(make_plan(noisy, "optimal", budget_bytes=budget, reserve=0.0))))
    assert stable_plans == {tuple(key(expected))}
    assert len(raw_plans) > 1


def test_snapping_never_zeroes_a_price():
    assert snap_price(0.0) == 0.0 and snap_price(1e-6) > 0.0
    assert snap_price(PRICE_GRID ** 3 * 1.05) == PRICE_GRID ** 3
    assert CheckpointMode.KEEP not in {m for m in ()}
