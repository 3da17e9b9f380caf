"""remat.verify: clean plans pass bitwise; RNG-off, perturbed gradients, BatchNorm and counters are caught."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from remat.cli.main import main
from remat.types import CheckpointMode, HazardKind
from remat.verify import DeviceMoveDetector, VerifyReport, verify_plan
from remat.workload import LoadedWorkload, load_workload

from .conftest import FIXTURES, TINY, hand_plan as make_plan

FOREIGN = f"{FIXTURES / 'foreign_workload.py'}:build"
REQUIRED_KEYS = {"schema_version", "passed", "steps", "seeds", "tolerances", "per_step", "first_divergent_module",
                 "rng_policy", "rng_overhead_ms", "hazards", "negative_controls"}


def negative(report: VerifyReport, name: str):
    return next(n for n in report.negative_controls if n.name == name)


@pytest.fixture(scope="module")
def gpt() -> LoadedWorkload:
    return load_workload("gpt", TINY["gpt"])  # dropout 0.1


@pytest.fixture(scope="module")
def cnn() -> LoadedWorkload:
    return load_workload("cnn", TINY["cnn"])


CNN_BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]


def test_gpt_every_block_verifies_clean_and_bitwise(gpt):
    report = verify_plan(gpt, make_plan(gpt.workload.model, ["h.0", "h.1"]), timing_steps=2)
    assert report.passed, report.failures
    assert len(report.per_step) == 3 * (3 + 1)  # 3 seeds x (3 train steps + 1 eval step)
    assert all(s.bitwise and s.passed for s in report.per_step)  # CPU float32, eager non-reentrant: bit-exact
    assert {s.mode for s in report.per_step} == {"train", "eval"}
    assert report.hazards == [] and report.first_divergent_module is None and report.repeatable
    # Negative controls ran and were rejected; RNG-off is caught in the last block, where backward starts.
    rng_off = negative(report, "rng_preservation_off")
    assert rng_off.applicable and rng_off.rejected and "first divergent module h.1" in rng_off.detail
    assert negative(report, "perturbed_gradient").rejected
    assert report.rng_policy.policy == "preserve" and report.rng_policy.boundaries_drawing_rng == ("h.0", "h.1")
    # The report says each block runs twice per step, in train and in eval mode.
    assert [(b.module, b.forward_calls, b.replay_calls) for b in report.boundaries] == [
        ("h.0", {"train": 1, "eval": 1}, {"train": 1, "eval": 1}),
        ("h.1", {"train": 1, "eval": 1}, {"train": 1, "eval": 1})]
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert REQUIRED_KEYS <= data.keys()
    assert isinstance(data["rng_overhead_ms"], float)
    assert {"loss", "grad_max_abs", "grad_max_rel", "bitwise", "grad_norm"} <= data["per_step"][0].keys()
    assert data["negative_controls"][0].keys() >= {"name", "rejected"}


def test_gpt_selective_verifies_clean(gpt):
    report = verify_plan(gpt, make_plan(gpt.workload.model, ["h.0", "h.1"], mode=CheckpointMode.SELECTIVE),
                         steps=2, seeds=1, timing_steps=0)
    assert report.passed, report.failures
    assert report.rng_timing is None and report.to_json()["rng_overhead_ms"] is None


def test_plan_without_rng_preservation_fails_and_names_the_block(gpt):
    report = verify_plan(gpt, make_plan(gpt.workload.model, ["h.0", "h.1"], preserve_rng_state=False),
                         steps=2, seeds=1, timing_steps=0)
    assert not report.passed
    assert report.rng_policy.policy == "off" and "draw random numbers" in report.rng_policy.justification
    bad = next(s for s in report.per_step if not s.passed)
    assert (bad.step, bad.first_divergence) == (0, "gradient")
    assert report.first_divergent_module.startswith("h.1.")
    assert any(h.kind is HazardKind.RNG and "h.0" in h.module for h in report.hazards)  # replays drew live RNG


def test_cnn_guarded_batchnorm_verifies_clean(cnn):
    report = verify_plan(cnn, make_plan(cnn.workload.model, CNN_BLOCKS, guarded=True), steps=2, seeds=2,
                         timing_steps=0)
    assert report.passed, report.failures
    assert all(s.bitwise for s in report.per_step)  # buffers included
    rng_off = negative(report, "rng_preservation_off")
    assert not rng_off.applicable and rng_off.rejected is None and "no planned boundary draws" in rng_off.detail
    assert negative(report, "perturbed_gradient").rejected
    assert all(b.replay_mutations == [] for b in report.boundaries)  # the guard undid the replay's update


def test_cnn_unguarded_batchnorm_is_caught_with_module_named(cnn):
    report = verify_plan(cnn, make_plan(cnn.workload.model, CNN_BLOCKS), steps=2, seeds=1, timing_steps=0)
    assert not report.passed
    details = [h.detail for h in report.hazards if h.kind is HazardKind.BUFFER_MUTATION and h.module == "blocks.0"]
    assert any(d.startswith("blocks.0.bn1.num_batches_tracked: +2 instead of +1") for d in details), details
    assert report.first_divergent_module == "blocks.0.bn1"
    train0 = report.per_step[0]
    assert train0.grads_bitwise and not train0.passed  # gradients equal, statistics not: issue 96136
    assert any(s.mode == "eval" and s.first_divergence == "forward output" for s in report.per_step)
    assert "blocks.0.bn1.running_mean" in report.boundaries[0].replay_mutations


def test_python_counter_in_a_block_is_caught():
    lw = load_workload(FOREIGN, {"counting": 1})
    report = verify_plan(lw, make_plan(lw.workload.model, ["blocks.1"]), steps=2, seeds=1, timing_steps=0)
    assert not report.passed
    hz = [h for h in report.hazards if h.kind is HazardKind.PYTHON_STATE]
    assert [(h.module, h.detail, h.mode) for h in hz] == [("blocks.1", "blocks.1.calls: 1 -> 2", "train"),
                                                          ("blocks.1", "blocks.1.calls: +2 instead of +1 this step (3 -> 6)", "eval")]
    assert report.first_divergent_module == "blocks.1"


def test_foreign_workload_verifies_clean():
    """Tied weights, keyword args into blocks, tuple outputs, in-place activations, dropout: all clean."""
    lw = load_workload(FOREIGN)
    report = verify_plan(lw, make_plan(lw.workload.model, ["blocks.0", "blocks.1"]), steps=2, seeds=2,
                         timing_steps=0)
    assert report.passed, report.failures
    assert all(s.bitwise for s in report.per_step)
    assert negative(report, "rng_preservation_off").rejected and negative(report, "perturbed_gradient").rejected


def test_planned_step_that_raises_is_a_failure_not_a_crash():
    # SELECTIVE saves fc2's matmul output, which the block then scales in place: torch refuses at backward.
    lw = load_workload(FOREIGN)
    report = verify_plan(lw, make_plan(lw.workload.model, ["blocks.0"], mode=CheckpointMode.SELECTIVE),
                         steps=1, seeds=1, timing_steps=0)
    assert not report.passed
    assert any("raised RuntimeError" in f and "mutated" in f for f in report.failures), report.failures


def test_device_move_detector_sees_cross_device_copies():
    with DeviceMoveDetector() as det:
        torch.ones(3).to("meta")
        torch.ones(3) * 2.0
    assert det.moves == ["_to_copy: cpu -> meta"]


def test_cli_verify_writes_json_and_maps_exit_codes(tmp_path, capsys):
    shape = ",".join(f"{k}={v}" for k, v in TINY["cnn"].items())
    model = load_workload("cnn", TINY["cnn"]).workload.model
    args = ["verify", "--workload", "cnn", "--shape", shape, "--steps", "1", "--seeds", "1", "--timing-steps", "1"]
    good = make_plan(model, CNN_BLOCKS, guarded=True).save(tmp_path / "good.json")
    assert main([*args, "--plan", str(good), "--out", str(tmp_path / "a")]) == 0
    data = json.loads((tmp_path / "a" / "verify.json").read_text())
    assert REQUIRED_KEYS <= data.keys() and data["passed"] is True
    assert "PASSED" in capsys.readouterr().out

    bad = make_plan(model, CNN_BLOCKS).save(tmp_path / "bad.json")  # unguarded BatchNorm
    assert main([*args, "--plan", str(bad), "--out", str(tmp_path / "b")]) == 1
    data = json.loads((tmp_path / "b" / "verify.json").read_text())
    assert data["passed"] is False and data["hazards"][0]["module"] == "blocks.0"

    (tmp_path / "broken.json").write_text("{not json")
    assert main([*args, "--plan", str(tmp_path / "broken.json"), "--out", str(tmp_path / "c")]) == 2
    other = make_plan(load_workload("mlp", TINY["mlp"]).workload.model, ["blocks.0"]).save(tmp_path / "other.json")
    assert main([*args, "--plan", str(other), "--out", str(tmp_path / "d")]) == 2  # fingerprint mismatch
    assert "another model" in capsys.readouterr().err
    assert not (tmp_path / "d" / "verify.json").exists()


def test_report_json_round_trips_non_finite_numbers():
    from remat.verify import StepComparison
    s = StepComparison(seed=0, step=0, mode="train", loss=(1.0, float("nan")), outputs_max_abs=None,
                       grad_max_abs=float("inf"), grad_max_rel=float("inf"), grads_bitwise=False,
                       grad_norm=(1.0, 2.0), params_max_abs=0.0, buffers_max_abs=0.0, bitwise=False,
                       divergent=["grad w"], first_divergent_module="w", first_divergence="gradient", passed=False)
    d = s.to_json()
    json.dumps(d, allow_nan=False)
    assert d["grad_max_abs"] == "inf" and d["loss"] == [1.0, "nan"]
    assert dataclasses.is_dataclass(s)


def test_selective_on_guarded_batchnorm_blocks_verifies_clean():
    """Regression: the BN guard's snapshot used to run inside SAC's recompute mode and fail
    ("aten.clone.default encountered during backward but not found in storage")."""
    from remat.plan import make_plan
    from remat.profile import profile_workload
    from remat.types import CheckpointMode
    from remat.verify import verify_plan
    from remat.workload import load_workload
    shape = {"batch_size": 4, "image_size": 8, "width": 8, "blocks_per_stage": 1}
    loaded = load_workload("cnn", shape)
    plan = make_plan(profile_workload(loaded, repeats=1), "selective")
    assert plan.boundaries and all(b.mode is CheckpointMode.SELECTIVE and b.guarded for b in plan.boundaries)
    report = verify_plan(loaded, plan, steps=2, seeds=1, timing_steps=0)
    assert report.passed, report.failures


def test_verify_owns_its_json_and_structured_findings(cnn):
    """VerifyReport.from_json(to_json) is the same report; failures are read as records, not split strings."""
    report = verify_plan(cnn, make_plan(cnn.workload.model, ["blocks.0"]), steps=1, seeds=1, timing_steps=0)
    assert not report.passed and report.hazards   # unguarded BatchNorm: a buffer hazard
    back = VerifyReport.from_json(json.loads(json.dumps(report.to_json())))
    assert back.to_json() == report.to_json()
    from remat.verify.model import RunMode
    assert [s.mode for s in back.per_step] == [RunMode.TRAIN, RunMode.EVAL]
    assert back.boundaries[0].mode is CheckpointMode.FULL and back.hazards[0].mode in (RunMode.TRAIN, RunMode.EVAL)
    # the rule the receipt used to apply to the strings itself, as the independent reference
    def by_strings(module):
        under = lambda n: n is not None and (n == module or n.startswith(module + "."))  # noqa: E731
        return (any(under(d.split(" ", 1)[-1]) for st in report.per_step for d in st.divergent)
                or any(under(st.first_divergent_module) for st in report.per_step)
                or any(module in [m.strip() for m in h.module.split(",")] for h in report.hazards))
    names = [n for n, _ in cnn.workload.model.named_modules() if n] + ["blocks.9"]
    assert [back.implicates(n) for n in names] == [by_strings(n) for n in names]
    assert back.implicates("blocks.0") and not back.implicates("blocks.9")
    # one hazard per (boundary, kind, state, mode): the state is the buffer, not the text around it
    states = [(h.module, h.kind, h.state, h.mode) for h in report.hazards]
    assert len(states) == len(set(states)) and all(h.state.startswith("blocks.0.") for h in report.hazards
                                                   if h.kind is HazardKind.BUFFER_MUTATION)


def test_implicates_matches_whole_module_paths():
    from remat.verify.model import Divergence, Hazard, StepComparison
    s = StepComparison(seed=0, step=0, mode="train", loss=(1.0, 1.0), outputs_max_abs=None, grad_max_abs=1.0,
                       grad_max_rel=1.0, grads_bitwise=False, grad_norm=(1.0, 1.0), params_max_abs=None,
                       buffers_max_abs=0.0, bitwise=False, divergent=["grad h.1.mlp.c_fc.weight", "rng cpu"],
                       first_divergent_module=None, first_divergence=None, passed=False)
    assert s.divergences == [Divergence("grad", "h.1.mlp.c_fc.weight"), Divergence("rng", "cpu")]
    hz = Hazard(module="h.3, h.4", kind=HazardKind.RNG, detail="cpu generator state differs")
    r = dataclasses.replace(_empty_report(), per_step=[s], hazards=[hz])
    assert r.implicates("h.1") and r.implicates("h.1.mlp") and not r.implicates("h.10") and not r.implicates("h.2")
    assert r.implicates("h.4") and not r.implicates("h.")


def _empty_report() -> VerifyReport:
    from remat.verify.model import RngPolicy
    return VerifyReport(passed=False, workload="w", shape={}, device="cpu", dtype="float32", planner="test",
                        plan_digest="0", steps=1, seeds=[0], tolerances={}, perturbation=1e-3, per_step=[],
                        first_divergent_module=None, rng_policy=RngPolicy(preserve_rng_state=True, policy="preserve",
                                                                          justification="", boundaries_drawing_rng=()),
                        rng_timing=None, hazards=[], negative_controls=[], boundaries=[], repeatable=True, failures=[])


def test_modes_given_as_words_become_enums():
    from remat.verify.model import BoundaryActivity, Hazard, RunMode
    h = Hazard(module="m", kind=HazardKind.RNG, detail="d", mode="eval")
    assert h.mode is RunMode.EVAL and h.to_json()["mode"] == "eval"
    a = BoundaryActivity(module="m", mode="selective", guarded=False, forward_calls={}, replay_calls={},
                         draws_rng=False, replay_mutations=[], device_moves=[])
    assert a.mode is CheckpointMode.SELECTIVE and a.to_json()["mode"] == "selective"
    with pytest.raises(ValueError):
        Hazard(module="m", kind=HazardKind.RNG, detail="d", mode="training")


# -- NOTE [deterministic kernels] --------------------------------------------------------------------

def test_deterministic_kernels_switch_on_for_cuda_and_restore():
    """The flags only (no CUDA needed): on for a CUDA workload, untouched for CPU, restored after."""
    import os
    from remat.verify.runner import deterministic_kernels
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    with deterministic_kernels("cpu"):
        assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels("cuda:0"):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == (before[2] or ":4096:8")
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG")) == before


@pytest.mark.cuda
def test_verify_on_cuda_control_repeats_itself_and_plan_passes():
    """On an H200 the unmodified gpt step (embedding backward uses atomics) did not repeat itself before
    deterministic kernels; with them the control repeats and a planned step verifies, and the perturbed
    gradient is still rejected."""
    lw = load_workload("gpt", TINY["gpt"], device="cuda")
    rep = verify_plan(lw, make_plan(lw.workload.model, ["h.0", "h.1"]), steps=2, seeds=1, timing_steps=0)
    assert rep.repeatable, rep.failures
    assert rep.passed, rep.failures
    assert any(n.name == "perturbed_gradient" and n.rejected for n in rep.negative_controls)


def test_cancelled_gradients_are_compared_at_the_models_scale():
    """NOTE [cancelled gradients]: a gradient wholly within rtol x the model's largest one (float32
    compiled: 1e-4) is rounding noise, compared at that scale; one above it keeps its own magnitude,
    so a one-part-in-a-thousand change of it is still caught. Hand-computed thresholds."""
    from remat.verify import COMPILED_TOLERANCES
    from remat.verify.compare import diff_tensor, largest_magnitude
    big = torch.full((4,), 1.0)
    tiny = torch.full((4,), 5e-6)                   # cancels to ~0: 5e-6 <= 1e-4 x 1.0
    small = torch.full((4,), 1e-2)                  # a real gradient, 100x under the largest
    assert largest_magnitude({"a": big, "b": tiny, "c": None}) == 1.0 and largest_magnitude({}) == 0.0
    t = COMPILED_TOLERANCES
    # tiny differs by 1.65x its own size (8.3e-6): noise at the model's scale (allowed 1e-6 + 1e-4 x 1.0) ...
    assert diff_tensor("g", tiny, tiny * 2.65, t, scale=1.0).ok
    # ... but not judged against its own magnitude (allowed 1e-6 + 1e-4 x 5e-6), nor with a larger error
    assert not diff_tensor("g", tiny, tiny * 2.65, t).ok
    assert not diff_tensor("g", tiny, tiny + 2e-4, t, scale=1.0).ok
    # small is not cancellation: one part in a thousand (1e-5) exceeds 1e-6 + 1e-4 x 1e-2 = 2e-6
    assert not diff_tensor("g", small, small * 1.001, t, scale=1.0).ok
    assert diff_tensor("g", small, small * (1 + 5e-5), t, scale=1.0).ok
