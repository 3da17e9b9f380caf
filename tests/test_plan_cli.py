"""`remat plan` end to end: profile -> plan -> apply -> measure, and its bad inputs (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from remat.cli.main import main
from remat.plan import Plan
from remat.workload import load_workload

from .conftest import TINY

KEYS = {"schema_version", "planner", "budget_bytes", "reserve", "boundaries", "excluded", "predicted_peak_bytes",
        "predicted_overhead_ms", "measured_peak_bytes", "measured_step_ms", "baseline_peak_bytes",
        "baseline_step_ms", "fingerprint"}


def _shape(spec, **kw):
    return ",".join(f"{k}={v}" for k, v in {**TINY[spec], **kw}.items())


@pytest.mark.parametrize("spec,extra,budget", [
    ("gpt", {"n_layer": 4, "batch_size": 4, "seq_len": 32}, "75%"),
    ("mlp", {"depth": 6, "batch_size": 128}, "88%"),  # AdamW state dominates a small MLP's peak
    ("cnn", {"batch_size": 8, "image_size": 16, "blocks_per_stage": 2}, "90%"),  # floor ~84%: stem + block inputs
])
def test_plan_fits_measured_and_predicted_agree(spec, extra, budget, tmp_path):
    out = tmp_path / spec
    rc = main(["plan", "--workload", spec, "--shape", _shape(spec, **extra), "--budget", budget, "--out", str(out)])
    assert rc == 0
    d = json.loads((out / "plan.json").read_text())
    assert KEYS <= d.keys()
    plan = Plan.from_json(d)
    assert plan.boundaries, "the budget needs at least one boundary"
    assert plan.measured_peak_bytes <= plan.effective_budget_bytes
    assert plan.predicted_peak_bytes == pytest.approx(plan.measured_peak_bytes, rel=0.05)
    assert (out / "profile.json").exists()
    model = load_workload(spec, {**TINY[spec], **extra}).workload.model
    from remat.wrap import boundary_module
    for b in plan.boundaries:  # exactly the regions holding BatchNorm are guarded (cnn), never silently
        # (a segment, ``h[0:2]``, holds its members: NOTE [segments])
        has_bn = any(isinstance(m, torch.nn.BatchNorm2d) for m in boundary_module(model, b.module).modules())
        assert b.guarded == has_bn, b.module


def test_impossible_budget_names_the_floor(tmp_path, capsys):
    rc = main(["plan", "--workload", "mlp", "--shape", _shape("mlp"), "--budget", "10%", "--out", str(tmp_path)])
    err = capsys.readouterr().err.replace("\n", " ")
    assert rc == 2 and "floor" in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--candidates", "blocks.99"], "matches no module"),
    (["--budget", "lots"], "budget"),
    (["--planner", "magic"], "planner"),
    (["--reserve", "150%"], "reserve"),
])
def test_bad_plan_inputs_exit_2(argv, needle, tmp_path, capsys):
    base = ["plan", "--workload", "mlp", "--shape", _shape("mlp"), "--out", str(tmp_path)]
    if "--budget" not in argv:
        base += ["--budget", "90%"]
    rc = main(base + argv)
    err = capsys.readouterr().err.replace("\n", " ")
    assert rc == 2, err
    assert needle in err.lower()
    assert "Traceback" not in err


def test_simulated_profile_bytes_equal_real_on_cpu(cpu_tracker):
    """--simulate on the cpu device model: the same saved bytes and rows as the real profile (before the
    real one replaces its first estimates by measured replay costs and bytes: nothing runs under
    --simulate, so those stay estimates there; NOTE [measured replay bytes])."""
    from remat.profile import profile_simulated, profile_workload
    shape = {**TINY["mlp"], "depth": 3}
    sim = profile_simulated("mlp", shape, target_device="cpu")
    real = profile_workload(load_workload("mlp", shape), repeats=2, measure_replays=False)
    assert sim.simulated and sim.device_model == "cpu" and sim.memory_source.value == "simulated"
    assert sim.baseline_peak_bytes == real.baseline_peak_bytes
    assert [(c.name, c.saved_bytes, c.replay_extra_bytes) for c in sim.candidates] == \
           [(c.name, c.saved_bytes, c.replay_extra_bytes) for c in real.candidates]
    assert {r.base_bytes for r in sim.rows} == {r.base_bytes for r in real.rows}


def test_plan_simulate_records_device_model(tmp_path):
    rc = main(["plan", "--simulate", "--target-device", "h100", "--workload", "gpt", "--shape",
               _shape("gpt", n_layer=4, seq_len=64), "--budget", "70%", "--out", str(tmp_path)])
    assert rc == 0
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.simulated and plan.device_model == "h100" and plan.memory_source == "simulated"
    assert plan.measured_peak_bytes is None  # nothing was run, nothing claims to be measured
    assert plan.predicted_peak_bytes <= plan.effective_budget_bytes


@pytest.mark.parametrize("argv,needle", [(["--target-device", "h100"], "only applies with --simulate"),
                                         (["--simulate", "--target-device", "tpu"], "unknown target device")])
def test_simulate_flag_errors(argv, needle, tmp_path, capsys):
    rc = main(["plan", "--workload", "mlp", "--shape", _shape("mlp"), "--budget", "90%", "--out", str(tmp_path), *argv])
    assert rc == 2 and needle in capsys.readouterr().err.replace("\n", " ")


def test_plan_rendering_prints_library_text_as_text_not_rich_markup():
    """A reason or note naming a NOTE ("[step sample]") is printed whole: rich would take the
    brackets for a style tag and print "(NOTE )" (as `remat plan` once did)."""
    from remat.cli.cmd_plan import render_plan
    from remat.cli.render import console
    from remat.plan.model import Exclusion
    from remat.profile.model import SampleRecord, StepSample
    from .conftest import hand_plan
    plan = hand_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0"])
    plan.excluded = [Exclusion(module="1", reason="not called during any sampled step (NOTE [step sample])")]
    plan.sample = SampleRecord(sample=StepSample(), point_peaks=[10, 20, 30])
    with console.capture() as cap:
        render_plan(plan)
    text = " ".join(cap.get().split())
    assert "1 (not called during any sampled step (NOTE [step sample]))" in text
    assert "max 30 B (NOTE [step sample])" in text
