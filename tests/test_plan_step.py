"""remat.workflow.plan: what ``remat plan`` runs, called as a library (no argparse)."""

from __future__ import annotations

from remat.closed_loop import ClosedLoopResult
from remat.measure import CompileSpec
from remat.profile.model import StepSample
from remat.workflow.plan import PlanSettings, plan_step
from remat.workload import load_workload

from .conftest import TINY


def test_an_unmeasured_plan_is_built_with_what_it_was_made_on():
    """``measure=False``: the planner's plan, carrying the workload it was profiled on, the sample it was
    profiled over and the compile spec it is to run under (the wrong case, a single-step sample, carries
    none); nothing is measured."""
    loaded = load_workload("mlp", TINY["mlp"])
    spec = CompileSpec()
    report, plan = plan_step(loaded, PlanSettings(planner="all", measure=False, compile=spec), StepSample.of(2, []))
    assert not isinstance(plan, ClosedLoopResult) and plan.measured_peak_bytes is None
    assert plan.workload.spec == "mlp" and plan.workload.shape == TINY["mlp"] and plan.workload.device == "cpu"
    assert plan.compile == spec and plan.sample is not None and plan.sample.sample.steps == 2
    assert {b.module for b in plan.boundaries} <= {c.name for c in report.candidates} and plan.boundaries
    _, single = plan_step(loaded, PlanSettings(planner="all", measure=False), StepSample.of(1, []))
    assert single.sample is None and single.compile is None
