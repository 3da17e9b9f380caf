"""Sane and stable replay prices (NOTE [sane replay prices], [stable prices] and [prices from counts] in
remat/profile/prices.py)."""

from __future__ import annotations

import copy
import random

from remat.plan import make_plan
import math
from pathlib import Path

import pytest
import torch
from remat.profile import profile_workload
from remat.profile.prices import PRICE_GRID, calibrate_from_counts, sane_replay_prices, snap_price
from remat.simulate.costs import flop_registry, op_record
from remat.simulate.devices import DEVICE_MODELS
from remat.simulate.runtime import op_ms
from remat.types import CheckpointMode
from remat.workload import load_workload

from .test_plan import F, K, S, cand, chain_report, report, row


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


# -- NOTE [prices from counts] ------------------------------------------------------------------------

def _counted_chain(n: int, seed: int = 1):
    """n blocks of different sizes in a chain, each with recorded work (ms) in FULL and SELECTIVE: a budget that
    needs a few of them leaves the choice to the prices."""
    rng = random.Random(seed)
    mib = 2 ** 20
    cands = []
    for i in range(n):
        size = rng.randint(4, 20)
        c = cand(f"h.{i}", i, saved={F: size * mib, S: size * mib // 2}, extra={F: mib, S: mib // 2},
                 ms={F: 1.0, S: 1.0})
        c.replay_work = {F: size * rng.uniform(0.05, 0.2), S: size * rng.uniform(0.005, 0.03)}
        cands.append(c)
    names = [c.name for c in cands]
    total = 0
    rows = []
    for i, c in enumerate(cands):
        total += c.saved_bytes[F]
        rows.append(row(100 * mib + total, names[:i + 1]))
    return report(cands, rows)


def _measured(truth, rng, spread: tuple[float, float]):
    """``truth`` with every replay timed alone: 1.3 x its work, times noise drawn log-uniformly from ``spread``."""
    noisy = copy.deepcopy(truth)
    for c in noisy.candidates:
        for m in (F, S):
            c.replay_ms[m] = 1.3 * c.replay_work[m] * math.exp(rng.uniform(*map(math.log, spread)))
            c.replay_spread_ms[m] = 0.1
        c.fwd_ms = 0.0
    return noisy


def test_counted_prices_hold_the_plan_where_timed_prices_move_it():
    """NOTE [prices from counts], with injected noise: 12 profiles of one step whose replays, timed alone, read
    0.4x to 2.5x their true time (the UNet's moved 4x between two quiet profiles) all give the plan that prices
    exactly proportional to the work give (the ground truth, no noise). The wrong case: the same 12 profiles
    priced by their timings (the rule without counts, snapped) give more than one plan."""
    truth = _counted_chain(16)
    for c in truth.candidates:
        c.replay_ms = {K: 0.0, F: c.replay_work[F], S: c.replay_work[S]}
    budget = int(truth.baseline_peak_bytes * 0.75)
    expected = make_plan(truth, "optimal", budget_bytes=budget, reserve=0.0)
    assert 1 < len(expected.boundaries) < 16
    key = lambda p: tuple((b.module, b.mode) for b in p.boundaries)   # noqa: E731
    rng = random.Random(0)
    counted, timed = set(), set()
    for _ in range(12):
        noisy = _measured(truth, rng, (0.4, 2.5))
        old = copy.deepcopy(noisy)
        for c in old.candidates:
            c.replay_work = {}                   # no work recorded: timed prices, snapped (NOTE [stable prices])
        sane_replay_prices(old)
        timed.add(key(make_plan(old, "optimal", budget_bytes=budget, reserve=0.0)))
        sane_replay_prices(noisy)
        assert noisy.replay_calibration > 0.0
        counted.add(key(make_plan(noisy, "optimal", budget_bytes=budget, reserve=0.0)))
    assert counted == {key(expected)}
    assert len(timed) > 1


def test_the_calibration_is_one_snapped_median_over_every_counted_arm():
    """Hand-made arms: FULL at 2x its work on four arms and 50x on a preempted one, SELECTIVE at 3x on two: the
    median of the seven ratios is 2x (one preempted arm cannot move it), snapped: the one factor of every counted mode.
    Not evidence: arms copied from a shared measurement (the twin: with the four copies out, 50x and 3x are
    left), arms below the clock's resolution, and a simulated profile (no factor at all: 0)."""
    cands = []
    for i, (f_ratio, s_ratio) in enumerate(((2.0, 3.0), (2.0, 3.0), (2.0, None), (50.0, None), (2.0, None))):
        ms = {F: f_ratio, **({S: s_ratio} if s_ratio else {})}
        c = cand(f"b.{i}", i, saved={m: 10 for m in ms}, ms=ms)
        c.replay_work = dict.fromkeys(ms, 1.0)
        c.replay_spread_ms = dict.fromkeys(ms, 0.1)
        cands.append(c)
    rep = report(cands, [row(100)])
    assert calibrate_from_counts(rep) == snap_price(2.0)
    rep.replay_shared = {"b.0": "b.3", "b.1": "b.3", "b.2": "b.3", "b.4": "b.3"}
    assert calibrate_from_counts(rep) == snap_price(50.0)
    rep.replay_below_resolution = {"b.3": [F.value]}
    rep.replay_shared = {}
    assert calibrate_from_counts(rep) == snap_price(2.0)
    rep.simulated = True
    assert calibrate_from_counts(rep) == 0.0


def test_attention_pays_per_score_on_top_of_its_flops():
    """NOTE [attention scores], by hand: a CPU flash attention of q (2, 8, 256, 4) and k, v (2, 8, 16, 4) has
    2*8*256*16 = 65,536 scores; its time on the cpu model is its FLOPs (4 * scores * 4) at the fp32 peak plus
    2 ns a score, plus the launch; a matmul has no scores. The backward op reads q and k after the gradient."""
    cpu, reg = DEVICE_MODELS["cpu"], flop_registry()
    q, kv = torch.randn(2, 8, 256, 4), torch.randn(2, 8, 16, 4)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out = op(q, kv, kv)
    rec = op_record(op, (q, kv, kv), {}, out, reg)
    assert rec.scores == 2 * 8 * 256 * 16 and rec.flops == 4 * rec.scores * 4
    nbytes = 4 * (q.numel() + 2 * kv.numel()) + sum(4 * t.numel() for t in out if isinstance(t, torch.Tensor))
    want_s = max(rec.flops / cpu.peak_flops["float32"] + rec.scores * cpu.attention_score_s, nbytes / cpu.bandwidth)
    assert op_ms(rec, cpu) == pytest.approx((want_s + cpu.launch_overhead_s) * 1e3)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert op_record(torch.ops.aten.mm.default, (a, b), {}, a @ b, reg).scores == 0
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert op_record(bwd, (out[0], q, kv, kv, out[0], out[1]), {}, (q, kv, kv), reg).scores == 65_536


CHAIN = f"{Path(__file__).parent / 'fixtures' / 'linear_chain.py'}:build"


def test_replay_work_is_the_roofline_of_the_ops_a_replay_runs_again():
    """On a real profile: each MLP block's FULL work is, by hand, the cpu device model's roofline of its two
    addmms (2*B*D*2D FLOPs each; input, weight, bias and output bytes) plus its GELU's (bytes in and out);
    SELECTIVE's is the GELU's alone (SAC keeps the matmuls) plus SAC's cost per op of the region (5 ops: two
    ``t`` views, two addmms, the GELU); identical blocks get identical work; every counted price is the one
    calibration factor times that work."""
    B, D = 64, 256
    rep = profile_workload(load_workload(CHAIN, {"batch_size": B, "d": D}), segments=False)
    cpu = DEVICE_MODELS["cpu"]

    def addmm_s(i: int, o: int) -> float:
        flops, nbytes = 2 * B * i * o, 4 * (B * i + i * o + o + B * o)
        return max(flops / cpu.peak_flops["float32"], nbytes / cpu.bandwidth) + cpu.launch_overhead_s
    gelu_s = 4 * 2 * B * 2 * D / cpu.bandwidth + cpu.launch_overhead_s
    by = {c.name: c for c in rep.candidates}
    blocks = [by[f"blocks.{i}"] for i in range(3)]
    for b in blocks:
        assert b.replay_work[F] == pytest.approx((addmm_s(D, 2 * D) + addmm_s(2 * D, D) + gelu_s) * 1e3, rel=1e-9)
        assert b.replay_work[S] == pytest.approx((gelu_s + 5 * cpu.sac_op_s) * 1e3, rel=1e-9)
    assert len({b.replay_work[F] for b in blocks}) == 1
    k = rep.replay_calibration
    assert k > 0.0
    for c in rep.candidates:
        for m in (F, S):
            if m in c.replay_work and m in c.replay_ms and c.name not in rep.replay_composed:
                assert c.replay_ms[m] == pytest.approx(min(k * c.replay_work[m], c.replay_ms[F]))


def test_a_common_factor_leaves_the_milp_and_its_ties_unchanged():
    """NOTE [scale-free costs]: 8 identical blocks (every plan of k of them costs the same) priced at five different
    calibration factors give the MILP the same integer costs, and the same plan, ties broken alike. The ground
    truth: the integer costs are equal arrays; the milliseconds are not."""
    from remat.plan.cost import CostModel
    base = _identical_chain(8, 1.0, 0.3)
    budget = int(base.baseline_peak_bytes * 0.8)
    key = lambda p: tuple((b.module, b.mode) for b in p.boundaries)   # noqa: E731
    plans, units, ms = set(), [], []
    for factor in (1.0, 1.3, 2.7, 0.37, math.pi):
        rep = copy.deepcopy(base)
        for c in rep.candidates:
            c.replay_ms = {m: v * factor for m, v in c.replay_ms.items()}
        model = CostModel(rep)
        units.append(tuple(model.replay_units))
        ms.append(tuple(model.replay_ms))
        plans.add(key(make_plan(rep, "optimal", budget_bytes=budget, reserve=0.0)))
    assert len(set(units)) == 1 and len(set(ms)) == 5
    assert len(plans) == 1 and 0 < len(next(iter(plans))) < 8
