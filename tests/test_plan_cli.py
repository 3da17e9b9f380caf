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
    for b in plan.boundaries:  # exactly the regions holding BatchNorm are guarded (cnn), never silently
        has_bn = any(isinstance(m, torch.nn.BatchNorm2d) for m in model.get_submodule(b.module).modules())
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
