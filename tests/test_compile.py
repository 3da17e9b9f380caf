"""torch.compile (issue 16): compiled arms, their peaks, verification under compile, the torch budget aimed at a peak.

Compiles are slow on a 2-core CPU (about 5-15 s each for these tiny models), so the default suite
keeps a few; the ``compile`` marker holds the rest (``make test-compile``).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from remat.wrap import PlanArm
from remat.frontier import FrontierSettings, run_frontier
from remat.measure import Arm, CompileSpec, measure_arm
from remat.memory import profiler_step_peak
from remat.errors import RematError
from remat.types import MemorySource
from remat.verify import COMPILED_TOLERANCES, verify_plan
from remat.workload import TrainingStep, load_workload

from .conftest import TINY, hand_plan

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# An mlp whose saved activations dominate its peak, so activation_memory_budget moves it.
MLP = {"batch_size": 256, "width": 64, "depth": 4, "d_in": 8}
GPT = {**TINY["gpt"], "dropout": 0.0}


def test_compile_spec_refuses_bad_budgets_and_backends():
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(RematError, match="activation_memory_budget"):
            CompileSpec(memory_budget=bad)
    with pytest.raises(RematError, match="backend"):
        CompileSpec(backend="tensorrt")
    assert CompileSpec.from_json(CompileSpec(memory_budget=0.25).to_json()) == CompileSpec(memory_budget=0.25)


def test_compiled_arms_keep_their_own_graphs_and_budget():
    """Two compiled arms of one model class, different budgets: different measured peaks, each by
    torch.profiler's allocator events (the instrument is named), compile time apart from warm steps."""
    # aot_eager: AOTAutograd's partitioner (where the budget acts) without inductor's codegen, so the
    # test costs about a second per compile; inductor runs in the verify test below
    loaded = load_workload("mlp", MLP)
    default = measure_arm(loaded, Arm("c1", compile=CompileSpec(backend="aot_eager")), warmup=2, steps=2)
    half = measure_arm(loaded, Arm("c.5", compile=CompileSpec(backend="aot_eager", memory_budget=0.5)), warmup=2,
                       steps=2)
    eager = measure_arm(loaded, Arm("eager"), warmup=2, steps=0)
    assert default.memory_source is MemorySource.CPU_PROFILER and half.memory_source is MemorySource.CPU_PROFILER
    assert eager.memory_source in (MemorySource.CPU_ALLOCATOR, MemorySource.CPU_LIVE_TENSORS)
    # ground truth for the default arm: torch's default budget (1.0) saves what eager saves, so the
    # compiled peak is the eager peak the tracker measured, within 1% (inductor frees a few temporaries earlier)
    assert abs(default.peak_bytes - eager.peak_bytes) <= 0.01 * eager.peak_bytes
    # the budget arm recompiled with its own ratio: a lower peak (it recomputes some activations)
    assert half.peak_bytes < 0.95 * default.peak_bytes
    assert default.compile_s is not None and default.compile_s > 0.2   # a compile, not a warm step
    assert max(default.step_ms) < default.compile_s * 1e3


@pytest.mark.compile
def test_module_compile_shares_one_graph_across_builds():
    """The wrong way, which remat avoids (NOTE [compiled arms]): nn.Module.compile() on two builds
    shares one Dynamo cache, so the second build's budget never takes effect (same peak)."""
    import torch._functorch.config as fc
    loaded = load_workload("mlp", MLP)
    peaks = []
    for ratio in (1.0, 0.5):
        fresh = loaded.rebuild()
        fresh.workload.model.compile()
        step = TrainingStep(fresh.workload)
        with fc.patch(activation_memory_budget=ratio):
            step.run(0)
            step.run(1)
            peaks.append(profiler_step_peak(step, 2))
    assert peaks[0] == peaks[1]
    torch._dynamo.reset()


def test_verify_under_compile_passes_and_still_rejects_the_perturbed_gradient():
    loaded = load_workload("gpt", GPT)
    plan = hand_plan(loaded.workload.model, ["h.0", "h.1"])
    report = verify_plan(loaded, plan, steps=2, seeds=1, timing_steps=0, compile=CompileSpec())
    assert report.passed, report.failures
    assert report.compile == {"backend": "inductor", "memory_budget": None}
    assert report.tolerances == COMPILED_TOLERANCES
    # ground truth: the compiled planned step replays each block once per step (eager probe)
    assert {b.module: b.replay_calls["train"] for b in report.boundaries} == {"h.0": 1, "h.1": 1}
    neg = {n.name: n for n in report.negative_controls}
    assert neg["perturbed_gradient"].applicable and neg["perturbed_gradient"].rejected
    # the tolerance that passed is tighter than the perturbation the negative control applies
    assert COMPILED_TOLERANCES["float32"].rtol * 4 <= report.perturbation
    for s in report.per_step:
        assert s.grad_max_rel <= COMPILED_TOLERANCES["float32"].rtol


