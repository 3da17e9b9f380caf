"""Simulated traces (FakeTensorMode on a meta-built model) and the roofline runtime model (issue 8)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from remat.cli.main import main
from remat.memory import profiler_memory_peak
from remat.simulate import (DeviceModel, KernelSemantics, OpCostRecorder, SimulationError, fit_calibration,
                            get_device_model, load_simulated, predict_runtime, simulate_trace, simulate_workload)
from remat.trace import StepTrace, trace_workload
from remat.types import CheckpointMode, MemorySource, Phase
from remat.workload import Workload, load_workload

from .conftest import FIXTURES, TINY

# Two shapes per built-in; the second gpt has no dropout, so CPU attention takes the FLASH
# kernel instead of MATH (a different set of saved tensors).
SHAPES = [
    ("gpt", TINY["gpt"]),
    ("gpt", {**TINY["gpt"], "batch_size": 3, "seq_len": 24, "dropout": 0.0}),
    ("mlp", TINY["mlp"]),
    ("mlp", {**TINY["mlp"], "batch_size": 5, "depth": 6}),
    ("cnn", TINY["cnn"]),
    ("cnn", {**TINY["cnn"], "batch_size": 2, "image_size": 12, "blocks_per_stage": 2}),
    (f"{FIXTURES / 'foreign_workload.py'}:build", {}),  # no device kwarg, tied weights, random mask
]


def _phase_bytes(t: StepTrace) -> list[tuple]:
    return [(p.name, p.start_bytes, p.end_bytes, p.peak_bytes) for p in t.phases]


@pytest.mark.parametrize("spec,shape", SHAPES, ids=[f"{s.rsplit('/', 1)[-1]}-{i}" for i, (s, _) in enumerate(SHAPES)])
def test_simulated_bytes_equal_real_cpu_bytes(spec, shape):
    real = trace_workload(load_workload(spec, shape), warmup=2, steps=1)
    sim = simulate_trace(spec, shape, warmup=2, steps=1)
    assert sim.memory_source is MemorySource.SIMULATED and real.memory_source is MemorySource.CPU_LIVE_TENSORS
    assert sim.peak_bytes == real.peak_bytes
    assert sim.peak_phase == real.peak_phase
    assert _phase_bytes(sim) == _phase_bytes(real)
    assert sim.categories_at_peak == real.categories_at_peak
    assert sim.top_modules_at_peak == real.top_modules_at_peak
    assert sim.reference_peak_bytes is None  # the profiler cross-check is for real steps only


@pytest.mark.parametrize("loss", [
    lambda x, y: F.mse_loss(x, y), lambda x, y: F.smooth_l1_loss(x, y, reduction="sum"),
    lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y)), lambda x, y: F.l1_loss(x, y),
    lambda x, y: F.huber_loss(x, y), lambda x, y: F.cross_entropy(x, y.softmax(-1)),
], ids=["mse", "smooth_l1", "bce", "l1", "huber", "cross_entropy"])
def test_loss_output_storages_match_real_cpu_kernels(loss):
    # NOTE [simulated step] 4.: three CPU losses keep an N-element storage for a 0-dim result
    x, y = torch.randn(6, 7), torch.randn(6, 7)
    real = loss(x, y).untyped_storage().nbytes()
    sim = load_simulated("mlp", TINY["mlp"])
    with sim.session():
        fake = loss(torch.randn(6, 7), torch.randn(6, 7)).untyped_storage().nbytes()
    assert fake == real


def test_meta_built_model_allocates_nothing_real():
    shape = {"batch_size": 4, "seq_len": 256, "n_layer": 2, "d_model": 512, "n_head": 8, "vocab": 8192}
    box = {}
    ref = profiler_memory_peak(lambda: box.setdefault("sim", simulate_workload("gpt", shape, target_device="h100")))
    sim = box["sim"]
    n_params = 2 * 12 * 512 * 512 + 8192 * 512  # roughly; the simulated step holds > 4x that in bytes
    assert sim.trace.peak_bytes > 4 * 4 * n_params > 100 * 2**20
    assert ref.peak_delta_bytes < 2**20  # fake-constant scalars only: < 1 MiB of real memory


def test_meta_factory_and_real_model_conversion_keep_ties():
    sim = load_simulated("gpt", TINY["gpt"])
    model = sim.loaded.workload.model
    assert model.lm_head.weight is model.wte.weight                     # tied weights stay tied
    assert all(type(p).__name__ == "FakeTensor" and p.device.type == "cpu" for p in model.parameters())
    real = load_workload("gpt", TINY["gpt"])
    from remat.simulate import fake_workload
    from torch._subclasses.fake_tensor import FakeTensorMode
    fw = fake_workload(real.workload, FakeTensorMode())
    assert fw.model is not real.workload.model and fw.model.lm_head.weight is fw.model.wte.weight
    assert all(type(p) is torch.nn.Parameter for p in real.workload.model.parameters())  # caller's model untouched


def _record_one(fn, *shapes, dtype=torch.float32):
    sim = load_simulated("mlp", TINY["mlp"])
    with sim.session(), OpCostRecorder() as rec:
        rec.marker(Phase.FORWARD)
        fn(*(torch.empty(s, dtype=dtype) for s in shapes))
    return [op for op in rec.ops if op.kernel]


def test_roofline_matmul_by_hand():
    h100 = get_device_model("h100")
    M = N = K = 4096
    (op,) = _record_one(torch.mm, (M, K), (K, N))
    assert op.flops == 2 * M * N * K
    assert op.nbytes == (M * K + K * N + M * N) * 4
    # fp32 on H100: 2*4096^3 / 67e12 = 2.0514 ms (compute-bound: 201 MB / 3.35e12 = 0.060 ms) + 5 us launch
    t = predict_runtime([op], h100).step_ms
    assert t == pytest.approx(2 * M * N * K / 67e12 * 1e3 + 5e-3, rel=1e-9)
    assert t == pytest.approx(2.0564, abs=1e-3)
    (op16,) = _record_one(torch.mm, (M, K), (K, N), dtype=torch.bfloat16)
    assert predict_runtime([op16], h100).step_ms == pytest.approx(2 * M * N * K / 989.5e12 * 1e3 + 5e-3, rel=1e-9)
    # matrix-vector: bandwidth-bound, (4096*4096 + 4096 + 4096) * 4 bytes / 3.35e12 B/s
    (mv,) = _record_one(torch.mm, (M, K), (K, 1))
    assert mv.flops == 2 * M * K
    assert predict_runtime([mv], h100).step_ms == pytest.approx((M * K + K + M) * 4 / 3.35e12 * 1e3 + 5e-3, rel=1e-9)
    views = _record_one(lambda a: a.t().unsqueeze(0)[0, :2], (8, 8))
    assert views == []  # views launch nothing and cost nothing


def test_flops_agree_with_flop_counter_mode():
    from torch.utils.flop_counter import FlopCounterMode
    sim = load_simulated("gpt", TINY["gpt"], target_device="h100")  # CUDA attention ops are in the registry
    step = sim.training_step()
    with sim.session():
        step.run(0)
        with OpCostRecorder(step.workload.model) as rec:
            step.run(1, marker=rec.marker)
        with FlopCounterMode(display=False) as fc:
            step.run(2)
    assert sum(op.flops for op in rec.ops) == fc.get_total_flops() > 0


def test_calibration_fit_scales_every_prediction():
    assert fit_calibration(120.0, 100.0) == pytest.approx(1.2)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(SimulationError):
            fit_calibration(bad, 100.0)
        with pytest.raises(SimulationError):
            fit_calibration(100.0, bad)
    base = simulate_workload("mlp", TINY["mlp"], target_device="a100")
    factor = fit_calibration(3.0 * base.runtime.step_ms, base.runtime.step_ms)
    cal = simulate_workload("mlp", TINY["mlp"], target_device=get_device_model("a100").calibrated(factor))
    assert factor == pytest.approx(3.0)
    assert cal.runtime.step_ms == pytest.approx(3.0 * base.runtime.step_ms, rel=1e-9)
    assert cal.runtime.module_fwd_ms["blocks.0"] == pytest.approx(3.0 * base.runtime.module_fwd_ms["blocks.0"], rel=1e-9)
    assert cal.trace.peak_bytes == base.trace.peak_bytes
    with pytest.raises(SimulationError):
        get_device_model("a100").calibrated(0.0)


def test_runtime_prediction_by_phase_and_module():
    s = simulate_workload("gpt", TINY["gpt"], target_device="h100")
    rt = s.runtime
    assert rt.step_ms == pytest.approx(sum(rt.phase_ms.values()))
    assert [p.duration_ms for p in s.trace.phases] == [rt.phase_ms[p.name] for p in s.trace.phases]
    assert s.trace.step_ms == [rt.step_ms]
    blocks = [rt.module_fwd_ms[f"h.{i}"] for i in range(TINY["gpt"]["n_layer"])]
    assert 0 < sum(blocks) < rt.module_fwd_ms[""] <= rt.phase_ms[Phase.FORWARD]
    for name in ("h.0", "h.1.attn", "h.1.mlp"):
        full, sel = rt.replay_ms(name, CheckpointMode.FULL), rt.replay_ms(name, CheckpointMode.SELECTIVE)
        assert 0 < sel < full == rt.module_fwd_ms[name]
        assert rt.replay_ms(name, CheckpointMode.KEEP) == 0.0
    ts = [p.t_ms for p in s.trace.timeline]
    assert ts == sorted(ts) and ts[-1] <= rt.step_ms + 1e-9
    assert StepTrace.from_json(json.loads(json.dumps(s.trace.to_json()))).memory_source is MemorySource.SIMULATED
    assert json.loads(json.dumps(s.to_json()))["device_model"]["name"] == "h100"


def test_cuda_semantics_use_fused_attention_and_dropout():
    shape = {**TINY["gpt"], "seq_len": 64}
    cpu = simulate_workload("gpt", shape, target_device="cpu")
    h100 = simulate_workload("gpt", shape, target_device="h100")
    assert cpu.device_model.semantics is KernelSemantics.CPU and h100.trace.context.device == "cuda"
    cpu_ops = {o.op for o in cpu.runtime.top_ops}
    h100_ops = {o.op for o in h100.runtime.top_ops}
    assert "bmm" in cpu_ops and "bmm" not in h100_ops  # CPU with dropout: MATH attention (T x T scores)
    assert "_scaled_dot_product_efficient_attention" in h100_ops  # fp32 on CUDA: the EFFICIENT kernel
    assert h100.trace.peak_bytes < cpu.trace.peak_bytes


def nonzero_workload(batch_size: int = 4) -> Workload:  # a data-dependent shape: cannot be simulated
    model = torch.nn.Linear(3, 3)
    return Workload(model=model, batch=lambda s: torch.randn(batch_size, 3),
                    loss=lambda m, x: m(x[x.sum(1) > 0]).sum())


def test_unsimulable_workload_and_unknown_device_are_typed_errors():
    with pytest.raises(SimulationError, match="cannot be simulated"):
        simulate_workload(f"{__name__}:nonzero_workload")
    with pytest.raises(SimulationError, match="unknown target device"):
        get_device_model("tpu")
    with pytest.raises(SimulationError):
        DeviceModel(name="x", description="", semantics=KernelSemantics.CPU, peak_flops={"float32": 0.0},
                    bandwidth=1.0, launch_overhead_s=0.0, memory_bytes=1)


def test_cli_trace_simulate(tmp_path):
    out = tmp_path / "sim"
    shape = ",".join(f"{k}={v}" for k, v in TINY["gpt"].items())
    rc = main(["trace", "--simulate", "--target-device", "h100", "--workload", "gpt", "--shape", shape,
               "--warmup", "2", "--steps", "1", "--boundary-shape", "batch_size=4", "--out", str(out)])
    assert rc == 0
    d = json.loads((out / "trace.json").read_text())
    assert d["memory_source"] == "simulated" and d["context"]["device"] == "cuda"
    assert d["boundary"]["peak_bytes"] > d["peak_bytes"]
    s = json.loads((out / "simulation.json").read_text())
    assert s["device_model"]["name"] == "h100" and s["predicted_peak_bytes"] == d["peak_bytes"]
    assert math.isclose(s["runtime"]["step_ms"], d["step_ms"][0])
    assert (out / "trace.perfetto.json").is_file()
    assert main(["trace", "--target-device", "h100", "--out", str(tmp_path / "x")]) == 2
