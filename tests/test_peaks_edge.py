"""Peaks at the edge (NOTE [peaks at the edge]): a CPU peak that clears its budget by less than the
tracker's known error is confirmed by torch.profiler; the closed loop never ships it on the tracker alone."""

from __future__ import annotations

import pytest

from remat.closed_loop import _fits, _measure_into
from remat.measure import Arm, measure_arm
from remat.memory import profiler_step_peak
from remat.memory.reference import TRACKER_ERROR_BYTES, at_the_edge
from remat.measure.run import prepare_arm, warm_up
from remat.plan import Plan
from remat.profile import fingerprint
from remat.types import MemorySource
from remat.workload import load_workload

from .conftest import TINY

MIB = 2 ** 20


def test_the_edge_is_the_trackers_known_error_below_the_budget():
    cpu = MemorySource.CPU_LIVE_TENSORS
    assert at_the_edge(98 * MIB, 100 * MIB, cpu) and not at_the_edge(96 * MIB, 100 * MIB, cpu)   # 3% of 100 MiB
    assert not at_the_edge(101 * MIB, 100 * MIB, cpu)                   # over: a miss, nothing to confirm
    assert at_the_edge(MIB // 2, MIB, cpu) and TRACKER_ERROR_BYTES > MIB   # a small step: the fixed amount
    assert not at_the_edge(98 * MIB, 100 * MIB, MemorySource.CUDA_ALLOCATOR)   # the allocator's own figure


@pytest.fixture(scope="module", autouse=True)
def _tracker_peaks():
    """This file's subject is the live-tensor tracker's known error, so its CPU peaks come from the
    tracker (NOTE [CPU allocator counter]: the allocator counter sees the workspaces itself)."""
    from remat.memory.allocator import ENV_VAR
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, "tracker")
        yield


@pytest.fixture(scope="module")
def cnn():
    """The tiny cnn: oneDNN's convolution workspaces are allocations the tracker cannot see."""
    loaded = load_workload("cnn", TINY["cnn"])
    p = prepare_arm(loaded, Arm("control"))
    warm_up(p.step, 2)
    truth = profiler_step_peak(p.step, 2)     # ground truth: torch.profiler's allocator events
    p.close()
    tracked = measure_arm(loaded, Arm("control"), steps=0)
    assert tracked.memory_source is MemorySource.CPU_LIVE_TENSORS and tracked.peak_bytes < truth * 0.99
    return loaded, tracked.peak_bytes, truth


def test_a_peak_at_the_edge_is_confirmed_and_misses(cnn):
    loaded, tracked, truth = cnn
    budget = (tracked + truth) // 2           # the tracker says it fits; the allocations do not
    m = measure_arm(loaded, Arm("control"), steps=0, confirm_under=budget)
    assert m.tracker_peak_bytes == tracked and m.memory_source is MemorySource.CPU_PROFILER
    assert m.peak_bytes == pytest.approx(truth, rel=0.01) and m.peak_bytes > budget


def test_a_peak_clear_of_the_edge_is_not_profiled(cnn):
    loaded, tracked, truth = cnn
    m = measure_arm(loaded, Arm("control"), steps=0, confirm_under=tracked + 4 * TRACKER_ERROR_BYTES)
    assert m.tracker_peak_bytes is None and m.peak_bytes == tracked
    assert m.memory_source is MemorySource.CPU_LIVE_TENSORS


def test_the_closed_loop_does_not_ship_a_tracker_fit_the_profiler_refutes(cnn):
    loaded, tracked, truth = cnn
    budget = (tracked + truth) // 2

    def plan() -> Plan:
        return Plan(planner="none", budget_bytes=budget, reserve=0.0, boundaries=[], excluded=[],
                    predicted_peak_bytes=tracked, predicted_overhead_ms=0.0, baseline_peak_bytes=tracked,
                    baseline_step_ms=0.0, fingerprint=fingerprint(loaded.workload.model))
    edge = plan()
    _measure_into(loaded, edge, steps=1)
    assert edge.measured_peak_bytes > budget and edge.memory_source == "cpu-profiler-allocator"
    assert not _fits(edge)
    clear = plan()                             # the twin: a budget the true peak clears
    clear.budget_bytes = truth + 4 * TRACKER_ERROR_BYTES
    _measure_into(loaded, clear, steps=1)
    assert _fits(clear) and clear.memory_source == "cpu-live-tensors"


