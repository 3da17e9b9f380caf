"""Phase trace: JSON keys, blocking phase, reproducibility, Perfetto export, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from remat.cli.main import main
from remat.memory import profiler_step_peak
from remat.trace import StepTrace, to_perfetto, trace_workload
from remat.types import MemCategory, Phase
from remat.workload import load_workload

from .conftest import FIXTURES, TINY

REQUIRED = {"schema_version", "context", "memory_source", "peak_bytes", "peak_phase", "phases",
            "categories_at_peak", "top_modules_at_peak"}


def test_trace_gpt_keys_phases_and_categories():
    t = trace_workload(load_workload("gpt", TINY["gpt"]), warmup=2, steps=2)
    d = t.to_json()
    assert REQUIRED <= d.keys()
    assert [p["name"] for p in d["phases"]] == ["batch", "forward", "backward", "optimizer"]
    assert t.peak_phase in (Phase.FORWARD, Phase.BACKWARD)
    assert t.peak_bytes == max(p.peak_bytes for p in t.phases)
    # the breakdown at the peak adds up to the peak
    assert sum(t.categories_at_peak.values()) == t.peak_bytes
    n_params = sum(p.numel() * 4 for p in load_workload("gpt", TINY["gpt"]).workload.model.parameters())
    assert t.categories_at_peak[MemCategory.PARAMETERS] == n_params
    assert t.categories_at_peak[MemCategory.OPTIMIZER_STATE] >= 2 * n_params  # AdamW exp_avg + exp_avg_sq
    assert t.top_modules_at_peak and t.top_modules_at_peak[0].bytes > 0
    assert StepTrace.from_json(json.loads(json.dumps(d))).to_json() == d


def test_trace_is_reproducible_on_cpu():
    a = trace_workload(load_workload("mlp", TINY["mlp"]), warmup=2, steps=2)
    b = trace_workload(load_workload("mlp", TINY["mlp"]), warmup=2, steps=2)
    assert a.step_peaks == b.step_peaks
    assert len(set(a.step_peaks)) == 1  # warm steps of one shape have one peak
    assert [p.peak_bytes for p in a.phases] == [p.peak_bytes for p in b.phases]


def test_trace_peak_matches_profiler():
    lw = load_workload("gpt", TINY["gpt"])
    t = trace_workload(lw, warmup=2, steps=1)
    from remat.workload import TrainingStep
    step = TrainingStep(load_workload("gpt", TINY["gpt"]).workload)
    step.run(0)
    step.run(1)
    ref = profiler_step_peak(step, 2)
    assert abs(t.peak_bytes - ref) <= 0.01 * t.peak_bytes
    assert t.reference_peak_bytes == ref  # what trace.json reports beside it


def test_boundary_shape_traced_and_bigger():
    t = trace_workload(load_workload("gpt", TINY["gpt"]), warmup=1, steps=1, boundary_shape={"batch_size": 4})
    assert t.boundary is not None and t.boundary.context.shape["batch_size"] == 4
    assert t.boundary.peak_bytes > t.peak_bytes


def test_perfetto_export_has_slices_and_counter():
    t = trace_workload(load_workload("mlp", TINY["mlp"]), warmup=1, steps=1)
    doc = to_perfetto(t)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert [s["name"] for s in slices] == ["batch", "forward", "backward", "optimizer"]
    assert max(c["args"]["bytes"] for c in counters) <= t.peak_bytes
    assert len(counters) > 10


def test_cli_trace_custom_workload_writes_files(tmp_path, capsys):
    out = tmp_path / "trace"
    rc = main(["trace", "--workload", f"{FIXTURES / 'custom_workload.py'}:build", "--shape", "batch_size=4",
               "--warmup", "1", "--steps", "2", "--out", str(out)])
    assert rc == 0
    d = json.loads((out / "trace.json").read_text())
    assert REQUIRED <= d.keys() and d["context"]["shape"] == {"batch_size": 4}
    assert json.loads((out / "trace.perfetto.json").read_text())["traceEvents"]
    assert "blocking" in capsys.readouterr().out


# -- instrumentation must not change the code path (issue 11) -------------------------------------

class _SelfAttn(torch.nn.Module):
    """``attn(h, h, h)``: nn.MultiheadAttention takes its packed self-attention branch on ``q is k is v``."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, 4, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


def _self_attn_workload():
    import remat
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SelfAttn(), _SelfAttn())

    def batch(step):
        return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(step))
    return remat.Workload(model=model, batch=batch, loss=lambda m, x: m(x).square().mean())


def test_torch_replays_distinct_inputs_under_saved_tensor_hooks():
    """The trap itself (negative control): under any saved_tensors_hooks, torch's checkpoint replays
    ``attn(h, h, h)`` with three distinct tensors and fails; without hooks it does not."""
    from torch.utils.checkpoint import CheckpointError, checkpoint
    block = _SelfAttn()
    x = torch.randn(2, 16, 32, requires_grad=True)
    h = x * 1.0
    checkpoint(block.attn, h, h, h, use_reentrant=False, need_weights=False)[0].sum().backward()
    h = x * 1.0
    with pytest.raises(CheckpointError, match="different metadata"):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            checkpoint(block.attn, h, h, h, use_reentrant=False, need_weights=False)[0].sum().backward()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recorder_does_not_change_a_planned_mha_replay(mode):
    """NOTE [saved-tensor hooks and identity]: the planned step traced with saved-tensor hooks runs."""
    from remat.wrap import apply
    from remat.trace.recorder import StepRecorder
    from remat.types import CheckpointMode
    from remat.workload import TrainingStep
    from .conftest import hand_plan
    wl = _self_attn_workload()
    plan = hand_plan(wl.model, ["0.attn", "1"], mode=CheckpointMode(mode))
    with apply(wl.model, plan, check_fingerprint=False) as handle:
        step = TrainingStep(wl)
        step.run(0)
        with StepRecorder(step) as rec:
            rec.run(1)     # raised CheckpointError / "not found in storage" before the fix
        assert handle.wrapper("0.attn").replay_calls >= 1
    assert any(s.module for s in rec.saved)   # the recorder still saw the step's saved tensors
