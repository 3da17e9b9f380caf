"""Activation offload (NOTE [activation offload], NOTE [offload cost model]).

Ground truths: an unmodified control (gradients bitwise), a hand count of the saved bytes each
block holds (device and host), a hook's call count, hand-priced costs, and an exhaustive search
over keep / recompute / offload per candidate. Each check has a wrong twin it must reject.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from remat.errors import PlanError
from remat.memory.tracker import LiveTensorTracker
from remat.plan import OffloadPricing, Plan, make_plan, with_offload
from remat.plan.cost import CostModel
from remat.plan.model import Boundary
from remat.profile.fingerprint import fingerprint
from remat.profile.model import CandidateCost, HazardRecord, PeakRow, ProfileReport
from remat.types import CheckpointMode, HazardKind, MemCategory, MemorySource
from remat.wrap import apply
from remat.wrap import offload as offload_mod

K, F, O = CheckpointMode.KEEP, CheckpointMode.FULL, CheckpointMode.OFFLOAD
B, D, H = 512, 256, 1024   # batch, width, hidden


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])


def _plan(model: nn.Module, modes: dict[str, CheckpointMode]) -> Plan:
    return Plan(planner="all", budget_bytes=None, reserve=0.0,
                boundaries=[Boundary(module=n, mode=m, saved_bytes=0, replay_ms=0.0) for n, m in modes.items()],
                excluded=[], predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=0,
                baseline_step_ms=0.0, fingerprint=fingerprint(model))


def _step(model: nn.Module) -> tuple[list[torch.Tensor], int, int]:
    """(gradients, live bytes at the end of the forward, whole-step peak bytes), tracked."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(1))
    with LiveTensorTracker() as t:
        t.track(model.parameters(), MemCategory.PARAMETERS)
        t.track([x], MemCategory.BATCH)
        loss = model(x).square().mean()
        fwd_end = t.live_bytes
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], fwd_end, t.peak_bytes


ALL_OFFLOADED = {str(i): O for i in range(4)}
# per block: the saved tensors that are not parameters: up's input (B, D), act's input (B, H), down's input (B, H)
PER_BLOCK_BYTES = B * (D + H + H) * 4


def test_offload_is_bitwise_the_unplanned_step_and_moves_the_hand_counted_bytes_to_host() -> None:
    control = _model()
    grads0, fwd0, peak0 = _step(control)
    planned = _model()
    handle = apply(planned, _plan(planned, ALL_OFFLOADED))
    grads1, fwd1, peak1 = _step(planned)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    # host: every block's saved activations, held at once before backward
    assert handle.host_pool.peak_bytes == 4 * PER_BLOCK_BYTES
    assert handle.host_pool.held_bytes == 0            # all released after backward
    # device at the end of forward: the same bytes gone, but the batch itself, which the caller holds
    assert fwd0 - fwd1 == 4 * PER_BLOCK_BYTES - B * D * 4
    assert peak1 < peak0
    assert handle.host_pool.copies_out == handle.host_pool.copies_in == 4 * 3
    handle.remove()
    assert all("forward" not in m.__dict__ for m in planned.modules())


