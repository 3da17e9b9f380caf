"""Profiling and measuring over a sample of steps (NOTE [step sample] in remat/profile/sample.py).

Ground truth for "the plan holds": torch.profiler's allocator events (remat.memory.reference,
validated against the tracker in tests/test_memory.py) on training steps the sample never saw.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import remat
from remat.closed_loop import plan_closed_loop
from remat.memory.reference import profiler_step_peak
from remat.plan import Plan, parse_budget
from remat.profile import CandidateCost, PeakRow, ProfileReport, fingerprint
from remat.profile.model import NOT_CALLED, SampleRecord, StepSample
from remat.profile.sample import at_point, merge_orders, merge_profiles, profile_sample
from remat.types import CheckpointMode, MemorySource
from remat.workload import load_workload
from remat.workload.contract import TrainingStep, Workload

from .conftest import FIXTURES

SPEC = f"{FIXTURES / 'dynamic_workload.py'}:build"
FULL, KEEP = CheckpointMode.FULL, CheckpointMode.KEEP


def _profiler_peaks(loaded, plan: Plan, steps: int, start: int = 100, **shape) -> list[int]:
    """torch.profiler's whole-step peak (bytes) of ``steps`` training steps with ``plan`` applied."""
    fresh = loaded.rebuild(**shape)
    remat.apply(fresh.workload.model, plan)
    step = TrainingStep(fresh.workload)
    step.run(0)
    return [profiler_step_peak(step, start + i) for i in range(steps)]


# -- merging, by hand ------------------------------------------------------------------------------

def _cost(name: str, order: int, saved: int, replay_ms: float = 1.0, members: tuple[str, ...] = ()) -> CandidateCost:
    return CandidateCost(name=name, class_name="Block", order=order, parent=None, fwd_ms=1.0, input_bytes=10,
                         saved_bytes={KEEP: 0, FULL: saved}, replay_ms={KEEP: 0.0, FULL: replay_ms},
                         replay_extra_bytes={KEEP: 0, FULL: 5}, replay_spread_ms={FULL: 0.1}, members=members)


def _report(costs, rows, excluded, peak) -> ProfileReport:
    return ProfileReport(candidates=costs, rows=rows, excluded=excluded, baseline_peak_bytes=peak, baseline_step_ms=10.0,
                         memory_source=MemorySource.CPU_LIVE_TENSORS, fingerprint=fingerprint(torch.nn.Linear(1, 1)))


def test_merge_keeps_a_dynamic_block_and_adds_it_where_it_would_be_held():
    # step A ran b.0 and b.1; step B skipped b.0 (layerdrop)
    a = _report([_cost("b.0", 0, 100, 2.0), _cost("b.1", 1, 100, 4.0), _cost("b[0:2]", 2, 190, members=("b.0", "b.1"))],
                [PeakRow(base_bytes=1000, live=("b.0", "b.1"), replaying=()),
                 PeakRow(base_bytes=900, live=("b.0",), replaying=("b.1",))], {}, 1000)
    b = _report([_cost("b.1", 0, 100, 6.0)],
                [PeakRow(base_bytes=700, live=("b.1",), replaying=())], {"b.0": NOT_CALLED}, 700)
    m = merge_profiles([a, b])
    assert [c.name for c in m.candidates] == ["b.0", "b.1"]           # b.0 stays a candidate
    assert "b.0" not in m.excluded
    assert "b[0:2]" in m.excluded                                     # b.0 is skipped in some steps
    assert m.baseline_peak_bytes == 1000
    b1 = next(c for c in m.candidates if c.name == "b.1")
    assert b1.replay_ms[FULL] == 5.0                                  # the median of 4 and 6 ms
    # B's row again with b.0 held (it runs before b.1): 700 + 100 saved + 10 inputs
    grown = [r for r in m.rows if "b.0" in r.live and r.base_bytes == 810]
    assert len(grown) == 1 and set(grown[0].live) == {"b.0", "b.1"}


