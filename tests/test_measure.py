"""remat.measure: the one percentile, device-correct clocks, the one round-robin scheduler, held bytes.

CUDA tests (``@pytest.mark.cuda``) skip on CPU; ``benchmarks/gpu_check.py`` runs the wider GPU checks.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from .conftest import TINY, hand_plan
from remat.clock import RegionTimer, StepClock, percentile
from remat.measure import Arm, held_bytes_at_phase, measure_arm, time_round_robin, time_steps
from remat.types import Phase
from remat.workload import TrainingStep, load_workload


def test_percentile_is_numpys_linear_interpolation():
    rng = random.Random(3)
    for n in (1, 2, 5, 10, 37):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 5, 50, 95, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_is_the_only_one_in_src():
    """One p50/p95 definition (issue 13): no other percentile/median helper in the library."""
    import pathlib
    import re
    src = pathlib.Path(__file__).parents[1] / "src" / "remat"
    offenders = []
    for f in src.rglob("*.py"):
        text = f.read_text()
        if f.parent.name == "measure":
            continue
        if re.search(r"statistics\.median|np\.percentile|np\.median|def _p95|def _percentile", text):
            offenders.append(str(f.relative_to(src)))
    assert offenders == []


def test_step_clock_reads_wall_time_in_ms():
    clock = StepClock("cpu")
    out, ms = clock.time(time.sleep, 0.02)
    # the lower bound is the check (a sleep never ends early); the upper one only catches a clock off by 1000x
    assert out is None and 19.0 <= ms < 20_000.0


def test_region_timer_times_nested_regions_on_cpu():
    t = RegionTimer("cpu")
    t.start("outer")
    t.start("inner")
    time.sleep(0.01)
    t.stop("inner")
    time.sleep(0.01)
    t.stop("outer")
    t.stop("never started")   # ignored, not an error
    t.collect()
    assert 9.0 <= t.samples["inner"][0] < t.samples["outer"][0] and t.samples["outer"][0] >= 19.0
    assert "never started" not in t.samples


class _Recorder:
    def __init__(self, label: str, log: list) -> None:
        self.label, self.log = label, log

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def run(self, index: int) -> None:
        self.log.append((self.label, index))


def test_round_robin_rotates_the_order_and_times_only_warm_rounds():
    log: list = []
    runners = [_Recorder(x, log) for x in "abc"]
    t = time_round_robin(runners, warmup=2, steps=3)
    # round r runs every runner at step index r, starting with runner r mod 3
    assert log == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2),
                   ("a", 3), ("b", 3), ("c", 3), ("b", 4), ("c", 4), ("a", 4)]
    assert {k: len(v) for k, v in t.step_ms.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(Exception, match="unique"):
        time_round_robin([_Recorder("a", []), _Recorder("a", [])], steps=1)


def test_time_steps_runs_the_indices_given():
    lw = load_workload("mlp", TINY["mlp"])
    step = TrainingStep(lw.workload)
    seen: list[int] = []
    ms = time_steps(step, range(4, 7), run=lambda i: seen.append(i) or step.run(i))
    assert seen == [4, 5, 6] and len(ms) == 3 and all(m > 0 for m in ms)


class _Checkpointed(Arm):
    """Checkpoints every block of the tiny mlp by hand (no remat.apply): the measurement stage
    must see what a caller prepared."""

    def prepare(self, fresh):
        from torch.utils.checkpoint import checkpoint
        blocks = [m for n, m in fresh.workload.model.named_modules() if n.count(".") == 1 and n.startswith("blocks")]
        assert blocks
        originals = [(b, b.forward) for b in blocks]
        for b, fwd in originals:
            b.forward = (lambda f: (lambda *a: checkpoint(f, *a, use_reentrant=False)))(fwd)

        def undo():
            for b, _ in originals:
                del b.forward
        return undo


def test_held_bytes_and_peak_see_the_callers_preparation():
    lw = load_workload("mlp", {**TINY["mlp"], "batch_size": 64})
    control = held_bytes_at_phase(lw, Arm("control"), Phase.BACKWARD)
    planned = held_bytes_at_phase(lw, _Checkpointed("ckpt"), Phase.BACKWARD)
    assert planned < control   # checkpointing every block holds fewer activations at the turn
    # and the same plan through remat.apply measures the same held bytes (an independent route)
    from remat.wrap import PlanArm
    blocks = [n for n, _ in lw.workload.model.named_modules() if n.count(".") == 1 and n.startswith("blocks")]
    via_apply = held_bytes_at_phase(lw, PlanArm("plan", hand_plan(lw.workload.model, blocks)), Phase.BACKWARD)
    assert via_apply == planned
    m = measure_arm(lw, Arm("control"), warmup=1, steps=2)
    assert m.peak_bytes >= control and len(m.step_ms) == 2


# -- CUDA (skipped on CPU) ---------------------------------------------------------------------------

@pytest.mark.cuda
def test_step_clock_waits_for_kernels_on_cuda():
    """A host clock without synchronise reads the launch; StepClock must read the kernels."""
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()

    def work():
        for _ in range(20):
            a @ a
    clock = StepClock(dev)
    _, synced_ms = clock.time(work)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    event_ms = start.elapsed_time(end)
    assert synced_ms >= 0.8 * event_ms


@pytest.mark.cuda
def test_region_timer_uses_events_on_cuda():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    t = RegionTimer(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    t.start("mm")
    for _ in range(20):
        a @ a
    t.stop("mm")
    launch_ms = (time.perf_counter_ns() - t0) / 1e6   # what the old hooks read: launches only
    t.collect()
    torch.cuda.synchronize()
    kernel_ms = t.samples["mm"][0]
    assert kernel_ms > 0 and kernel_ms > 0.5 * launch_ms


@pytest.mark.cuda
def test_profile_forward_times_are_kernel_times_on_cuda():
    from remat.profile.step import _time_forwards
    lw = load_workload("gpt", {**TINY["gpt"], "batch_size": 8, "seq_len": 256, "d_model": 256, "n_head": 4},
                       device="cuda")
    step = TrainingStep(lw.workload)
    for i in range(2):
        step.run(i)
    names = {id(m): n for n, m in lw.workload.model.named_modules()}
    blocks = {n for n in names.values() if n.count(".") == 1 and n.startswith("h.")}
    fwd, step_ms = _time_forwards(step, names, blocks, 5, 2)
    assert set(fwd) == blocks and all(v > 0 for v in fwd.values())
    assert sum(fwd.values()) < min(step_ms)   # forwards of the blocks are part of the step


def _gpu_check_module():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("remat_gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    import sys
    sys.modules[spec.name] = mod     # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_script_runs_its_code_paths_on_cpu(tmp_path):
    """benchmarks/gpu_check.py must not rot on CPU-only CI: its smoke mode runs the same code at tiny shapes."""
    import json
    gc = _gpu_check_module()
    if not torch.cuda.is_available():
        assert gc.main(["--out", str(tmp_path / "none")]) == 2      # asked for CUDA without one: bad input
    rc = gc.main(["--smoke", "--device", "cpu", "--dtype", "float32", "--only", "allocator,simulate",
                  "--out", str(tmp_path)])
    out = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(out) == {"allocator", "simulate"}
    assert rc == 0, {k: v["summary"] for k, v in out.items()}
    a = out["allocator"]["data"]
    # remat's CPU figure: the allocator counter (equal to the tracker's or above it: it also sees what
    # never becomes a tensor) or, where it cannot be built, the tracker itself
    assert a["memory_source"] in ("cpu-allocator", "cpu-live-tensors")
    assert a["tracker_peak_bytes"] > 0 and a["tracker_peak_bytes"] <= a["remat_peak_bytes"] <= 1.05 * a["tracker_peak_bytes"]
    assert out["simulate"]["data"]["rows"][0]["peak_ratio"] == pytest.approx(1.0)   # CPU bytes simulate exactly


def test_one_host_context_spelled_alike_everywhere():
    """Trace, frontier and receipt contexts take the machine fields from one capture, with one spelling."""
    import dataclasses as dc
    from remat.receipt.model import ReceiptContext
    from remat.trace.model import HostContext, TraceContext
    host = {f.name for f in dc.fields(HostContext)}
    assert "torch_version" in host and "torch" not in host
    assert host <= {f.name for f in dc.fields(ReceiptContext)}
    shared = {f.name for f in dc.fields(TraceContext)} & host
    assert shared == {"torch_version", "python_version", "threads", "hostname"}
    ctx = TraceContext.capture(workload="w", shape={}, dtype="float32", device="cpu", warmup=1, steps=1)
    assert ctx.torch_version == torch.__version__ and ctx.threads == torch.get_num_threads()


def test_p50_along_is_percentile_50_row_by_row():
    from remat.clock import p50_along
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 10):
        a = rng.uniform(0, 100, size=(7, n))
        got = p50_along(a, axis=-1)
        assert got.tolist() == pytest.approx([percentile(row.tolist(), 50.0) for row in a], rel=1e-12)


def _layers_run_per_step(prepared) -> list[list[int]]:
    """Forward hooks on the layerdrop encoder's blocks: which blocks each step ran (replays, which
    run in backward, not counted)."""
    steps: list[list[int]] = []
    model = prepared.loaded.workload.model
    original = prepared.step.run

    def run(index):
        steps.append([])
        return original(index)
    prepared.step.run = run
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(
            lambda m, a, o, i=i: None if torch._C._current_graph_task_id() != -1 else steps[-1].append(i))
    return steps


def test_every_arm_runs_the_same_random_draws_and_the_callers_generators_are_put_back():
    """Layerdrop draws with torch.rand: every arm's step r must skip the same blocks, or the
    interleaved difference is a difference in work (NOTE [interleaved timing])."""
    import pathlib
    from remat.measure import prepare_arm
    from remat.wrap import PlanArm
    spec = f"{pathlib.Path(__file__).parent / 'fixtures' / 'dynamic_workload.py'}:build"
    lw = load_workload(spec, {"depth": 6, "p": 0.5, "seq_len": 8})
    paths = [f"blocks.{i}" for i in range(6)]

    def arms():
        return [prepare_arm(lw, Arm("control")), prepare_arm(lw, PlanArm("all", hand_plan(lw.workload.model, paths)))]

    prepared = arms()
    ran = [_layers_run_per_step(p) for p in prepared]
    torch.manual_seed(11)
    random.seed(11)
    before = (torch.rand(1).item(), random.random())
    torch.manual_seed(11)
    random.seed(11)
    time_round_robin(prepared, warmup=1, steps=7)
    assert ran[0] == ran[1] and len(ran[0]) == 8
    assert len({tuple(s) for s in ran[0]}) > 1          # the masks do change from round to round
    assert (torch.rand(1).item(), random.random()) == before   # the caller's generators as they were

    # solo measurements (NOTE [solo peaks]): each arm's build alone, one after the other, runs
    # the same draws at each step index
    prepared = arms()
    ran = [_layers_run_per_step(p) for p in prepared]
    for p in prepared:
        for r in range(8):
            p.run(r)
    assert ran[0] == ran[1] and len({tuple(s) for s in ran[0]}) > 1

    for p in prepared:
        p.close()
    from remat.measure import measure_arm_peak
    torch.manual_seed(5)
    expect = torch.rand(1)
    torch.manual_seed(5)
    measure_arm_peak(lw, Arm("control"), warmup=1)   # its build seeds torch (the factory), its steps too
    assert torch.equal(torch.rand(1), expect)       # and the caller's generator is where it was

    # the wrong case the seeding removes: the same two arms stepping unseeded, one after the
    # other, draw from one shared stream and skip other blocks (this check can fail)
    prepared = arms()
    ran = [_layers_run_per_step(p) for p in prepared]
    for r in range(8):
        for p in prepared:
            p.step.seed = None
            p.run(r)
    assert ran[0] != ran[1]
