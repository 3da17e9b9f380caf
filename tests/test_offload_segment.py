"""A segment whose input waits in host memory (mode FULL_HOST_INPUT; NOTE [segment input on the host],
NOTE [segment input freed], NOTE [offload cost model]).

The model: four linked blocks (Linear -> activation) and a wide head whose logits make the end of
the forward the peak, where every checkpointed segment's kept input is still held. A FULL segment
``blocks[2:4]`` keeps its input, block 1's output, (B, D) float32; in FULL_HOST_INPUT it goes to
the host. Ground truths: a hand count of that tensor's bytes, the unplanned step (gradients
bitwise), models whose block 1 ends in ReLU (ReLU saves its output) or keeps its output in an
attribute, so the input stays on the device whatever the segment does (the wrong cases the profile
must not count), and the
recompute-only twin refused at a budget the mode reaches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetError, PlanError
from remat.memory.tracker import LiveTensorTracker
from remat.plan import OffloadPricing, Plan, with_offload
from remat.plan.model import Boundary
from remat.profile.fingerprint import fingerprint
from remat.profile.model import CandidateCost, PeakRow, ProfileReport
from remat.profile.step import profile_workload
from remat.types import CheckpointMode, MemCategory, MemorySource
from remat.workload.loader import load_workload
from remat.wrap import apply
from remat.wrap import offload as offload_mod

K, F, O, HI = CheckpointMode.KEEP, CheckpointMode.FULL, CheckpointMode.OFFLOAD, CheckpointMode.FULL_HOST_INPUT
B, D, V, N = 128, 128, 1024, 4      # batch, width, head width, blocks
INPUT_BYTES = B * D * 4             # blocks[2:4]'s input: block 1's output, (B, D) float32
SEGMENT = "blocks[2:4]"


class Block(nn.Module):
    def __init__(self, act: type[nn.Module] = nn.GELU, drop: float = 0.0, stash: bool = False) -> None:
        super().__init__()
        self.up, self.act = nn.Linear(D, D), act()
        self.drop = nn.Dropout(drop) if drop else nn.Identity()
        self.stash = stash
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.act(self.up(x)))
        if self.stash:   # a reference the trace cannot see as a saved tensor: kept until the next step
            self.kept = y
        return y


# block 1's kind: "gelu" (its output free after the forward moves on), "relu" (ReLU saves its output for
# backward), "stash" (GELU, and the block keeps its output in an attribute)
KINDS = {"gelu": (nn.GELU, False), "relu": (nn.ReLU, False), "stash": (nn.GELU, True)}


class Net(nn.Module):
    def __init__(self, kind: str = "gelu", drop: float = 0.0) -> None:
        super().__init__()
        act1, stash1 = KINDS[kind]
        self.blocks = nn.Sequential(*[Block(act1 if i == 1 else nn.GELU, drop, stash=stash1 and i == 1)
                                      for i in range(N)])
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _model(kind: str = "gelu", drop: float = 0.0) -> Net:
    torch.manual_seed(0)
    return Net(kind, drop)


def _batch(step: int = 0) -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(step + 1))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def build(kind: str = "gelu", drop: float = 0.0) -> remat.Workload:
    """This file as a workload (``tests/test_offload_segment.py:build``)."""
    return remat.Workload(model=_model(kind, drop), batch=_batch, loss=_loss,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def _plan(model: nn.Module, modes: dict[str, CheckpointMode]) -> Plan:
    return Plan(planner="all", budget_bytes=None, reserve=0.0,
                boundaries=[Boundary(module=n, mode=m, saved_bytes=0, replay_ms=0.0) for n, m in modes.items()],
                excluded=[], predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=0,
                baseline_step_ms=0.0, fingerprint=fingerprint(model))


def _step(model: nn.Module) -> tuple[list[torch.Tensor], int]:
    """(gradients, live bytes at the end of the forward), tracked; RNG seeded alike for every arm."""
    x = _batch()
    torch.manual_seed(7)
    with LiveTensorTracker() as t:
        t.track(model.parameters(), MemCategory.PARAMETERS)
        t.track([x], MemCategory.BATCH)
        loss = _loss(model, x)
        fwd_end = t.live_bytes
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], fwd_end


@pytest.mark.parametrize("kind, freed", [("gelu", INPUT_BYTES),   # GELU saves its input: its output is free
                                         ("relu", 0),              # the wrong cases: ReLU saves its output,
                                         ("stash", 0)])            # or the block keeps it in an attribute
def test_the_input_frees_its_hand_counted_bytes_only_where_nothing_else_holds_it(kind, freed) -> None:
    """Device bytes at the end of the forward, FULL vs FULL_HOST_INPUT on the same segment: the input's
    hand count when block 1 ends in GELU; nothing when something else holds it, though the copy is made."""
    at_end = {}
    for mode in (F, HI):
        model = _model(kind)
        handle = apply(model, _plan(model, {SEGMENT: mode}))   # block 1 unplanned: its ReLU's save holds
        _, at_end[mode] = _step(model)
        if mode is HI:   # the host held the input once, and gave its buffer back after backward
            assert handle.host_pool.peak_bytes == INPUT_BYTES and handle.host_pool.held_bytes == 0
            assert handle.host_pool.copies_out == handle.host_pool.copies_in == 1
            assert handle.wrapper(SEGMENT).replay_calls == 1
    assert at_end[F] - at_end[HI] == freed


@pytest.mark.parametrize("kind, counted", [("gelu", INPUT_BYTES), ("relu", 0), ("stash", 0)])
def test_the_profile_counts_the_input_as_freed_exactly_where_it_is(kind, counted) -> None:
    """NOTE [segment input freed] against the hand count: the input's bytes when nothing else holds it;
    0 when ReLU saves it or an attribute keeps it (the wrong cases: counting them would promise bytes the
    step never frees); and 0 for a segment whose input is the batch, which the loop holds."""
    lw = load_workload(f"{__file__}:build", {"kind": kind})
    report = profile_workload(lw, candidates=["blocks[0:2]", SEGMENT], measure_replays=False, repeats=1)
    by_name = {c.name: c for c in report.candidates}
    assert by_name[SEGMENT].host_input_bytes == counted
    assert by_name["blocks[0:2]"].host_input_bytes == 0


def test_the_mode_is_bitwise_the_unplanned_step_with_dropout_inside_the_segment() -> None:
    grads0, _ = _step(_model(drop=0.25))
    planned = _model(drop=0.25)
    handle = apply(planned, _plan(planned, {SEGMENT: HI}))
    grads1, _ = _step(planned)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert handle.wrapper(SEGMENT).replay_calls == 1   # it did replay, from the reloaded input
    handle.remove()
    assert not remat.recover_handle(planned).wrappers and "forward" not in planned.blocks[2].__dict__


def test_without_rng_preservation_the_replays_dropout_differs() -> None:
    """The wrong twin of the RNG half: the same plan with ``preserve_rng_state=False`` must not be bitwise
    the unplanned step (the replay draws other dropout masks), so the preserved one above is not luck."""
    grads0, _ = _step(_model(drop=0.25))
    planned = _model(drop=0.25)
    plan = _plan(planned, {SEGMENT: HI})
    plan.preserve_rng_state = False
    apply(planned, plan)
    grads1, _ = _step(planned)
    assert not all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def test_a_wrong_reload_is_caught_by_the_same_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrong twin: a replay that reloads other values than the input must not compare equal."""
    grads0, _ = _step(_model(drop=0.25))
    monkeypatch.setattr(offload_mod._RegionOffload, "unpack",
                        lambda self, p: p if isinstance(p, torch.Tensor) else torch.zeros(p.shape, dtype=p.dtype))
    planned = _model(drop=0.25)
    apply(planned, _plan(planned, {SEGMENT: HI}))
    grads1, _ = _step(planned)
    assert not all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def test_the_mode_is_refused_on_a_module_and_in_a_compiled_plan() -> None:
    from remat.measure import CompileSpec
    model = _model()
    with pytest.raises(PlanError, match="segment mode"):
        apply(model, _plan(model, {"blocks.1": HI}))
    plan = _plan(model, {SEGMENT: HI})
    plan.compile = CompileSpec(backend="eager")
    with pytest.raises(PlanError, match="offload"):
        apply(model, plan)
    assert not remat.recover_handle(model).wrappers