def test_merge_takes_max_bytes_and_refuses_other_exclusions():
    a = _report([_cost("b.0", 0, 100)], [], {}, 500)
    b = _report([_cost("b.0", 0, 300)], [], {"b.1": "called 2 times per step (shared module)"}, 800)
    c = _report([_cost("b.1", 0, 50)], [], {"b.0": NOT_CALLED}, 400)
    m = merge_profiles([a, b, c])
    assert [x.name for x in m.candidates] == ["b.0"]
    assert m.candidates[0].saved_bytes[FULL] == 300                   # max over the steps that ran it
    assert m.excluded["b.1"].startswith("called 2 times")             # shared in one step: never offered


def test_merge_orders_inserts_after_the_predecessor():
    assert merge_orders([["a", "c"], ["a", "b", "c"], ["d"]]) == ["d", "a", "b", "c"]


def test_sample_points_and_their_batches():
    s = StepSample.of(3, [{"seq_len": 128}])
    pts = s.points()
    assert len(pts) == 6 and pts[0].is_plain and pts[3].shape == (("seq_len", 128),)
    assert [p.seed for p in pts] == [None, 1, 2, None, 1, 2]
    seen = []
    w = Workload(model=torch.nn.Linear(1, 1), batch=lambda i: seen.append(i) or i, loss=lambda m, b: m.weight.sum())

    class _L:   # the least of a LoadedWorkload that at_point reads
        spec, shape, device, dtype, workload = "x", {}, "cpu", "float32", w
    pw = at_point(_L(), pts[2])
    pw.workload.batch(5)
    assert seen == [2005]
    with pytest.raises(remat.WorkloadError):
        StepSample(steps=0)
    rec = SampleRecord(sample=s, point_peaks=[3, 1, 2, 9, 4, 5])
    assert rec.spread == {"min": 1, "median": 3, "max": 9}
    assert SampleRecord.from_json(json.loads(json.dumps(rec.to_json()))).point_peaks == rec.point_peaks


# -- dynamic control flow: planned over the sample, held on 20 later steps ---------------------------

@pytest.mark.parametrize("kind", ["layerdrop", "depth"])
def test_dynamic_blocks_stay_candidates_and_the_plan_holds(kind):
    loaded = load_workload(SPEC, {"kind": kind})
    report = profile_sample(loaded, StepSample())
    blocks = [f"blocks.{i}" for i in range(6)]
    assert all(b in {c.name for c in report.candidates} for b in blocks), report.excluded
    assert not any("not called" in why for n, why in report.excluded.items() if n in blocks)
    # some sampled step skipped a block (one step alone would have excluded it as NOT_CALLED),
    # and its rows come again with that block held
    assert any(r.label.endswith(" ran too") for r in report.rows)
    plan = plan_closed_loop(loaded, report, "optimal", budget_bytes=parse_budget("70%", report.baseline_peak_bytes),
                            reserve=0.05, sample=StepSample()).plan
    assert plan.sample is not None and len(plan.sample.point_peaks) == 3
    assert plan.measured_peak_bytes == max(plan.sample.point_peaks) <= plan.effective_budget_bytes
    assert not any(b.module.startswith("blocks[") for b in plan.boundaries)   # no segment over a skipped block
    peaks = _profiler_peaks(loaded, plan, 20)
    assert max(peaks) <= plan.budget_bytes, (peaks, plan.budget_bytes)
    assert len(set(peaks)) > 1                                        # the 20 steps did differ


# -- a boundary shape joins the sample --------------------------------------------------------------

def test_boundary_shape_plan_holds_at_the_longer_shape():
    loaded = load_workload(SPEC, {"p": 0.0})
    alone = profile_sample(loaded, StepSample(steps=1))
    budget = alone.baseline_peak_bytes           # bytes: the unplanned peak at seq 64
    control = plan_closed_loop(loaded, alone, "optimal", budget_bytes=budget, reserve=0.05).plan
    both_sample = StepSample.of(1, [{"seq_len": 128}])
    both = profile_sample(loaded, both_sample)
    plan = plan_closed_loop(loaded, both, "optimal", budget_bytes=budget, reserve=0.05, sample=both_sample).plan
    assert plan.sample.point_peaks[1] > plan.sample.point_peaks[0]   # seq 128 measured, and larger
    at128 = _profiler_peaks(loaded, plan, 2, seq_len=128)
    assert max(at128) <= budget
    # the control (planned on seq 64 alone) exceeds the budget at seq 128: the check can fail
    assert min(_profiler_peaks(loaded, control, 2, seq_len=128)) > budget


