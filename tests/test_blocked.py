"""A step that does not fit: the CPU device capacity (NOTE [CPU device capacity]) and remat.auto planning
the blocked step from smaller batches (NOTE [blocked step]). Ground truth: hand counts of bytes,
torch.profiler's peaks of the user's own later steps, and the unplanned step refused under the capacity."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import remat
from remat.profile.blocked import extrapolate, halvings, leading_size, slice_batch
from remat.memory.capacity import CpuCapacity, last_refusal, step_capacity
from remat.types import Phase
from remat.workload import Workload
from remat.workload.contract import TrainingStep

from .fixtures.blocked_models import (SCENARIOS, gpt_scenario, planned_peaks, state_bytes, unplanned_peak,
                                      unplanned_refused)

MiB = 2 ** 20


def _llama_importable() -> bool:
    """False only where transformers is not installed: an installed one that fails to import fails the test."""
    if importlib.util.find_spec("transformers") is None:
        return False
    from transformers import LlamaForCausalLM  # noqa: F401
    return True


# -- the capacity itself ------------------------------------------------------------------------------

def test_a_cpu_capacity_refuses_the_first_byte_past_it_and_credits_frees():
    with CpuCapacity(10 * MiB) as cap:
        a = torch.empty(4 * MiB, dtype=torch.uint8)
        b = torch.empty(4 * MiB, dtype=torch.uint8)
        c = torch.empty(2 * MiB, dtype=torch.uint8)    # exactly the capacity: allowed
        assert cap.free_bytes == 0
        with pytest.raises(torch.OutOfMemoryError, match="remat device capacity"):
            torch.empty(1, dtype=torch.uint8)
        del a                                           # a free is credited back
        d = torch.empty(4 * MiB, dtype=torch.uint8)
        del b, c, d
    assert cap.peak_bytes == 10 * MiB
    assert cap.refusal is not None and cap.refusal.requested_bytes == 1 and cap.refusal.live_bytes == 10 * MiB
    torch.empty(64 * MiB, dtype=torch.uint8)            # outside the block nothing is enforced


def test_a_capacity_counts_the_named_objects_tensors_as_live_from_the_start():
    model = nn.Linear(512, 512)                         # 512*512*4 + 512*4 bytes
    own = 512 * 512 * 4 + 512 * 4
    with CpuCapacity(own + MiB, model) as cap:
        assert cap.free_bytes == MiB
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(MiB + 1, dtype=torch.uint8)
    with pytest.raises(remat.CapacityError, match="already hold"):
        CpuCapacity(own - 1, model).__enter__()


def _mlp_step() -> TrainingStep:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    return TrainingStep(Workload(model=model, batch=lambda i: torch.randn(1024, 256),
                                 loss=lambda m, b: m(b).square().mean()))


def test_a_refused_step_records_its_phase_and_the_bytes_live_by_kind():
    step = _mlp_step()
    params = sum(p.numel() * 4 for p in step.workload.model.parameters())    # a hand count: 4 x (256*256 + 256) floats
    with step_capacity(params + 3 * MiB):    # the batch (1 MiB) and three activations of 1 MiB fit, not a fourth
        with pytest.raises(torch.OutOfMemoryError):
            step.run(0)
    r = last_refusal()
    assert r is not None and r.phase is Phase.FORWARD
    assert r.by_kind is not None and r.by_kind.parameters == params and r.by_kind.gradients == 0
    assert r.by_kind.saved_activations >= 2 * MiB     # the inputs the linears saved so far
    assert r.live_bytes + r.requested_bytes > params + 3 * MiB
    # the safe twin: a capacity it fits runs, and a step outside any capacity is not enforced
    with step_capacity(params * 4 + 16 * MiB):
        step.run(1)
    step.run(2)


# -- the rule: smaller batches, extrapolated -----------------------------------------------------------

def test_batches_are_halved_from_the_leading_dimension_and_a_mixed_batch_is_refused():
    assert halvings(12) == [6, 3, 1]
    batch = {"x": torch.zeros(8, 3), "y": torch.zeros(8, dtype=torch.long), "scale": 2.0}
    assert leading_size(batch) == 8
    small = slice_batch(batch, 2)
    assert small["x"].shape == (2, 3) and small["scale"] == 2.0 and batch["x"].shape == (8, 3)
    with pytest.raises(remat.AutoError, match="leading sizes"):
        leading_size({"x": torch.zeros(8, 3), "y": torch.zeros(4)})


def test_the_affine_profile_matches_the_profile_measured_at_the_target():
    """Ground truth: the profile at batch 32 itself (no capacity), against the one read from batches 8 and 16."""
    from remat.autoplan.run import AutoSettings, _profile, _source
    from remat.profile.model import StepSample
    s = gpt_scenario(batch_size=32)
    settings = AutoSettings(budget="70%", loss_fn=s.loss_fn, optimizer=None, verify=None, cache_dir=None,
                            use_cache=False, reserve=0.05, planner="optimal", copy_fn=None, measure_replays=False,
                            segments=False, progress=lambda *a: None)
    profiles = {k: _profile(_source(s.model, slice_batch(s.batch, k), settings), settings, StepSample.of(1, []), [])
                for k in (8, 16, 32)}
    read, rule = extrapolate(profiles[8], 8, profiles[16], 16, 32, 0)
    truth = profiles[32]
    assert rule == "affine"
    assert abs(read.baseline_peak_bytes - truth.baseline_peak_bytes) <= 0.03 * truth.baseline_peak_bytes
    for c, t in zip(read.candidates, truth.candidates):
        for mode, saved in t.saved_bytes.items():
            assert abs(c.saved_bytes[mode] - saved) <= 0.03 * max(saved, MiB), (c.name, mode)
    # the deliberately wrong rule, the small profile as it is, misses by far
    assert profiles[16].baseline_peak_bytes < 0.8 * truth.baseline_peak_bytes


# -- remat.auto on a step that does not fit ----------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt", "cnn", "hf_llama"])
def test_auto_fits_a_step_that_needs_one_and_a_half_times_the_capacity(name):
    if name == "hf_llama" and not _llama_importable():
        pytest.skip("transformers' Llama does not import here")
    s = SCENARIOS[name]()
    capacity = int(unplanned_peak(s) / 1.6)
    assert unplanned_refused(s, capacity)              # the negative control: blocked without a plan
    before = copy.deepcopy(s.model.state_dict())
    handle, peaks = planned_peaks(s, capacity, steps=3, verify="quick")
    report = handle.report
    assert report.blocked is not None and report.blocked.verified_batch < report.blocked.target_batch
    assert report.blocked.refusal is not None and report.blocked.refusal.capacity_bytes == capacity
    assert report.device_memory_bytes == capacity and report.budget_bytes == capacity
    assert report.verification is remat.autoplan.VerifyStatus.PASSED
    assert max(peaks) <= capacity, [p / capacity for p in peaks]     # torch.profiler, the user's own steps
    assert report.measured_peak_bytes is not None and report.measured_peak_bytes <= capacity
    # remat.auto itself left the user's weights alone (they changed only by the 3 training steps after it)
    handle.remove()
    assert before.keys() == s.model.state_dict().keys()


def test_a_step_no_plan_fits_is_a_typed_refusal_with_a_measured_floor():
    s = gpt_scenario(batch_size=16, n_layer=2)
    capacity = int(unplanned_peak(s) / 3)
    with pytest.raises(remat.DeviceTooSmall) as info:
        remat.auto(s.model, s.batch, loss_fn=s.loss_fn, device_memory=capacity, use_cache=False)
    err = info.value
    assert err.capacity_bytes == capacity and err.floor_bytes is not None and err.floor_bytes > capacity
    assert ("floor plan" in err.message or "lowest peak measured" in err.message) and "levers left" in err.tip


def test_a_step_with_no_smaller_batch_that_fits_is_refused():
    s = gpt_scenario(batch_size=4)
    capacity = state_bytes(s.model, s.optimizer()) + MiB     # the parameters, and hardly anything else
    with pytest.raises(remat.DeviceTooSmall, match="no measured step"):
        remat.auto(s.model, s.batch, loss_fn=s.loss_fn, device_memory=capacity, use_cache=False)


def test_budget_and_capacity_are_checked_against_each_other():
    s = gpt_scenario(batch_size=4, seq_len=32)
    with pytest.raises(remat.BudgetError, match="above the device's capacity") as info:
        remat.auto(s.model, s.batch, loss_fn=s.loss_fn, budget="64MiB", device_memory="32MiB", use_cache=False)
    assert 'budget="64MiB"' in info.value.message and "32.00 MiB" in info.value.message   # keywords, both figures
    with pytest.raises(remat.AutoError, match="no stated capacity"):
        remat.auto(s.model, s.batch, loss_fn=s.loss_fn, use_cache=False)
    with pytest.raises(remat.BudgetError, match='device_memory="50%".*not a percentage'):
        remat.auto(s.model, s.batch, loss_fn=s.loss_fn, device_memory="50%", use_cache=False)


def test_auto_inside_a_cpu_capacity_block_fits_that_capacity():
    s = gpt_scenario(batch_size=16)
    capacity = int(unplanned_peak(s) / 1.4)
    opt = s.optimizer()
    with CpuCapacity(capacity, s.model, opt):
        handle = remat.auto(s.model, s.batch, loss_fn=s.loss_fn, optimizer=opt, use_cache=False)
        loss = s.loss_fn(s.model, s.batch)   # the planned step runs under the block's capacity
        loss.backward()
        opt.step()
    assert handle.report.blocked is not None
    assert handle.report.device_memory_bytes is not None and handle.report.device_memory_bytes <= capacity


def test_unlock_shows_the_refused_control_then_the_plan_under_the_same_capacity():
    """remat demo's second act (remat.autoplan.unlock) on a small gpt."""
    from remat.autoplan.unlock import describe, unlock
    from remat.workload import load_workload
    shape = {"batch_size": 16, "seq_len": 128, "n_layer": 4, "d_model": 128, "n_head": 4, "dropout": 0.0}
    s = gpt_scenario(batch_size=16)
    capacity = int(unplanned_peak(s) / 1.5)
    u = unlock(load_workload("gpt", shape), capacity, steps=2)
    assert u.control_refusal is not None and u.control_refusal.capacity_bytes == capacity
    assert u.report.blocked is not None and len(u.step_peaks) == 2 and max(u.step_peaks) <= capacity
    assert any("refused" in line for line in describe(u))


