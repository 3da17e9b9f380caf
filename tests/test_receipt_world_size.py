"""`remat receipt --world-size 2 --engine ddp|fsdp2` and `remat check` re-running it at world size 2
(NOTE [receipt at a world size] in remat/receipt/world_size.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from remat.cli.main import main
from remat.receipt import Receipt, RunSettings, write_receipt
from remat.workflow import make_receipt
from remat.workflow.build import WORLD_SIZE_MODE
from remat.workflow.world_size import with_world_size
from remat.workload import load_workload
from tests.test_receipt import PYPROJECT, WORKLOAD

SETTINGS = RunSettings(trace_warmup=1, trace_steps=1, verify_steps=1, verify_seeds=1, verify_timing_steps=1,
                       frontier_plans=["none", "all"], frontier_steps=2, frontier_warmup=1, capacity_key=None,
                       capacity_tries=1, capacity_steps=1, note="test sizes")
SHAPE = {"batch_size": 512, "depth": 2}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A single-process receipt of the tiny MLP (module-scoped), in a folder with work.py."""
    root = tmp_path_factory.mktemp("ws")
    (root / "work.py").write_text(WORKLOAD)
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    torch.set_num_threads(1)
    try:
        receipt = make_receipt(load_workload("work.py:build", SHAPE), budget="90%", reserve=0.05, settings=SETTINGS,
                               command="pytest")
    finally:
        mp.undo()
    assert receipt.shipped and receipt.plan.plan is not None and receipt.plan.plan.boundaries
    return root, receipt


def _at(base, tmp_path, monkeypatch, engine: str) -> Receipt:
    root, receipt = base
    shutil.copy(root / "work.py", tmp_path / "work.py")
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    monkeypatch.chdir(tmp_path)
    at = with_world_size(receipt, world_size=2, engine=engine, check_steps=1, check_timeout_s=30.0,
                         wall_timeout_s=300.0)
    write_receipt(at, tmp_path / "out")
    return at


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_receipt_at_world_size_2_that_check_re_runs_at_world_size_2(base, tmp_path, monkeypatch, capsys, engine):
    at = _at(base, tmp_path, monkeypatch, engine)
    ws = at.world_size
    assert ws is not None and (ws.world_size, ws.engine) == (2, engine)
    rep = ws.report
    assert rep.equivalence is not None and rep.equivalence.ok and rep.equivalence.criterion == "bitwise"
    assert rep.budget_bytes == at.decision.effective_budget_bytes and rep.passed
    assert [r.rank for r in rep.plan.per_rank] == [0, 1] and rep.plan.global_samples_per_s > 0
    # "other world sizes" is what is not covered now, not world size 2
    modes = [u.mode for u in at.unsupported]
    assert WORLD_SIZE_MODE not in modes and f"world sizes other than 2 ({engine})" in modes
    d = json.loads((tmp_path / "out" / "receipt.json").read_text())
    assert Receipt.from_json(d).to_json() == d
    assert "At world size 2" in (tmp_path / "out" / "report.md").read_text()
    # The time gate is not what this test is about, and the receipt's overhead claim comes from 2 frontier steps
    # of a 3.6 ms step at test sizes: CI once re-measured +107% against its +61%. The gate's verdict is tested on
    # synthetic samples (tests/test_check_tamper.py); here it is only loosened, from the command line.
    assert main(["check", "out/receipt.json", "--time-tolerance", "99%"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"re-run at world size 2 ({engine}, gloo): gradients bitwise equal on every rank" in out
    assert "samples/s over 2 ranks; per-device peaks rank 0" in out


def test_check_holds_a_tampered_receipt_to_the_repositorys_budget(base, tmp_path, monkeypatch, capsys):
    """The receipt's own distributed budget is raised past its ranks' peaks; the gate takes the budget from
    pyproject.toml (NOTE [gate thresholds]), which the ranks' recorded peaks are over: check fails, naming
    them. The untouched receipt under the same pyproject passes the same --quick check (the safe twin)."""
    at = _at(base, tmp_path, monkeypatch, "ddp")
    peaks = [r.peak_bytes for r in at.world_size.report.plan.per_rank]
    single = at.decision.shipped_peak_bytes
    assert single is not None
    d = at.to_json()
    d["world_size"]["report"]["budget_bytes"] = 1 << 40          # the receipt loosens its own gate
    (tmp_path / "out" / "receipt.json").write_text(json.dumps(d))
    write_receipt(Receipt.from_json(d), tmp_path / "tampered")
    # the repository's budget: above the single-process peak, a byte under rank 0's planned peak, no reserve
    budget = max(single + 1, peaks[0] - 1)
    assume = budget < peaks[0]
    (tmp_path / "pyproject.toml").write_text(PYPROJECT + f'budget = {budget}\nreserve = "0%"\n')
    assert assume
    assert main(["check", "--quick", "tampered/receipt.json"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "rank 0's planned peak" in out and f"over the per-device budget {budget} bytes" in out
    (tmp_path / "pyproject.toml").write_text(PYPROJECT + f'budget = {max(peaks) + 1}\nreserve = "0%"\n')
    assert main(["check", "--quick", "tampered/receipt.json"]) == 0