# -- pricing (pure) ------------------------------------------------------------------------------

def _segment(name: str, order: int, *, saved: int, host_input: int, ms: float, members: tuple[str, ...]) -> CandidateCost:
    return CandidateCost(name=name, class_name="segment", order=order, parent=None, fwd_ms=ms, input_bytes=0,
                         saved_bytes={K: 0, F: saved}, replay_ms={K: 0.0, F: ms}, replay_extra_bytes={K: 0, F: 7},
                         members=members, host_input_bytes=host_input)


def test_pricing_by_hand_and_only_where_the_input_is_freed() -> None:
    cands = [_segment("[0:2]", 0, saved=3000, host_input=0, ms=2.0, members=("0", "1")),      # input not freed
             _segment("[2:4]", 1, saved=3000, host_input=1000, ms=2.0, members=("2", "3"))]
    report = ProfileReport(candidates=cands, rows=[PeakRow(base_bytes=10_000, live=("[0:2]", "[2:4]"), replaying=())],
                           excluded={}, baseline_peak_bytes=10_000, baseline_step_ms=10.0,
                           memory_source=MemorySource.CPU_LIVE_TENSORS, fingerprint=fingerprint(nn.Linear(1, 1)))
    for overlaps in (False, True):   # nothing of the input's copy is counted as hidden
        pricing = OffloadPricing(d2h_bytes_per_ms=100.0, h2d_bytes_per_ms=200.0, overlaps_compute=overlaps)
        not_freed, freed = with_offload(report, pricing).candidates
        assert HI not in not_freed.saved_bytes and O not in not_freed.saved_bytes   # the wrong case: not offered
        assert freed.saved_bytes[HI] == 3000 + 1000
        assert freed.replay_ms[HI] == pytest.approx(2.0 + 1000 / 100 + 1000 / 200)   # replay + 10 ms out + 5 ms back
        assert freed.replay_extra_bytes[HI] == 7
        assert O not in freed.saved_bytes                                             # a segment is never OFFLOADed
    from remat.plan.cost import CostModel   # the host budget binds at the input's bytes: 999 < 1000 cannot hold it
    tight = OffloadPricing(d2h_bytes_per_ms=100.0, h2d_bytes_per_ms=200.0, overlaps_compute=False, host_budget_bytes=999)
    with pytest.raises(PlanError, match="host budget"):
        CostModel(with_offload(report, tight), host_budget_bytes=999).vector({"[2:4]": HI})
    fits = CostModel(with_offload(report, tight), host_budget_bytes=1000)   # the safe twin
    assert fits.peak(fits.vector({"[2:4]": HI})) == 10_000 - 4000