def test_a_segment_traces_into_one_graph_and_holds_no_output_after_the_step():
    """A segment (NOTE [segment wrapper]) under Dynamo: one graph (ground truth: Dynamo's counter),
    the same loss as eager, and no segment output held after the step."""
    from torch._dynamo.testing import CompileCounter
    from remat.wrap import apply

    def run() -> tuple[int, float, list]:
        loaded = load_workload("mlp", MLP)
        model = loaded.workload.model
        handle = apply(model, hand_plan(model, ["blocks[0:2]", "blocks.3"]))
        counter = CompileCounter()
        torch._dynamo.reset()
        model.compile(backend=counter)
        loss = TrainingStep(loaded.workload).run(0)
        held = [w._traced_last for w in handle.wrappers if hasattr(w, "_traced_last")]
        handle.remove()
        torch._dynamo.reset()
        return counter.frame_count, loss, held
    graphs, loss, held = run()
    eager_loss = TrainingStep(load_workload("mlp", MLP).workload).run(0)
    assert graphs == 1 and loss == pytest.approx(eager_loss, rel=1e-5) and held == [None]


@pytest.mark.compile
def test_verify_under_compile_with_dropout_draws_the_controls_masks(monkeypatch):
    """Dropout under compile (NOTE [compiled arms], *Random numbers*): with random ops in program
    order the compiled plan (full and selective regions) equals the compiled control, and so does
    a guarded region whose graph breaks; with inductor's own random kernels (the wrong case) the
    graph-broken plan fails (its graphs differ from the control's). RNG preservation off
    matches too, because a traced checkpoint replays from the forward's RNG state: reported
    as not applicable, and the perturbed gradient is still rejected."""
    import remat.verify.runner as runner
    from remat.types import CheckpointMode
    loaded = load_workload("gpt", {**TINY["gpt"], "dropout": 0.1})
    plan = hand_plan(loaded.workload.model, ["h.0"])
    plan.boundaries += hand_plan(loaded.workload.model, ["h.1"], mode=CheckpointMode.SELECTIVE).boundaries
    report = verify_plan(loaded, plan, steps=1, seeds=1, timing_steps=0, compile=CompileSpec())
    assert report.passed, report.failures
    assert any("fallback_random" in w for w in report.warnings)
    neg = {n.name: n for n in report.negative_controls}
    assert not neg["rng_preservation_off"].applicable and "matched the control" in neg["rng_preservation_off"].detail
    assert neg["perturbed_gradient"].applicable and neg["perturbed_gradient"].rejected
    # a region whose graph breaks (here: the wrapper made to take its eager path, as a module with an
    # op Dynamo cannot trace would) compiles into other graphs than the control's, and only
    # program-order random ops still draw the control's masks
    import remat.wrap.wrapper as wrapper
    monkeypatch.setattr(wrapper, "_tracing", lambda: False)
    broken = hand_plan(loaded.workload.model, ["h.0"])
    assert verify_plan(loaded, broken, steps=1, seeds=1, timing_steps=0, compile=CompileSpec()).passed
    monkeypatch.setattr(runner, "random_ops_in_program_order", contextlib.nullcontext)
    wrong = verify_plan(loaded, broken, steps=1, seeds=1, timing_steps=0, compile=CompileSpec())
    assert not wrong.passed
    torch._dynamo.reset()


def test_planned_regions_trace_into_one_graph(monkeypatch):
    """NOTE [wrapper under compile]: full, selective and guarded regions become checkpoint ops
    inside one Dynamo graph (ground truth: Dynamo's own graph counter); the wrapper's eager path
    (what every region took before) breaks the graph."""
    import remat.wrap.wrapper as wrapper
    from torch._dynamo.testing import CompileCounter
    from remat.wrap import apply
    from remat.types import CheckpointMode

    def graphs(plan) -> int:
        loaded = load_workload("gpt", GPT)
        model = loaded.workload.model
        handle = apply(model, plan(model))
        counter = CompileCounter()
        torch._dynamo.reset()
        out = torch.compile(model, backend=counter)(loaded.workload.batch(0)[0])
        out.float().sum().backward()
        handle.remove()
        torch._dynamo.reset()
        return counter.frame_count

    def mixed(model):
        plan = hand_plan(model, ["h.0"])
        plan.boundaries += hand_plan(model, ["h.1"], mode=CheckpointMode.SELECTIVE).boundaries
        return plan
    assert graphs(lambda m: hand_plan(m, [])) == 1
    assert graphs(mixed) == 1
    assert graphs(lambda m: hand_plan(m, ["h.0"], guarded=True)) == 1
    monkeypatch.setattr(wrapper, "_tracing", lambda: False)
    assert graphs(mixed) > 1


