"""``remat receipt`` re-plans without a boundary that verification has just found hazardous
(NOTE [re-plan after verify] in remat.workflow.build), at most MAX_VERIFY_ROUNDS rounds."""

from __future__ import annotations

import json

import pytest
import torch

from remat.plan.planners import classify_candidates
from remat.profile import profile_workload
from remat.profile.model import StepSample
from remat.receipt import Receipt, RunSettings, load_receipt, write_receipt
from remat.workflow import build, make_receipt
from remat.workload import load_workload

from .conftest import FIXTURES

SPEC = f"{FIXTURES / 'verify_only_hazard.py'}:build"
CANDIDATES = ["blocks.0", "blocks.1"]
SETTINGS = RunSettings(trace_warmup=1, trace_steps=1, verify_steps=1, verify_seeds=1, verify_timing_steps=0,
                       frontier_plans=["none", "optimal"], frontier_steps=3, frontier_warmup=1,
                       capacity_key=None, capacity_tries=1, capacity_steps=1, note="re-plan")


@pytest.fixture(scope="module")
def report():
    return profile_workload(load_workload(SPEC, {}), candidates=CANDIDATES, measure_replays=False, repeats=1)


def test_the_hazard_is_only_caught_by_verify(report):
    """The premise: the profile lets blocks.0 through (its dict counter keeps its length)."""
    assert set(CANDIDATES) <= set(classify_candidates(report).allowed)


def test_receipt_replans_without_the_block_verify_found_hazardous(tmp_path):
    """Round 1 ships blocks.0 (the cheaper replay) to verify, which fails it; round 2 plans blocks.1,
    which verifies, and ships it, recording what was excluded and why (and the JSON keeps it)."""
    torch.set_num_threads(1)
    receipt = make_receipt(load_workload(SPEC, {}), budget="96%", reserve=0.0, settings=SETTINGS,
                           candidates=CANDIDATES)
    d = receipt.decision
    assert d.status == "ship" and d.boundaries == ["blocks.1:full"] and d.verified, d.why
    (why,) = receipt.plan.excluded_after_verify.values()
    assert list(receipt.plan.excluded_after_verify) == ["blocks.0"] and "python_state" in why and "stats" in why
    assert any(w.startswith("Re-planned without blocks.0") for w in d.why), d.why
    files = write_receipt(receipt, tmp_path / "out")
    again = load_receipt(files.receipt)
    assert again.plan.excluded_after_verify == receipt.plan.excluded_after_verify
    assert "excluded_after_verify" in json.loads(files.receipt.read_text())["plan"]


def test_replanning_stops_after_max_rounds(monkeypatch, report):
    """A verification that implicates a new boundary every round: MAX_VERIFY_ROUNDS rounds, then the
    last plan stays UNVERIFIED with the reason; a passing round stops at once."""
    rounds = []

    def one_round(loaded, report, *a, **k):
        rounds.append(sorted(report.excluded))
        return build._Round(closed=None, note="", frontier=None, plan=f"plan{len(rounds)}", label=None,
                            evidence=build._Evidence(), decision=None)
    monkeypatch.setattr(build, "_one_round", one_round)
    monkeypatch.setattr(build, "_hazardous", lambda plan, v: {f"b{plan[-1]}": "hook: fires again"})
    proved = build._plan_and_prove(None, report, 1, 0.0, SETTINGS, None, StepSample.of(1, []), lambda *a: None)
    assert len(rounds) == build.MAX_VERIFY_ROUNDS == 3
    assert proved.excluded == {"b1": "hook: fires again", "b2": "hook: fires again"}
    assert "still fails after 3 rounds" in proved.note
    rounds.clear()
    monkeypatch.setattr(build, "_hazardous", lambda plan, v: {})
    assert build._plan_and_prove(None, report, 1, 0.0, SETTINGS, None, StepSample.of(1, []), lambda *a: None).excluded == {}
    assert len(rounds) == 1


@pytest.mark.parametrize("member,excluded", [("blocks.0", {"blocks.0"}), ("blocks.0.lin", {"blocks.0"})])
def test_a_candidate_containing_the_hazardous_block_is_excluded_too(report, member, excluded):
    out = build._without(report, {member: "hook: fires again"})
    assert set(out.excluded) - set(report.excluded) == excluded
    assert "blocks.1" not in out.excluded


def test_a_shipped_plan_that_misses_over_the_sample_gives_way_to_one_that_holds():
    """NOTE [ship over the sample]: the first sampled step is short and the others long, and the budget
    lies between the unmodified step's two peaks. The frontier, measuring at the first step, would ship
    the control; over the sample the control misses, so its point takes its max, and a plan that holds
    at every sampled step ships instead (before: nothing shipped)."""
    torch.set_num_threads(1)
    spec = f"{FIXTURES / 'dynamic_workload.py'}:build"
    shape = {"p": 0.0, "long_from": 1000}
    short = profile_workload(load_workload(spec, shape), measure_replays=False, repeats=1).baseline_peak_bytes
    long_ = profile_workload(load_workload(spec, {**shape, "long_from": 1}), measure_replays=False,
                             repeats=1).baseline_peak_bytes
    assert long_ > 1.3 * short                     # the premise: later steps peak far higher
    budget = (short + long_) // 2
    settings = RunSettings(trace_warmup=1, trace_steps=1, verify_steps=1, verify_seeds=1, verify_timing_steps=0,
                           frontier_plans=["none", "all", "optimal"], frontier_steps=3, frontier_warmup=1,
                           capacity_key=None, capacity_tries=1, capacity_steps=1, note="sample")
    receipt = make_receipt(load_workload(spec, shape), budget=budget, reserve=0.0, settings=settings)
    d = receipt.decision
    assert d.status == "ship" and d.shipped != "none" and d.boundaries, d.why
    plan = receipt.plan.plan
    assert plan.sample is not None and max(plan.sample.point_peaks) <= d.effective_budget_bytes
    assert d.shipped_peak_bytes == max(plan.sample.point_peaks)
    control = receipt.frontier.point("none")
    assert not control.fits and control.peak_bytes > budget and "max over the step sample" in control.reason