def _batch(seq: int):
    g = torch.Generator().manual_seed(seq)
    return torch.randn(8, seq, 8, generator=g), torch.randn(8, seq, 8, generator=g)


def _loss(model, b):
    return F.mse_loss(model(b[0]), b[1])


def _peak_at(model, seq: int) -> int:
    w = Workload(model=model, batch=lambda i: _batch(seq), loss=_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    step = TrainingStep(w)
    step.run(0)
    return profiler_step_peak(step, 1)


def test_auto_with_example_batches_plans_for_the_largest():
    sys.path.insert(0, str(FIXTURES))
    try:
        from dynamic_workload import Encoder
    finally:
        sys.path.remove(str(FIXTURES))
    torch.manual_seed(0)
    budget = int(0.7 * _peak_at(Encoder(16, 6, "layerdrop", 0.0), 128))
    fitted = {}
    for name, example in [("only64", _batch(64)), ("both", remat.ExampleBatches(_batch(64), _batch(128)))]:
        torch.manual_seed(0)
        model = Encoder(16, 6, "layerdrop", 0.0)
        handle = remat.auto(model, example, budget=budget, loss_fn=_loss, use_cache=False,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
        fitted[name] = _peak_at(model, 128)
        handle.remove()
    assert fitted["both"] <= budget
    assert fitted["only64"] > budget          # the control: planned on seq 64 alone, it misses at 128
    with pytest.raises(remat.AutoError):
        remat.ExampleBatches()


# -- the command line --------------------------------------------------------------------------------

def test_plan_cli_records_the_sample(tmp_path):
    out = tmp_path / "p"
    r = subprocess.run([sys.executable, "-m", "remat", "plan", "--workload", SPEC, "--shape", "p=0.0,depth=3",
                        "--budget", "80%", "--sample-steps", "1", "--boundary-shape", "seq_len=96", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    plan = Plan.load(out / "plan.json")
    assert plan.sample is not None and plan.sample.sample.boundary_shapes == ((("seq_len", 96),),)
    spread = json.loads((out / "plan.json").read_text())["sample"]["peak_spread"]
    assert spread["max"] == plan.measured_peak_bytes == max(plan.sample.point_peaks)
    assert "sample: 2 steps" in " ".join(r.stdout.split())
    bad = subprocess.run([sys.executable, "-m", "remat", "plan", "--workload", SPEC, "--budget", "80%",
                          "--sample-steps", "0", "--out", str(tmp_path / "q")], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_later_points_dry_run_only_what_no_earlier_point_settled(monkeypatch):
    """A later sampled step dry-runs only candidates no earlier point offered (a block point 0 skipped,
    a new segment), and the merged profile offers exactly the modes dry-running everything at every
    point gives (the control: the settled set forced empty)."""
    import remat.profile.sample as sample_mod
    import remat.profile.step as step_mod
    calls: list[list[str]] = []
    real = step_mod.dry_run_modes

    def recording(step, cands, index, **kw):
        calls.append(sorted(c.name for c in cands))
        return real(step, cands, index, **kw)

    monkeypatch.setattr(step_mod, "dry_run_modes", recording)
    def sampled():   # point 0 is unseeded: seed here so that it skips a block in every run of the suite
        loaded = load_workload(SPEC, {"kind": "layerdrop", "p": 0.3})
        torch.manual_seed(0)
        random.seed(0)
        return profile_sample(loaded, StepSample())

    fast = sampled()
    first, later = calls[0], [n for c in calls[1:] for n in c]
    assert later and not set(later) & set(first)          # nothing dry-run twice
    skipped = [n for n in later if n.startswith("blocks.")]
    assert skipped and not set(skipped) & set(first)      # point 0 skipped it: dry-run where it first ran
    calls.clear()
    monkeypatch.setattr(sample_mod, "_dry_run_settled", lambda reports: frozenset())
    control = sampled()
    assert sum(map(len, calls)) > len(first) + len(later)   # the control did dry-run again
    modes = lambda r: {c.name: sorted(m.value for m in c.saved_bytes) for c in r.candidates}   # noqa: E731
    assert modes(fast) == modes(control) and fast.excluded == control.excluded


# -- one build per shape (NOTE [one build per shape] in remat/profile/sample.py) ---------------------

def _counting_builds(monkeypatch) -> list[dict]:
    """Every build of the fixture's workload from now on, by its shape keywords."""
    from remat.workload import loader
    builds: list[dict] = []
    real = loader.load_workload

    def counting(spec, shape=None, **kw):
        builds.append(dict(shape or {}))
        return real(spec, shape, **kw)

    monkeypatch.setattr(loader, "load_workload", counting)
    return builds


def test_later_points_measure_on_one_build_what_a_build_each_measures(monkeypatch):
    """The closed loop's and ``remat check``'s later points run one after another on one build per shape
    (the closed loop's on the build that measured point 0, after its timed steps);
    each point's peak equals the peak a fresh build of its own measures (the control: the old way, a
    rebuild and a warm-up step per point). Layerdrop at p = 0.5 makes the points' peaks differ, so a
    stream that ran the wrong point's batch or draws would read another point's figure."""
    from remat.closed_loop import sample_peaks
    from remat.measure import measure_arm_peak
    from remat.wrap import PlanArm
    from remat.profile.sample import PointWorkload, sample_workloads
    loaded = load_workload(SPEC, {"kind": "layerdrop", "p": 0.5})
    sample = StepSample.of(4, [{"seq_len": 32}])
    points = sample_workloads(loaded, sample)
    plan = Plan(planner="none", budget_bytes=None, reserve=0.0, excluded={}, predicted_peak_bytes=0,
                predicted_overhead_ms=0.0, baseline_peak_bytes=0, baseline_step_ms=0.0, fingerprint="", boundaries=[])
    control = [measure_arm_peak(w.rebuild() if isinstance(w, PointWorkload) else w, PlanArm("plan", plan),
                                warmup=1).peak_bytes for w in points]
    builds = _counting_builds(monkeypatch)
    measured = sample_peaks(points, sample, plan, control[0])
    assert measured == control
    assert len(set(control[1:4])) > 1 and control[4] != control[0]   # the points did differ
    assert len(builds) == 2           # the first shape's later points, then the boundary shape's points
    # the closed loop's path: the first shape's later points on the build that measured (and timed) point 0
    from remat.closed_loop import measure_plan
    from remat.profile.sample import shape_streams
    first, streams = shape_streams(points, sample)[0]
    m = measure_plan(first, plan, steps=2, then=streams[1:])
    assert m.peak_bytes == control[0] and list(m.then_peak_bytes) == control[1:4]


def test_later_profile_points_continue_on_the_shapes_build(monkeypatch):
    """``profile_sample`` builds once per boundary shape and runs no warm-up step at a later point of a
    shape (the steps it runs, counted against the old schedule: 1 warm-up + 1 timed per later point)."""
    import remat.profile.sample as sample_mod
    loaded = load_workload(SPEC, {"kind": "layerdrop", "p": 0.3})
    warmups: list[int] = []
    real = sample_mod.profile_workload

    def recording(*a, **kw):
        warmups.append(kw.get("warmup", -1))
        return real(*a, **kw)

    monkeypatch.setattr(sample_mod, "profile_workload", recording)
    builds = _counting_builds(monkeypatch)
    report = profile_sample(loaded, StepSample.of(3, [{"seq_len": 32}]))
    assert [b["seq_len"] for b in builds] == [32]  # the boundary shape's build only: no rebuild per point
    assert warmups == [-1, 0, 0, 1, 0, 0]         # point 0 its default; a shape's first point 1; later 0
    assert report.candidates and len(report.rows) > 1
