"""The CI-sized zoo (issue 11): models remat was not written against, at tiny shapes.

Each model runs the receipt's stages through the library: trace, profile, plan (optimal,
closed loop) at a budget halfway between the predicted floor and the control peak, verify,
and the trace of the step with the plan applied (the receipt stage where the MultiheadAttention
defect surfaced). What must hold (issue 11): nothing but a typed RematError escapes; a plan
ships whenever the floor is clearly below the control peak; its measured peak is within the
budget; it verifies; the planned step can be traced. The full zoo at realistic shapes is
``make zoo`` (benchmarks/zoo/run.py -> benchmarks/ZOO.md).

Tests marked xfail(strict=True) fail today because of a named remat defect; when it is fixed
the test passes, strict xfail turns that into a failure, and the mark must go.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from remat.closed_loop import plan_closed_loop
from remat.errors import RematError
from remat.plan import Plan, peak_floor
from remat.profile import profile_workload
from remat.workflow import trace_planned
from remat.trace import trace_workload
from remat.verify import verify_plan
from remat.workload import load_workload

ZOO = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo"
RESERVE = 0.05


def need_torchvision() -> None:
    """Skip without torchvision. An installed torchvision that does not import fails the test (never hidden:
    ``make test`` makes it import, NOTE [torchvision import hook] in benchmarks/zoo/_torchvision_cpu.py)."""
    pytest.importorskip("torchvision", reason="torchvision is not installed (pip install -e '.[zoo]')")


@dataclasses.dataclass
class Outcome:
    control_peak: int
    floor: int
    budget: int
    report: object
    plan: Plan | None


def run_stages(name: str, shape: dict, *, require_plan: bool) -> Outcome:
    """trace -> profile -> plan (closed loop) -> verify -> trace with the plan; asserts as it goes.

    The budget puts the *effective* budget (after the 5% reserve) halfway between the predicted
    floor and the control peak, so a plan exists whenever the cost model is right.
    ``require_plan``: the model is at a shape where checkpointing must lower the peak (its floor
    is at most 95% of the control), so a refusal fails the test instead of skipping it.
    """
    loaded = load_workload(f"{ZOO / (name + '.py')}:build", shape)
    trace = trace_workload(loaded, warmup=1, steps=1)
    assert trace.peak_bytes > 0 and trace.peak_phase is not None
    report = profile_workload(loaded, warmup=1, repeats=2)
    control = report.baseline_peak_bytes
    floor = peak_floor(report)
    assert 0 < floor <= control, (floor, control)
    if require_plan:
        assert floor <= 0.95 * control, (
            f"{name}: the predicted floor {floor} is {floor / control:.0%} of the control peak {control}; "
            f"excluded: {dict(list(report.excluded.items())[:4])}")
    budget = math.ceil((floor + control) / 2 / (1 - RESERVE))
    try:
        closed = plan_closed_loop(loaded, report, "optimal", budget_bytes=budget, reserve=RESERVE)
    except RematError as exc:
        assert exc.message   # typed, with a reason
        if require_plan:
            raise AssertionError(f"{name}: refused a budget above the floor: {exc.message}") from exc
        return Outcome(control_peak=control, floor=floor, budget=budget, report=report, plan=None)
    plan = closed.plan
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= budget, (
        f"{name}: measured peak {plan.measured_peak_bytes} over the budget {budget} "
        f"(floor {floor}, control {control}; tries {[a.measured_peak_bytes for a in closed.attempts]})")
    if plan.boundaries:
        v = verify_plan(loaded, plan, steps=2, seeds=1, timing_steps=0)
        assert v.passed, f"{name}: {v.failures[:3]}"
        planned = trace_planned(loaded, plan, warmup=1, steps=1)   # receipt stage 6
        assert planned.peak_bytes <= budget
    elif require_plan:
        raise AssertionError(f"{name}: nothing planned though the floor is {floor / control:.0%} of the control")
    return Outcome(control_peak=control, floor=floor, budget=budget, report=report, plan=plan)


def test_zoo_torch_transformer_encoder():
    """nn.TransformerEncoder, pre-norm, GELU, with a src_key_padding_mask."""
    out = run_stages("torch_transformer_encoder", dict(batch_size=4, seq_len=32, n_layer=2, d_model=64),
                     require_plan=True)
    assert any(b.module.startswith("encoder.layers.") for b in out.plan.boundaries)


def test_zoo_mha_three_distinct_tensors():
    """nn.MultiheadAttention(q, k, v) with three distinct tensors: plan, verify and trace with the plan."""
    out = run_stages("own_mha", dict(batch_size=4, seq_len=32, n_layer=2, d_model=64), require_plan=True)
    assert out.plan.boundaries


def test_zoo_inplace_relu_between_modules():
    """``f = a(x).relu_(); b(f)``: no in-place hazard on ``b``, and the blocks stay plannable."""
    out = run_stages("own_inplace_decoder", dict(batch_size=16, seq_len=64, n_layer=2, d_model=64),
                     require_plan=True)
    flagged = {c.name: [h.detail for h in c.hazards] for c in out.report.candidates if c.hazards}
    assert not flagged, flagged
    assert {"blocks.0", "blocks.1"} <= {c.name for c in out.report.candidates}
    assert any(b.module in ("blocks.0", "blocks.1") for b in out.plan.boundaries)


def test_zoo_unet_down_up_stages():
    """The U-Net's Down/Up stages (distinct classes with children) are candidates and get planned."""
    out = run_stages("own_unet", dict(batch_size=2, image_size=32, width=8), require_plan=True)
    stages = {"inc", "down1", "down2", "down3", "up1", "up2", "up3"}
    assert stages & {c.name for c in out.report.candidates}
    names = {b.module for b in out.plan.boundaries}
    assert any(n.split(".")[0] in stages for n in names), names


def test_zoo_hf_gpt2():
    pytest.importorskip("transformers")
    out = run_stages("hf_gpt2", dict(batch_size=2, seq_len=32, n_layer=2, n_embd=64, vocab_size=256),
                     require_plan=True)
    assert any(b.module.startswith("transformer.h.") for b in out.plan.boundaries)


def test_zoo_torchvision_resnet18():
    """torchvision resnet18 (ReLU inplace, BatchNorm). At CI size its peak is weights, gradients and
    momentum (the floor is about 97% of the control peak), so this is a no-crash check: a shipped
    plan fits and verifies, or a typed refusal."""
    need_torchvision()
    out = run_stages("tv_resnet18", dict(batch_size=8, image_size=64, num_classes=10), require_plan=False)
    assert out.plan is None or out.plan.measured_peak_bytes <= out.budget