@pytest.mark.compile
def test_guarded_batchnorm_regions_trace_and_verify_compiled(monkeypatch):
    """The zoo U-Net (BatchNorm in every region, guarded): traced into the graph, the compiled plan
    equals the compiled control, buffers and num_batches_tracked included; through the eager path
    (graph breaks, other graphs) its gradients differ from the control's by about 1% (the wrong case)."""
    import remat.wrap.wrapper as wrapper
    loaded = load_workload("benchmarks/zoo/own_unet.py:build", {})
    plan = hand_plan(loaded.workload.model, ["inc", "down1.conv"], guarded=True)
    report = verify_plan(loaded, plan, steps=1, seeds=1, timing_steps=0, compile=CompileSpec())
    assert report.passed, report.failures
    monkeypatch.setattr(wrapper, "_tracing", lambda: False)
    wrong = verify_plan(loaded, plan, steps=1, seeds=1, timing_steps=0, compile=CompileSpec())
    assert not wrong.passed and any("grad" in f for f in wrong.failures)


@pytest.mark.compile
def test_frontier_aims_torch_budget_at_the_peak():
    """frontier --compile: the compiled control does not fit 85%; the bisection finds a ratio whose
    measured compiled peak fits, and every try is recorded with its measured peak."""
    from remat.profile import profile_workload
    loaded = load_workload("mlp", MLP)
    prof = profile_workload(loaded)
    budget = int(prof.baseline_peak_bytes * 0.85)
    report = run_frontier(loaded, FrontierSettings(budget_bytes=budget, reserve=0.0, plans="none", steps=3, warmup=1,
                                                   capacity_key=None, compile=CompileSpec(), budget_tries=3),
                          report=prof)
    labels = [p.plan for p in report.points]
    assert labels[:2] == ["none", "none+compile"]
    tries = report.budget_search
    assert tries[0].ratio == 1.0 and not tries[0].fits          # torch's default: the compiled control
    assert tries[1].ratio == 0.5                                   # bisection starts in the middle
    assert all((t.peak_bytes is not None and t.peak_bytes <= budget) == t.fits for t in tries)
    fitting = [t for t in tries if t.fits]
    assert fitting, [(t.ratio, t.peak_bytes) for t in tries]
    best = max(fitting, key=lambda t: t.ratio)
    point = report.point(f"torch-budget@{best.ratio:g}")
    assert point.peak_bytes == best.peak_bytes and point.memory_source == "cpu-profiler-allocator"
    assert point.p50_ms is not None and point.fits
    assert report.point("none+compile").compile == {"backend": "inductor", "memory_budget": None}
    # the shipped plan says how it runs: a torch-budget arm ships as the unplanned model compiled at its ratio
    assert report.shipped is not None
    shipped = report.shipped_plan
    if report.shipped.plan.startswith("torch-budget@"):
        assert shipped.compile.memory_budget == best.ratio and shipped.boundaries == []


def test_frontier_compile_refuses_zero_budget_tries():
    loaded = load_workload("mlp", TINY["mlp"])
    with pytest.raises(RematError, match="budget_tries"):
        run_frontier(loaded, FrontierSettings(budget_bytes=10**9, compile=CompileSpec(), budget_tries=0,
                                              capacity_key=None))


def test_plan_json_carries_the_compile_spec_and_refuses_a_bad_one():
    """A plan made with --compile says how it runs; the hardened loader checks the field like any other."""
    import json
    from remat.plan import Plan
    from remat.errors import PlanError
    loaded = load_workload("mlp", TINY["mlp"])
    plan = hand_plan(loaded.workload.model, ["blocks.0"])
    plan.compile = CompileSpec(memory_budget=0.4)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.compile == CompileSpec(memory_budget=0.4)
    assert PlanArm("p", again).compile == CompileSpec(memory_budget=0.4)   # measured compiled wherever it runs
    bad = plan.to_json()
    bad["compile"] = {"backend": "inductor", "memory_budget": 1.5}
    with pytest.raises(PlanError, match="compile"):
        Plan.from_json(bad)
    bad["compile"] = {"backend": "inductor", "memory_budget": 0.5, "code": "import os"}
    with pytest.raises(PlanError):
        Plan.from_json(bad)