# -- a budget a baseline family meets by measurement is never refused (NOTE [the reserve]) -----------

class _Scripted:
    """Stands in for measure_plan: each plan measures what the test says (bytes)."""

    def __init__(self, peak_of):
        self.peak_of, self.calls = peak_of, []

    def __call__(self, loaded, plan, *, warmup=2, steps=3, then=()):
        from remat.closed_loop import StepMeasurement
        self.calls.append(plan.planner)
        return StepMeasurement(peak_bytes=int(self.peak_of(plan)), step_ms=[1.0],
                               memory_source=MemorySource.CPU_LIVE_TENSORS)


def _chain9():
    from .test_plan import chain_report
    return chain_report(9, 1)


def test_a_baseline_family_plan_that_measures_in_budget_ships(monkeypatch):
    from remat import closed_loop
    from remat.plan import make_plan
    chain = _chain9()
    budget = int(chain.baseline_peak_bytes * 0.7)
    eff = make_plan(chain, "optimal", budget_bytes=budget).effective_budget_bytes
    family = make_plan(chain, "first-k", budget_bytes=budget)         # the family's own pick at this budget
    key = [b.module for b in family.boundaries]
    # the cost model is wrong about everything but that plan: only it measures under the effective budget
    fake = _Scripted(lambda p: eff - 1 if [b.module for b in p.boundaries] == key else eff + 2 ** 20)
    monkeypatch.setattr(closed_loop, "measure_plan", fake)
    shipped = closed_loop.plan_closed_loop(None, chain, "optimal", budget_bytes=budget).plan
    assert [b.module for b in shipped.boundaries] == key and shipped.measured_peak_bytes == eff - 1
    assert shipped.planner.format().startswith("optimal->first-k:")
    # the fallbacks before the baseline families (all, floor) are other plans: they could not have found it
    assert all([b.module for b in make_plan(chain, spec, budget_bytes=budget).boundaries] != key
               for spec in ("all", "floor"))


def test_a_plan_inside_the_reserve_is_offered_with_the_reserve_that_ships_it(monkeypatch):
    from remat import closed_loop
    from remat.plan import make_plan
    chain = _chain9()
    budget = int(chain.baseline_peak_bytes * 0.7)
    eff = make_plan(chain, "optimal", budget_bytes=budget).effective_budget_bytes
    inside = eff + (budget - eff) // 2                              # under the budget, inside its 5% reserve
    monkeypatch.setattr(closed_loop, "measure_plan", _Scripted(lambda p: inside + len(p.boundaries)))
    with pytest.raises(closed_loop.BudgetMissed,
                       match=r"under the budget of .* itself but inside its 5.0% reserve") as info:
        closed_loop.plan_closed_loop(None, chain, "optimal", budget_bytes=budget)
    offered = info.value.in_budget
    r = closed_loop.reserve_that_ships(offered)
    assert 0 < r < 0.05 and f"--reserve {r * 100:g}%" in info.value.tip   # the CLI's spelling outside remat.auto
    peak = offered.measured_peak_bytes
    assert int(budget * (1 - r - 0.001)) < peak <= int(budget * (1 - r))   # the largest such reserve, to 0.1%
    # the offer holds: at that reserve the loop ships a plan; a reserve 1% larger still refuses
    ok = closed_loop.plan_closed_loop(None, chain, "optimal", budget_bytes=budget, reserve=r).plan
    assert ok.measured_peak_bytes <= ok.effective_budget_bytes
    with pytest.raises(closed_loop.BudgetMissed):
        closed_loop.plan_closed_loop(None, chain, "optimal", budget_bytes=budget, reserve=r + 0.01)
    # nothing under the budget itself: no offer
    monkeypatch.setattr(closed_loop, "measure_plan", _Scripted(lambda p: budget + 1))
    with pytest.raises(closed_loop.BudgetMissed) as none:
        closed_loop.plan_closed_loop(None, chain, "optimal", budget_bytes=budget)
    assert none.value.in_budget is None and "--reserve" not in none.value.tip