# -- the command line: remat plan --device-memory ------------------------------------------------------

def test_remat_plan_plans_a_blocked_shape_and_refuses_what_cannot_fit(tmp_path, capsys):
    from remat.cli.main import main
    shape = "batch_size=32,seq_len=128,n_layer=4,d_model=128,n_head=4,dropout=0.0"
    capacity = int(unplanned_peak(gpt_scenario()) / 1.6)
    out = tmp_path / "p"
    assert main(["plan", "--workload", "gpt", "--shape", shape, "--device-memory", str(capacity),
                 "--sample-steps", "1", "--out", str(out)]) == 0
    plan = remat.Plan.load(out / "plan.json")        # the evidence round-trips through plan.json's schema
    assert plan.blocked is not None and plan.blocked.target_batch == 32 and plan.blocked.verified_batch < 32
    assert plan.budget_bytes == capacity and plan.measured_peak_bytes <= capacity
    assert "blocked" in " ".join(capsys.readouterr().out.split())
    # a device the parameters hardly fit: no batch fits, exit 2 (the floor's own refusal: the remat.auto test)
    s = gpt_scenario()
    tiny = state_bytes(s.model, s.optimizer()) + MiB
    assert main(["plan", "--workload", "gpt", "--shape", shape, "--device-memory", str(tiny),
                 "--sample-steps", "1", "--out", str(tmp_path / "q")]) == 2
    assert "no measured step" in " ".join(capsys.readouterr().err.split())
    assert main(["plan", "--workload", "gpt", "--device-memory", "50%", "--out", str(tmp_path / "r")]) == 2
    assert main(["plan", "--workload", "gpt", "--budget", "2GiB", "--device-memory", "1GiB",
                 "--out", str(tmp_path / "s")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not a percentage" in err and "above the device's capacity" in err
    assert not (tmp_path / "q").exists() or not (tmp_path / "q" / "plan.json").exists()


def test_remat_trace_writes_the_refusal_of_a_step_that_does_not_fit(tmp_path, capsys):
    from remat.cli.main import main
    import json
    shape = "batch_size=32,seq_len=128,n_layer=4,d_model=128,n_head=4,dropout=0.0"
    capacity = int(unplanned_peak(gpt_scenario()) / 1.6)
    assert main(["trace", "--workload", "gpt", "--shape", shape, "--device-memory", str(capacity),
                 "--out", str(tmp_path / "t")]) == 2
    refusal = json.loads((tmp_path / "t" / "refusal.json").read_text())
    assert refusal["capacity_bytes"] == capacity and refusal["phase"] == "forward"
    assert refusal["live_bytes"] + refusal["requested_bytes"] > capacity
    assert "does not fit the device capacity" in " ".join(capsys.readouterr().err.split())
    # the safe twin: a capacity the step fits traces as before
    assert main(["trace", "--workload", "gpt", "--shape", shape, "--device-memory", str(capacity * 2),
                 "--steps", "1", "--warmup", "1", "--out", str(tmp_path / "u")]) == 0
    assert (tmp_path / "u" / "trace.json").exists() and not (tmp_path / "u" / "refusal.json").exists()


def test_remat_frontier_on_a_device_reports_what_each_plan_unlocks(tmp_path):
    """The control cannot run at the target (a failed point, out of memory); each plan that fits reports the
    largest batch it fits on the device, and one ships."""
    from remat.cli.main import main
    import json
    shape = "batch_size=32,seq_len=128,n_layer=4,d_model=128,n_head=4,dropout=0.0"
    capacity = int(unplanned_peak(gpt_scenario()) / 1.6)
    assert main(["frontier", "--workload", "gpt", "--shape", shape, "--device-memory", str(capacity),
                 "--plans", "all,optimal", "--steps", "2", "--warmup", "1", "--capacity-tries", "3",
                 "--out", str(tmp_path / "f")]) == 0
    d = json.loads((tmp_path / "f" / "frontier.json").read_text())
    points = {p["plan"]: p for p in d["points"]}
    assert points["none"]["decision"] == "failed" and "out of memory" in points["none"]["reason"]
    assert d["budget_bytes"] == capacity and d["shipped"] in ("all", "optimal")
    for name in ("all", "optimal"):
        assert points[name]["peak_bytes"] <= capacity and points[name]["capacity"] >= 32
    assert main(["frontier", "--workload", "gpt", "--out", str(tmp_path / "g")]) == 2   # neither budget nor device


def test_a_replan_for_a_batch_that_cannot_run_unplanned_goes_through_the_blocked_path():
    """on_new_shape='replan': planned at batch 8 for the capacity, then called at batch 32 (whose unplanned step
    needs 1.6x the capacity) inside the user's own enforced capacity: re-planned from smaller batches, and the
    step at 32 runs under the capacity instead of running out of memory."""
    big = gpt_scenario(batch_size=32)
    capacity = int(unplanned_peak(big) / 1.6)
    s = gpt_scenario(batch_size=8)
    opt = s.optimizer()
    small_batch = tuple(t[:8] for t in big.batch)
    handle = remat.auto(s.model, small_batch, loss_fn=s.loss_fn, optimizer=opt, device_memory=capacity,
                        on_new_shape="replan", use_cache=False)
    assert handle.report.blocked is None            # batch 8 fits unplanned
    with CpuCapacity(capacity, s.model, opt) as cap:
        loss = s.loss_fn(s.model, big.batch)        # the guard re-plans before this forward runs
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert handle.replans == 1 and handle.report.blocked is not None
    assert handle.report.blocked.target_batch == 32 and cap.peak_bytes <= capacity


# -- the receipt of a blocked step, and remat check re-running both shapes ------------------------------

def test_a_receipt_of_a_blocked_step_records_both_shapes_and_check_reruns_them(tmp_path, capsys):
    """NOTE [blocked receipt]: the receipt plans batch 32 on a device it does not fit, verifies where the control
    fits, and remat check re-runs the plan at 32 under the capacity (passes), fails under a smaller device (the
    deliberately wrong case), and refuses an edited receipt that drops the device it was blocked on."""
    import json
    from remat.cli.main import main
    from remat.receipt import load_receipt
    shape = "batch_size=32,seq_len=128,n_layer=4,d_model=128,n_head=4,dropout=0.0"
    capacity = int(unplanned_peak(gpt_scenario()) / 1.6)
    out = tmp_path / "r"
    assert main(["receipt", "--workload", "gpt", "--shape", shape, "--device-memory", str(capacity),
                 "--plans", "none,optimal", "--frontier-steps", "2", "--no-capacity", "--sample-steps", "1",
                 "--verify-seeds", "1", "--verify-steps", "1", "--out", str(out)]) == 0
    receipt = load_receipt(out / "receipt.json")
    blocked = receipt.blocked
    assert blocked is not None and blocked.target_batch == 32 and blocked.verified_batch < 32
    assert receipt.context.device_memory_bytes == capacity and receipt.decision.budget_bytes == capacity
    assert receipt.decision.shipped_peak_bytes <= capacity and receipt.verification.passed
    assert receipt.traces.target.context.shape["batch_size"] == blocked.verified_batch   # the control where it fits
    assert receipt.traces.planned.context.shape["batch_size"] == 32 and receipt.traces.planned.peak_bytes <= capacity
    control = next(p for p in receipt.frontier.points if p.plan == "none")
    assert not control.fits and "out of memory" in control.reason
    assert "does not fit" in (out / "report.md").read_text()
    assert "It unlocks batch 32 on this device" in " ".join(capsys.readouterr().out.split())
    assert main(["check", str(out / "receipt.json")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "still does not fit the device" in said and f"batch_size={blocked.verified_batch}" in said
    # the wrong case: a device smaller than the plan's measured peak refuses the planned step
    smaller = receipt.decision.shipped_peak_bytes - 4 * MiB
    assert main(["check", str(out / "receipt.json"), "--device-memory", str(smaller),
                 "--budget", str(smaller)]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert "the step with the plan" in said and "no longer fits the device capacity" in said, said
    # an edited receipt: the device dropped, the blocked evidence kept
    d = json.loads((out / "receipt.json").read_text())
    del d["context"]["device_memory_bytes"]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(d))
    assert main(["check", str(edited), "--quick", "--no-reports"]) == 1
    assert "states no device memory" in " ".join(capsys.readouterr().out.split())