def test_a_broken_unpack_is_caught_by_the_same_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrong twin: an offload that brings back the wrong values must not compare equal."""
    grads0, _, _ = _step(_model())
    monkeypatch.setattr(offload_mod._RegionOffload, "unpack",
                        lambda self, p: p if isinstance(p, torch.Tensor) else torch.zeros(p.shape, dtype=p.dtype))
    planned = _model()
    apply(planned, _plan(planned, ALL_OFFLOADED))
    grads1, _, _ = _step(planned)
    assert not all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def test_a_hook_inside_an_offloaded_region_fires_once_where_a_checkpoint_fires_it_twice() -> None:
    def counted(modes: dict[str, CheckpointMode]) -> int:
        model = _model()
        calls = [0]
        model[1].act.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        apply(model, _plan(model, modes))
        _step(model)
        return calls[0]
    assert counted({}) == 1
    assert counted({"1": O}) == 1
    assert counted({"1": F}) == 2      # the hazard offload avoids: the replay fires the hook again


def test_offload_refuses_a_compiled_plan() -> None:
    from remat.measure import CompileSpec
    model = _model()
    plan = _plan(model, {"0": O})
    plan.compile = CompileSpec(backend="eager")
    with pytest.raises(PlanError, match="offload"):
        apply(model, plan)


# -- pricing and planning (pure) -----------------------------------------------------------------

def _cand(name: str, order: int, *, saved: int, input_bytes: int, ms: float, fwd_ms: float = 1.0,
          hazards: tuple = ()) -> CandidateCost:
    return CandidateCost(name=name, class_name="Block", order=order, parent=None, fwd_ms=fwd_ms,
                         input_bytes=input_bytes, saved_bytes={K: 0, F: saved}, replay_ms={K: 0.0, F: ms},
                         replay_extra_bytes={K: 0, F: 0}, hazards=list(hazards))


def _report(cands: list[CandidateCost], base: int) -> ProfileReport:
    names = tuple(c.name for c in cands)
    return ProfileReport(candidates=cands, rows=[PeakRow(base_bytes=base, live=names, replaying=())], excluded={},
                         baseline_peak_bytes=base, baseline_step_ms=10.0,
                         memory_source=MemorySource.CPU_LIVE_TENSORS, fingerprint=fingerprint(nn.Linear(1, 1)))


def test_pricing_by_hand() -> None:
    c = _cand("a", 0, saved=1000, input_bytes=24, ms=5.0, fwd_ms=1.0)
    cpu = OffloadPricing(d2h_bytes_per_ms=100.0, h2d_bytes_per_ms=200.0, overlaps_compute=False)
    gpu = OffloadPricing(d2h_bytes_per_ms=100.0, h2d_bytes_per_ms=200.0, overlaps_compute=True)
    priced = with_offload(_report([c], 5000), cpu).candidates[0]
    assert priced.saved_bytes[O] == 1000 and priced.replay_extra_bytes[O] == 0
    assert priced.replay_ms[O] == pytest.approx(1024 / 100 + 1024 / 200)             # 15.36 ms, nothing hidden
    assert with_offload(_report([c], 5000), gpu).candidates[0].replay_ms[O] == pytest.approx(1024 / 100 - 1.0 + 1024 / 200)
    with pytest.raises(PlanError):
        OffloadPricing(d2h_bytes_per_ms=0.0, h2d_bytes_per_ms=1.0, overlaps_compute=False)


def _brute_force(model: CostModel, budget: int) -> float | None:
    """Least overhead over every keep/recompute/offload assignment that fits both budgets."""
    best = None
    per = [[None, *model.options_of[j]] for j in range(len(model.candidates))]
    for pick in itertools.product(*per):
        x = [0] * len(model.options)
        for k in pick:
            if k is not None:
                x[k] = 1
        import numpy as np
        xv = np.array(x)
        if model.is_valid(xv) and model.peak(xv) <= budget:
            cost = model.overhead_ms(xv)
            best = cost if best is None or cost < best else best
    return best


@pytest.mark.parametrize("host_budget", [None, 0, 2500, 5000])
def test_the_planner_mixes_keep_recompute_and_offload_as_an_exhaustive_search_does(host_budget) -> None:
    # a: expensive to replay, cheap to copy; b: cheap to replay; c: hazardous (offload only)
    cands = [_cand("a", 0, saved=2000, input_bytes=0, ms=30.0),
             _cand("b", 1, saved=2000, input_bytes=0, ms=1.0),
             _cand("c", 2, saved=2000, input_bytes=0, ms=1.0,
                   hazards=(HazardRecord(kind=HazardKind.PYTHON_STATE, detail="self.n += 1"),))]
    pricing = OffloadPricing(d2h_bytes_per_ms=1000.0, h2d_bytes_per_ms=1000.0, overlaps_compute=False,
                             host_budget_bytes=host_budget)
    rep = _report(cands, 10_000)
    for budget in (10_000, 8_000, 6_000, 4_000):
        plan = None
        try:
            plan = make_plan(rep, "optimal", budget_bytes=budget, reserve=0.0, offload=pricing)
        except Exception:   # noqa: BLE001  infeasible: the brute force must agree
            pass
        priced = with_offload(rep, pricing)
        from remat.plan.planners import classify_candidates
        model = CostModel(priced, classify_candidates(priced).allowed, host_budget_bytes=host_budget)
        truth = _brute_force(model, budget)
        if truth is None:
            assert plan is None
            continue
        assert plan is not None and plan.predicted_overhead_ms == pytest.approx(truth)
        modes = {b.module: b.mode for b in plan.boundaries}
        assert modes.get("c", O) is O                       # never recomputed: its hazard
        offloaded = sum(2000 for m in modes.values() if m is O)   # saved + input bytes each
        assert host_budget is None or offloaded <= host_budget
    wide = make_plan(rep, "optimal", budget_bytes=4_000, reserve=0.0,
                     offload=OffloadPricing(d2h_bytes_per_ms=1000.0, h2d_bytes_per_ms=1000.0, overlaps_compute=False))
    assert {b.module: b.mode for b in wide.boundaries} == {"a": O, "b": F, "c": O}


def test_a_plan_with_offload_round_trips_through_json(tmp_path) -> None:
    cands = [_cand("a", 0, saved=2000, input_bytes=0, ms=30.0)]
    pricing = OffloadPricing(d2h_bytes_per_ms=1000.0, h2d_bytes_per_ms=500.0, overlaps_compute=True,
                             host_budget_bytes=4096, source="measured")
    plan = make_plan(_report(cands, 10_000), "optimal", budget_bytes=9_000, reserve=0.0, offload=pricing)
    assert [b.mode for b in plan.boundaries] == [O]
    path = plan.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert again.offload == pricing and again.boundaries == plan.boundaries


# -- end to end on a built-in workload: closed loop, then verify -----------------------------------

def test_a_mixed_plan_fits_its_budget_by_measurement_and_verifies_bitwise() -> None:
    from remat.closed_loop import plan_closed_loop
    from remat.profile import profile_workload
    from remat.verify import verify_plan
    from remat.workload import load_workload
    shape = {"batch_size": 4, "seq_len": 64, "n_layer": 2, "d_model": 64, "n_head": 2, "vocab": 64}
    loaded = load_workload("gpt", shape)
    report = profile_workload(loaded, measure_replays=False, segments=False)
    fast_link = OffloadPricing(d2h_bytes_per_ms=1e12, h2d_bytes_per_ms=1e12, overlaps_compute=False)
    budget = int(report.baseline_peak_bytes * 0.75)
    result = plan_closed_loop(load_workload("gpt", shape), report, "optimal", budget_bytes=budget, reserve=0.0,
                              offload=fast_link)
    plan = result.plan
    assert any(b.mode is O for b in plan.boundaries)
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    verdict = verify_plan(load_workload("gpt", shape), plan, steps=2, seeds=1, timing_steps=0)
    assert verdict.passed, verdict.failures
    perturbed = next(n for n in verdict.negative_controls if n.name == "perturbed_gradient")
    assert perturbed.applicable and perturbed.rejected


def test_link_bandwidth_is_measured_once_then_cached(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.measure import bandwidth
    monkeypatch.setattr(bandwidth, "_PROBE_BYTES", 2 ** 20)
    first = bandwidth.link_bandwidth("cpu", cache_dir=tmp_path)
    calls = []
    monkeypatch.setattr(bandwidth, "_measure", lambda device: calls.append(device) or (1.0, 1.0))
    second = bandwidth.link_bandwidth("cpu", cache_dir=tmp_path)
    assert not first.cached and second.cached and not calls
    assert second.d2h_bytes_per_ms == pytest.approx(first.d2h_bytes_per_ms)
    (next((tmp_path / "bandwidth").iterdir())).write_text("{not json")    # a broken entry: measured again
    third = bandwidth.link_bandwidth("cpu", cache_dir=tmp_path)
    assert calls and not third.cached and third.d2h_bytes_per_ms == 1.0


@pytest.mark.parametrize("extra, needle", [
    (["--host-budget", "1GiB"], "--host-budget only applies with --offload"),
    (["--offload", "--host-budget", "50%"], "not a share"),
    (["--offload", "--compile"], "--offload cannot be combined with --compile"),
])
def test_offload_usage_errors_exit_2_before_any_work(extra, needle, tmp_path, capsys) -> None:
    from remat.cli.main import main
    code = main(["plan", "--workload", "mlp", "--budget", "60%", "--out", str(tmp_path / "p"), *extra])
    assert code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_simulated_offload_is_priced_from_the_device_models_link() -> None:
    from remat.plan.offload import modelled_pricing
    h100 = modelled_pricing("h100", host_budget_bytes=2 ** 30)
    assert h100.d2h_bytes_per_ms == pytest.approx(0.8 * 64e9 / 1e3) and h100.overlaps_compute
    assert h100.host_budget_bytes == 2 ** 30 and h100.source == "device model h100"
    assert not modelled_pricing("cpu").overlaps_compute


def test_torch_profiler_agrees_that_the_host_copies_left_the_device() -> None:
    """Independent ground truth for the CPU accounting: torch.profiler's allocator events (which confirm
    CPU peaks at the edge of a budget) must not see the host copies either, so the offloaded step peaks
    lower by about what the tracker says, not at the unplanned peak."""
    from remat.memory.reference import profiler_memory_peak

    def peak(model: nn.Module) -> int:
        x = torch.randn(B, D, generator=torch.Generator().manual_seed(1))
        return profiler_memory_peak(lambda: model(x).square().mean().backward()).peak_delta_bytes
    control = peak(_model())
    planned = _model()
    apply(planned, _plan(planned, ALL_OFFLOADED))
    offloaded = peak(planned)
    _, _, peak0 = _step(_model())
    planned2 = _model()
    apply(planned2, _plan(planned2, ALL_OFFLOADED))
    _, _, peak1 = _step(planned2)
    # the tracker's peak saving, seen by the profiler too (the host copies would add 18.9 MB back)
    assert control - offloaded == pytest.approx(peak0 - peak1, rel=0.05)