def test_modes_not_covered_follow_the_compiled_receipt():
    from remat.workflow.build import unsupported_modes
    loaded = load_workload("mlp", TINY["mlp"])
    eager_plan = hand_plan(loaded.workload.model, ["blocks.0"])
    compiled_plan = hand_plan(loaded.workload.model, ["blocks.0"])
    compiled_plan.compile = CompileSpec()
    modes = lambda plan, compiled: [m.mode for m in unsupported_modes(loaded, plan, None, compiled=compiled)]  # noqa: E731
    assert "torch.compile" in modes(eager_plan, False)            # an eager receipt: compile not covered
    assert "torch.compile" not in modes(compiled_plan, True)      # a compiled receipt shipping a compiled plan
    assert "eager execution" in modes(compiled_plan, True)        # ... then eager is what was not verified
    assert "torch.compile" in modes(eager_plan, True)             # --compile, but the eager plan shipped


def test_held_bytes_refuse_a_compiled_arm():
    """The live-tensor tracker would run compiled code eagerly: measuring held bytes on a compiled arm
    is refused (typed), never silently an eager figure."""
    from remat.measure import held_bytes_at_phase, probe_capacity
    from remat.types import Phase
    loaded = load_workload("mlp", TINY["mlp"])
    arm = Arm("c", compile=CompileSpec())
    with pytest.raises(RematError, match="tracker"):
        held_bytes_at_phase(loaded, arm, Phase.BACKWARD)
    probe = probe_capacity(loaded, arm, "batch_size", 16, 10**9)
    assert probe.peak_bytes is None and "compiled" in (probe.error or "")


@pytest.mark.compile
def test_receipt_with_compile_ships_verifies_and_checks_compiled(tmp_path):
    from remat.workflow import check_receipt, make_receipt
    from remat.receipt.model import RunSettings
    loaded = load_workload("mlp", MLP)
    settings = RunSettings(verify_steps=1, verify_seeds=1, verify_timing_steps=0, frontier_plans=["none", "optimal"],
                           frontier_steps=3, frontier_warmup=1, capacity_key=None, trace_steps=1, trace_warmup=1)
    receipt = make_receipt(loaded, budget="85%", reserve=0.0, settings=settings, compile=CompileSpec())
    assert receipt.settings.compile == {"backend": "inductor", "memory_budget": None}
    compiled_points = [p for p in receipt.frontier.points if p.compile is not None]
    assert compiled_points and all(p.memory_source == "cpu-profiler-allocator" for p in compiled_points)
    assert receipt.frontier.budget_search and receipt.frontier.budget_search[0].ratio == 1.0
    assert receipt.shipped
    plan = receipt.plan.plan
    if plan.compile is not None:
        assert receipt.verification is not None and receipt.verification.compile is not None
        assert "torch.compile" not in [m.mode for m in receipt.unsupported]
    report = check_receipt(receipt, quick=True)
    assert report.passed, report.failures


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_peaks_on_cuda_come_from_the_allocator():
    loaded = load_workload("mlp", {**MLP, "batch_size": 4096, "width": 256}, device="cuda")
    default = measure_arm(loaded, Arm("c1", compile=CompileSpec()), warmup=2, steps=2)
    half = measure_arm(loaded, Arm("c.5", compile=CompileSpec(memory_budget=0.5)), warmup=2, steps=2)
    eager = measure_arm(loaded, Arm("eager"), warmup=2, steps=0)
    assert default.memory_source is MemorySource.CUDA_ALLOCATOR is half.memory_source
    # the allocator's peak of the compiled default step is within 10% of the eager step's (same saved set)
    assert abs(default.peak_bytes - eager.peak_bytes) <= 0.10 * eager.peak_bytes
    assert half.peak_bytes < default.peak_bytes


def test_parameter_tolerance_under_compile_is_two_learning_rates():
    """Ground truth by hand: AdamW's first step moves an element by lr x sign(grad); a sign flip of a
    near-zero gradient element is 2 lr, which the compiled parameter tolerance allows and no more."""
    from remat.verify.runner import _param_tolerances
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.tensor([1e-6, -1e-6, 1.0, -1.0])   # 1e-6: within compiled rounding of a 0.1-sized gradient
    opt.step()
    flipped = torch.nn.Parameter(torch.zeros(4))
    opt2 = torch.optim.AdamW([flipped], lr=1e-3)
    flipped.grad = torch.tensor([-1e-6, -1e-6, 1.0, -1.0])   # one element's sign flipped by rounding
    opt2.step()
    diff = float((p - flipped).abs().max())
    assert 0.98 * 2e-3 < diff <= 2e-3   # 2 lr x |g| / (|g| + eps), eps = 1e-8
    tol = _param_tolerances(COMPILED_TOLERANCES, opt)["float32"]
    assert tol.allows(diff, float(p.abs().max())) and not COMPILED_TOLERANCES["float32"].allows(diff, float(p.abs().max()))
    assert not tol.allows(3 * diff, float(p.abs().max()))
