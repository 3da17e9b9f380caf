"""Phase trace: JSON keys, blocking phase, reproducibility, Perfetto export, CLI."""

from __future__ import annotations

import json

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
