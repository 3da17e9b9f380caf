"""Mixed precision (NOTE [autocast steps]) and the workload a plan records (NOTE [plan workload]).

Ground truth: the dtype torch.autocast gives a Linear's output inside the forward (a hook sees it),
the tolerance table written out by hand, the receipt's own JSON, and calls into the autocast
loss counted while `remat check` re-runs a receipt."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from remat.cli.main import main
from remat.errors import WorkloadError
from remat.verify import TOLERANCES, Tolerance, tolerance_table
from remat.workload import AutocastLoss, load_workload, parse_autocast

from .conftest import TINY
from .test_receipt import WORKLOAD

MLP = ",".join(f"{k}={v}" for k, v in TINY["mlp"].items())


def _linear_output_dtypes(loaded) -> list[torch.dtype]:
    """The dtypes of every Linear output in one forward of ``loaded``'s step (a hook records them)."""
    seen: list[torch.dtype] = []
    wl = loaded.workload
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
             for m in wl.model.modules() if isinstance(m, nn.Linear)]
    try:
        wl.loss(wl.model, wl.batch(0))
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_autocast_runs_the_forward_in_the_autocast_dtype_and_nothing_else():
    plain = load_workload("mlp", TINY["mlp"])
    mixed = load_workload("mlp", TINY["mlp"], autocast="bf16")
    assert set(_linear_output_dtypes(plain)) == {torch.float32}             # the safe twin: no autocast
    assert set(_linear_output_dtypes(mixed)) == {torch.bfloat16}
    assert mixed.autocast == "bfloat16" and isinstance(mixed.workload.loss, AutocastLoss)
    assert {p.dtype for p in mixed.workload.model.parameters()} == {torch.float32}   # parameters stay float32
    assert mixed.rebuild().autocast == "bfloat16" and not torch.is_autocast_enabled("cpu")
    with pytest.raises(WorkloadError, match="int8"):
        parse_autocast("int8")


def test_tolerances_under_autocast_are_the_autocast_dtypes_never_tighter():
    bf16 = tolerance_table(autocast="bfloat16")
    assert bf16["float32"] == Tolerance(rtol=1.6e-2, atol=1e-5) == TOLERANCES["bfloat16"]
    assert bf16["float64"] == Tolerance(rtol=1.6e-2, atol=1e-5)
    assert bf16["float16"] == TOLERANCES["float16"] and bf16["bfloat16"] == TOLERANCES["bfloat16"]
    fp16 = tolerance_table(autocast="float16")
    assert fp16["float32"] == Tolerance(rtol=2e-3, atol=1e-7)
    assert tolerance_table() == TOLERANCES                                  # no autocast: as before


def test_plan_records_its_workload_and_verify_uses_it(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["plan", "--workload", "mlp", "--shape", MLP, "--autocast", "bf16", "--planner", "all",
                 "--no-measure", "--out", str(out)]) == 0
    recorded = json.loads((out / "plan.json").read_text())["workload"]
    assert recorded == {"spec": "mlp", "shape": TINY["mlp"], "device": "cpu", "dtype": "float32", "autocast": "bfloat16"}
    assert main(["verify", "--plan", str(out / "plan.json"), "--steps", "1", "--seeds", "1", "--timing-steps", "0",
                 "--out", str(tmp_path / "v")]) == 0
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert (report["workload"], report["shape"], report["autocast"]) == ("mlp", TINY["mlp"], "bfloat16")
    assert report["tolerances"]["float32"] == {"rtol": 1.6e-2, "atol": 1e-5}
    assert all(s["bitwise"] for s in report["per_step"])      # CPU: the replay runs the same bf16 kernels
    assert any(n["name"] == "perturbed_gradient" and n["rejected"] for n in report["negative_controls"])