def test_a_plan_in_the_mode_round_trips_through_json(tmp_path) -> None:
    model = _model()
    plan = _plan(model, {SEGMENT: HI})
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.boundaries == plan.boundaries and again.boundaries[0].mode is HI


# -- the everyday path ---------------------------------------------------------------------------

def _auto(model: nn.Module, **kw) -> remat.AutoHandle:
    # the budget lies between the measured peak of the plan with the input on the host and the measured
    # floor of recompute alone (INPUT_BYTES apart); replay costs from the profile's first estimates
    return remat.auto(model, _batch(), budget="89.6%", loss_fn=_loss, measure_replays=False, reserve=0.0,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1), use_cache=False, **kw)


def test_a_budget_only_this_mode_reaches_ships_it_verified_and_recompute_alone_is_refused() -> None:
    model = _model()
    # a host budget of the input's hand count: any block's OFFLOAD (its activation and its input) is larger
    handle = _auto(model, offload=INPUT_BYTES, verify="quick")
    r = handle.report
    modes = {b.module: b.mode for b in handle.plan.boundaries}
    assert modes.get(SEGMENT) is HI, modes
    assert r.verification is remat.autoplan.VerifyStatus.PASSED
    assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.effective_budget_bytes
    assert "1 segment inputs on the host" in r.summary()
    control = _model()
    grads0, _ = _step(control)
    grads1, _ = _step(model)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert handle.host_pool.peak_bytes == INPUT_BYTES
    handle.remove()
    twin = _model()   # the wrong twin: recompute only, the same budget
    with pytest.raises(BudgetError):
        _auto(twin)
    assert not remat.recover_handle(twin).wrappers


def test_remat_plan_offers_the_mode_with_offload_only(tmp_path) -> None:
    """``remat plan --offload`` plans the mode at the budget (profile and planner, no closed loop); the same
    command without ``--offload`` must not (the wrong twin: a mode the user did not allow)."""
    from remat.cli.main import main
    common = ["plan", "--workload", f"{__file__}:build", "--budget", "89.6%", "--reserve", "0", "--no-measure"]
    assert main([*common, "--offload", "--host-budget", str(INPUT_BYTES), "--out", str(tmp_path / "on")]) == 0
    on = Plan.load(tmp_path / "on" / "plan.json")
    assert {b.module: b.mode for b in on.boundaries}.get(SEGMENT) is HI
    assert on.offload is not None and on.offload.host_budget_bytes == INPUT_BYTES
    # recompute only: refused, its predicted floor (the input above this plan's) over the budget
    assert main([*common, "--out", str(tmp_path / "off")]) != 0
    assert not (tmp_path / "off").exists()


def test_a_copy_of_a_planned_model_runs_the_mode_with_a_pool_of_its_own() -> None:
    """NOTE [copies of a planned model]: a deepcopy keeps the mode (bitwise the unplanned step, the input on
    the copy's own host pool) and is removable; the original's pool is untouched by the copy's step."""
    import copy
    model = _model()
    handle = apply(model, _plan(model, {SEGMENT: HI}))
    twin = copy.deepcopy(model)
    grads0, _ = _step(_model())
    grads1, _ = _step(twin)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    recovered = remat.recover_handle(twin)
    assert [w.path for w in recovered.wrappers] == [SEGMENT] and recovered.wrappers[0].replay_calls == 1
    assert recovered.wrappers[0].pool is not handle.host_pool and recovered.wrappers[0].pool.peak_bytes == INPUT_BYTES
    assert handle.host_pool.copies_out == 0
    recovered.remove()
    assert "forward" not in twin.blocks[2].__dict__
