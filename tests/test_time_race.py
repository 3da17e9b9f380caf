"""The closed loop's time race against the fastest simple plan (NOTE [time race] in remat/closed_loop.py) and its
paired ratio interval (NOTE [paired ratio interval] in remat/plan/timing.py), with injected step times."""

from __future__ import annotations

import copy
import math

import pytest

from remat.plan.timing import (RaceVerdict, TimeRace, order_statistic_k, paired_ratio, time_scales)
from remat.types import CheckpointMode

SHAPE = {"batch_size": 4, "seq_len": 64, "n_layer": 4, "d_model": 32, "n_head": 2, "vocab": 64}
UNPLANNED_MS = 10.0


# -- the arithmetic ---------------------------------------------------------------------------------

def test_the_order_statistic_is_the_binomial_one():
    """Ground truth by brute force: the largest k with 2 P(Bin(n, 1/2) < k) <= 0.05."""
    for n in range(1, 41):
        tail = lambda k: sum(math.comb(n, j) for j in range(k)) / 2 ** n   # noqa: E731
        want = max((k for k in range(0, n // 2 + 1) if 2 * tail(k) <= 0.05), default=0)
        assert order_statistic_k(n) == want, n
    assert order_statistic_k(5) == 0 and order_statistic_k(6) == 1 and order_statistic_k(20) == 6


def test_six_rounds_one_way_resolve_and_five_do_not():
    """A difference every round agrees on resolves at 6 rounds; at 5 it cannot (the wrong case: calling it
    resolved would be a 1-in-16 accident of noise); one round the other way at 6 is a tie."""
    slow, fast = [11.0, 11.2, 10.9, 11.1, 11.0, 11.3], [10.0] * 6
    r = paired_ratio(slow, fast)
    assert r.resolved and r.low > 1.0 and r.ratio == pytest.approx(sorted(a / 10.0 for a in slow)[2:4][0] / 2
                                                                   + sorted(a / 10.0 for a in slow)[2:4][1] / 2)
    assert not paired_ratio(slow[:5], fast[:5]).resolved
    assert not paired_ratio([*slow[:5], 9.0], fast).resolved


def test_time_scales_split_full_from_the_selective_modes():
    """FULL from the simple plan (predicted 2 ms, measured 3 ms: 1.5); the selective part of remat's plan from what
    FULL leaves (predicted 1 ms FULL + 2 ms selective, measured 1.5 + 1.0: selective 0.5)."""
    from tests.conftest import hand_plan
    from torch import nn
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    simple = hand_plan(model, ["0", "1"])
    remat_plan = hand_plan(model, ["0"])
    remat_plan.boundaries.append(dataclass_replace(remat_plan.boundaries[0], module="2", mode=CheckpointMode.SELECTIVE,
                                                   replay_ms=2.0))
    remat_plan.boundaries[0] = dataclass_replace(remat_plan.boundaries[0], replay_ms=1.0)
    simple.boundaries[:] = [dataclass_replace(b, replay_ms=1.0) for b in simple.boundaries]
    scales = time_scales(remat_plan, 2.5, simple, 3.0)
    assert scales == {CheckpointMode.FULL: pytest.approx(1.5), CheckpointMode.SELECTIVE: pytest.approx(0.5)}
    # the safe twin: a factor past 4x is not believed, and the prediction stands
    assert time_scales(remat_plan, 2.5, simple, 30.0).get(CheckpointMode.FULL) is None


def dataclass_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


# -- the race in the closed loop, timings injected ----------------------------------------------------

@pytest.fixture(scope="module")
def profiled():
    import torch
    torch.set_num_threads(1)
    from remat.profile import profile_workload
    from remat.workload import load_workload
    loaded = load_workload("gpt", SHAPE)
    return loaded, profile_workload(loaded, measure_replays=False)


def _race(monkeypatch, profiled, ratio_of_round):
    """Plan at 80% with the race on; the interleaved timer is replaced by one that returns, per round r, the
    unplanned step at 10 ms, the simple plan at 10 ms + 1.5 x its predicted added time, and remat's plan at
    ``ratio_of_round(r)`` x the simple plan's step. Returns (shipped plan, the simple plan raced, report, the
    report's FULL prices before)."""
    from remat import closed_loop
    from remat.measure import Timings
    loaded, report = profiled
    report = copy.deepcopy(report)
    before = {c.name: c.replay_ms.get(CheckpointMode.FULL) for c in report.candidates}
    raced = {}

    def fake_round_robin(runners, *, warmup, steps, progress, what):
        plans = {r.label: getattr(r.arm, "plan", None) for r in runners}
        raced["simple"] = plans["simple"]
        simple_ms = UNPLANNED_MS + 1.5 * plans["simple"].predicted_overhead_ms
        first = raced.setdefault("rounds", 0)   # rounds timed so far: a race may time more (NOTE [race extension])
        raced["rounds"] += steps
        return Timings(step_ms={"unplanned": [UNPLANNED_MS] * steps, "simple": [simple_ms] * steps,
                                "remat": [simple_ms * ratio_of_round(first + r) for r in range(steps)]},
                       num_alloc_retries={"unplanned": 0, "simple": 0, "remat": 0})

    monkeypatch.setattr(closed_loop, "time_round_robin", fake_round_robin)
    budget = int(report.baseline_peak_bytes * 0.8)
    result = closed_loop.plan_for_device(loaded, report, "optimal", budget_bytes=budget, capacity_bytes=None,
                                         reserve=0.05, steps=1, race=closed_loop.TimeRaceSettings())
    return result.plan, raced.get("simple"), report, before


def _key(plan):
    return [(b.module, b.mode) for b in plan.boundaries]


def test_a_plan_resolved_slower_than_a_simple_plan_loses_to_it(monkeypatch, profiled):
    """remat's plan 10% slower in every round: the simple plan ships, says so, and the FULL prices are scaled
    by the measured error (1.5)."""
    shipped, simple, report, before = _race(monkeypatch, profiled, lambda r: 1.10)
    assert simple is not None and shipped is simple
    assert shipped.planner == f"optimal->{shipped.time_race.simple}"
    race = shipped.time_race
    assert race.verdict is RaceVerdict.LOST and race.shipped_simple and race.rounds == 6
    assert race.ratio == pytest.approx(1.10) and race.low > 1.0
    assert shipped.measured_peak_bytes <= shipped.effective_budget_bytes   # it fits by measurement
    assert dict(race.time_scale)[CheckpointMode.FULL] == pytest.approx(1.5)
    for c in report.candidates:
        if before[c.name] is not None:
            assert c.replay_ms[CheckpointMode.FULL] == pytest.approx(1.5 * before[c.name])
    assert TimeRace.from_json(race.to_json()) == race
    assert type(shipped).from_json(shipped.to_json()).time_race == race


def test_a_plan_resolved_faster_ships(monkeypatch, profiled):
    """The safe twin: 10% faster in every round, remat's own plan ships, its race recorded as won."""
    shipped, simple, _, _ = _race(monkeypatch, profiled, lambda r: 0.90)
    assert shipped is not simple and shipped.planner == "optimal"
    assert shipped.time_race.verdict is RaceVerdict.WON and not shipped.time_race.shipped_simple
    assert shipped.time_race.high < 1.0 and "won against" in shipped.time_race.describe()


def test_a_tie_ships_the_simpler(monkeypatch, profiled):
    """Rounds alternating 5% either way: not resolved, so the plan of fewer boundaries ships, the simple plan on
    a tie in count (the rule computed here from the two plans)."""
    shipped, simple, _, _ = _race(monkeypatch, profiled, lambda r: 0.95 if r % 2 else 1.05)
    race = shipped.time_race
    assert race.verdict is RaceVerdict.TIE
    remat_boundaries = len(shipped.boundaries) if not race.shipped_simple else None
    if race.shipped_simple:
        assert shipped is simple
    else:
        assert remat_boundaries < race.simple_boundaries


def test_a_tie_that_leans_gets_more_rounds_and_resolves(monkeypatch, profiled):
    """NOTE [race extension]: six rounds, five 10% faster and one 2% slower, are a tie whose median leans (0.90);
    six more rounds 10% faster make twelve with one against: [r_(3), r_(10)] excludes 1, remat's plan ships. The
    wrong case: the six more rounds alternate 5% either way, and twelve rounds are still a tie."""
    leaning = lambda r: 1.02 if r == 0 else 0.90   # noqa: E731
    shipped, simple, _, _ = _race(monkeypatch, profiled, leaning)
    assert shipped is not simple and shipped.time_race.verdict is RaceVerdict.WON and shipped.time_race.rounds == 12
    shipped, simple, _, _ = _race(monkeypatch, profiled,
                                  lambda r: leaning(r) if r < 6 else (0.95 if r % 2 else 1.05))
    assert shipped.time_race.verdict is RaceVerdict.TIE and shipped.time_race.rounds == 12


def test_a_tie_that_does_not_lean_is_not_timed_longer(monkeypatch, profiled):
    """The safe twin: rounds alternating 5% either way have a median of 1, no lean: the race stops at six rounds."""
    shipped, _, _, _ = _race(monkeypatch, profiled, lambda r: 0.95 if r % 2 else 1.05)
    assert shipped.time_race.verdict is RaceVerdict.TIE and shipped.time_race.rounds == 6


def test_the_race_is_skipped_when_disabled(monkeypatch, profiled):
    """``$REMAT_TIME_RACE=0`` (the suite's default, conftest.py) gives no settings, and no race: the plan carries
    no ``time_race``; the settings' own bounds are checked."""
    from remat import closed_loop
    from remat.errors import PlanError
    assert closed_loop.TimeRaceSettings.unless_disabled() is None
    monkeypatch.setenv(closed_loop.RACE_ENV_VAR, "1")
    assert closed_loop.TimeRaceSettings.unless_disabled() is not None
    assert closed_loop.TimeRaceSettings.unless_disabled(False) is None
    with pytest.raises(PlanError):
        closed_loop.TimeRaceSettings(rounds=0)
    with pytest.raises(PlanError):
        closed_loop.TimeRaceSettings(extra_rounds=-1)
    loaded, report = profiled
    plan = closed_loop.plan_for_device(loaded, copy.deepcopy(report), "optimal",
                                       budget_bytes=int(report.baseline_peak_bytes * 0.8), capacity_bytes=None,
                                       reserve=0.05, steps=1).plan
    assert plan.time_race is None and plan.planner == "optimal"


def test_arms_that_do_not_fit_side_by_side_leave_remats_plan(monkeypatch, profiled):
    """The device refuses the three resident builds: the race records ``untimed`` and remat's plan ships; a
    different error from the timer is not swallowed (the wrong case: a bug read as "out of memory")."""
    import torch
    from remat import closed_loop
    loaded, report = profiled
    budget = int(report.baseline_peak_bytes * 0.8)

    def refuse(*a, **k):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(closed_loop, "time_round_robin", refuse)
    plan = closed_loop.plan_for_device(loaded, copy.deepcopy(report), "optimal", budget_bytes=budget, capacity_bytes=None,
                                       reserve=0.05, steps=1, race=closed_loop.TimeRaceSettings()).plan
    assert plan.planner == "optimal" and plan.time_race.verdict is RaceVerdict.UNTIMED
    assert "not timed" in plan.time_race.describe()

    def broken(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(closed_loop, "time_round_robin", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        closed_loop.plan_for_device(loaded, copy.deepcopy(report), "optimal", budget_bytes=budget, capacity_bytes=None,
                                    reserve=0.05, steps=1, race=closed_loop.TimeRaceSettings())


def test_a_simple_planner_asked_for_is_not_raced(monkeypatch, profiled):
    """``first-k`` at a budget is itself a simple plan: no race (the timer is never called); the twin above,
    ``optimal``, is raced."""
    from remat import closed_loop
    called = []
    monkeypatch.setattr(closed_loop, "time_round_robin", lambda *a, **k: called.append(1))
    loaded, report = profiled
    plan = closed_loop.plan_for_device(loaded, copy.deepcopy(report), "first-k",
                                       budget_bytes=int(report.baseline_peak_bytes * 0.8), capacity_bytes=None,
                                       reserve=0.05, steps=1, race=closed_loop.TimeRaceSettings()).plan
    assert plan.time_race is None and called == [] and plan.planner == "first-k"