@pytest.mark.parametrize("recorded, expect", [
    (None, "does not record the workload"),
    ({"spec": "evil.py:build", "shape": {}, "device": "cpu", "dtype": "float32", "autocast": None},
     "never imports code a plan file names"),
])
def test_verify_refuses_a_plan_without_a_builtin_record(tmp_path, capsys, monkeypatch, recorded, expect):
    out = tmp_path / "p"
    assert main(["plan", "--workload", "mlp", "--shape", MLP, "--planner", "all", "--no-measure", "--out", str(out)]) == 0
    (tmp_path / "evil.py").write_text("open('imported', 'w').write('yes')\n")
    monkeypatch.chdir(tmp_path)
    d = json.loads((out / "plan.json").read_text())
    d.pop("workload") if recorded is None else d.update(workload=recorded)
    (out / "plan.json").write_text(json.dumps(d))
    capsys.readouterr()
    assert main(["verify", "--plan", str(out / "plan.json"), "--out", str(tmp_path / "v")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert expect in err and "--workload" in err
    assert not (tmp_path / "imported").exists() and not (tmp_path / "v" / "verify.json").exists()


@pytest.fixture(scope="module")
def autocast_receipt(tmp_path_factory):
    root = tmp_path_factory.mktemp("autocast-receipt")
    (root / "work.py").write_text(WORKLOAD)
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    try:
        rc = main(["receipt", "--workload", "work.py:build", "--autocast", "bf16", "--budget", "92%", "--out", "out",
                   "--verify-steps", "1", "--verify-seeds", "1", "--plans", "none,all", "--frontier-steps", "2",
                   "--no-capacity"])
    finally:
        mp.undo()
    return root, rc


def test_a_receipt_made_under_autocast_states_it_and_check_reruns_it_so(autocast_receipt, monkeypatch, capsys):
    root, rc = autocast_receipt
    d = json.loads((root / "out" / "receipt.json").read_text())
    assert rc == 0 and d["decision"]["status"] == "ship" and d["plan"]["boundaries"]
    assert d["context"]["autocast"] == "bfloat16" and d["verification"]["autocast"] == "bfloat16"
    assert {b["fixture"]["tolerance"]["rtol"] for b in d["plan"]["boundaries"]} == {1.6e-2}
    modes = {u["mode"] for u in d["unsupported"]}
    assert "autocast / mixed precision" not in modes and {"without autocast", "autocast float16"} <= modes
    assert "under autocast bfloat16" in (root / "out" / "report.md").read_text()
    seen: list[tuple[bool, torch.dtype]] = []
    real = AutocastLoss.__call__

    def spy(self, model, batch):
        def inner(m, b):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return self.loss(m, b)
        return real(AutocastLoss(inner, self.device_type, self.dtype), model, batch)

    monkeypatch.setattr(AutocastLoss, "__call__", spy)
    monkeypatch.chdir(root)
    assert main(["check", "out/receipt.json", "--quick", "--workload", "work.py:build"]) == 0
    # the CLI runs the step in a child process (NOTE [workload in a child process]), out of the spy's reach:
    # the same check in this process shows the step it re-runs
    from remat.receipt import load_receipt
    from remat.workflow import check_receipt
    assert check_receipt(load_receipt("out/receipt.json"), quick=True, workload="work.py:build").passed
    assert seen and set(seen) == {(True, torch.bfloat16)}
    capsys.readouterr()
    assert main(["check", "out/receipt.json", "--quick", "--workload", "work.py:build", "--autocast", "fp16"]) == 2
    assert "made under autocast bfloat16" in " ".join(capsys.readouterr().err.split())


def test_check_fails_a_receipt_whose_context_drops_its_autocast(autocast_receipt, tmp_path, monkeypatch, capsys):
    import shutil
    root, _ = autocast_receipt
    shutil.copy(root / "work.py", tmp_path / "work.py")
    shutil.copytree(root / "out", tmp_path / "out")
    d = json.loads((tmp_path / "out" / "receipt.json").read_text())
    del d["context"]["autocast"]        # as if made without autocast: the check would run another step
    (tmp_path / "out" / "receipt.json").write_text(json.dumps(d))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "out/receipt.json", "--quick", "--workload", "work.py:build", "--no-reports"]) == 1
    assert "the verification ran with autocast bfloat16" in " ".join(capsys.readouterr().out.split())


def test_auto_plans_and_verifies_under_autocast_and_keys_its_cache_on_it(tmp_path):
    import remat
    from remat.autoplan import CacheStatus, VerifyStatus
    from remat.errors import AutoError
    from .test_auto import FAST, ex, tiny
    model, batch = tiny()
    # bf16 activations are half the bytes: the floor is higher relative to the peak than in float32
    kw = dict(budget="90%", loss_fn=ex.loss_fn, cache_dir=tmp_path, **FAST)
    h = remat.auto(model, batch, autocast="bf16", verify="quick", **kw)
    r = h.report
    assert (r.autocast, r.verification, r.cache) == ("bfloat16", VerifyStatus.PASSED, CacheStatus.STORED)
    assert r.tolerances["float32"] == Tolerance(rtol=1.6e-2, atol=1e-5) and "autocast bfloat16" in r.summary()
    h.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):        # the caller's own block: the same step, the same key
        h = remat.auto(model, batch, **kw)
    assert (h.report.autocast, h.report.cache) == ("bfloat16", CacheStatus.HIT)
    h.remove()
    h = remat.auto(model, batch, **kw)                        # the plain float32 step: another key, planned anew
    assert (h.report.autocast, h.report.cache) == (None, CacheStatus.STORED)
    assert h.report.tolerances["float32"] == TOLERANCES["float32"]
    h.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(AutoError, match=r"autocast=.float16.*dtype=bfloat16"):
        remat.auto(model, batch, autocast="fp16", **kw)
