"""remat.auto in a job, the parts that need no process group: how the ranks' profiles are reduced
(NOTE [one plan per job]), the in-place state snapshot (NOTE [wrapped models in place]), and the
segment wrapper running later members through their module call (NOTE [segment members through
their module call]). The torchrun job itself is tests/test_examples.py::test_example_auto_fsdp2_ddp."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.autoplan.inplace import JobEngine, StateSnapshot, check_job, job_engine
from remat.autoplan.ranks import _merge, _union_of_rows
from remat.errors import AutoError
from tests.conftest import hand_plan


def test_profiles_reduce_bytes_by_max_times_by_median_and_refuse_other_differences():
    ranks = [{"saved": 100, "ms": 1.0, "name": "h.0", "modes": {"full": 7}},
             {"saved": 130, "ms": 9.0, "name": "h.0", "modes": {"full": 5}},
             {"saved": 90, "ms": 2.0, "name": "h.0", "modes": {"full": 6}}]
    assert _merge(ranks, "p") == {"saved": 130, "ms": 2.0, "name": "h.0", "modes": {"full": 7}}   # by hand
    with pytest.raises(AutoError, match=r"p\.name differs: rank 0: h\.0, rank 1: h\.1"):
        _merge([ranks[0], {**ranks[1], "name": "h.1"}], "p")
    with pytest.raises(AutoError, match="p.modes keys differs"):
        _merge([ranks[0], {**ranks[1], "modes": {"selective": 5}}], "p")


def test_peak_rows_are_the_union_over_ranks_at_the_largest_bytes():
    row = lambda b, live, rep=(): {"base_bytes": b, "live": list(live), "replaying": list(rep), "label": ""}  # noqa: E731
    r0 = [row(10, ["a"]), row(50, ["a", "b"])]
    r1 = [row(12, ["a"]), row(40, ["a"], ["b"])]          # a signature rank 0 never met
    merged = _union_of_rows([r0, r1])
    assert {(tuple(r["live"]), tuple(r["replaying"])): r["base_bytes"] for r in merged} == {
        (("a",), ()): 12, (("a", "b"), ()): 50, (("a",), ("b",)): 40}
    assert merged == _union_of_rows([r1, r0])              # the same on every rank, whatever the order


def test_state_snapshot_restores_values_grads_and_flags_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model(torch.randn(8, 4)).sum().backward()
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    stats = model[1].running_mean.clone()
    weight = model[0].weight
    snap = StateSnapshot(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.eval()
    model.train()
    model[1].eval()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, params[0])     # the check can fail: the step changed them
    snap.restore()
    model(torch.randn(8, 4)).sum().backward()              # accumulates into the restored grads in place ...
    snap.restore()                                         # ... which must not have been the snapshot's own
    assert model[0].weight is weight                       # the same Parameter object, written in place
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(model[1].running_mean, stats) and model[1].training


def test_plain_models_are_not_jobs_and_wrapped_ones_need_their_process_group():
    assert job_engine(nn.Linear(2, 2)) is JobEngine.NONE
    check_job(JobEngine.NONE, None, quick_verify=True, copy_fn=None)   # plain: nothing refused
    with pytest.raises(AutoError, match="no default process group"):
        check_job(JobEngine.FSDP2, None, quick_verify=False, copy_fn=None)
    with pytest.raises(AutoError, match="cannot be copied"):
        check_job(JobEngine.DDP, object(), quick_verify=True, copy_fn=None)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _hooked_run(plan_segment: bool) -> tuple[list, Chain]:
    torch.manual_seed(0)
    model = Chain()
    seen: list = []

    def pre(m, args):
        if torch._C._current_graph_task_id() == -1:          # the forward, not the replay in backward
            seen.append(("pre", args[0].sum().item()))

    def post(m, args, out):
        if torch._C._current_graph_task_id() == -1:
            seen.append(("post", args[0].sum().item(), out.sum().item()))
    model.b.register_forward_pre_hook(pre)
    model.b.register_forward_hook(post)
    if plan_segment:
        remat.apply(model, hand_plan(model, ["[0:3]"]))
    for step in range(2):
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(step))).square().sum().backward()
    return seen, model


def test_segment_runs_a_later_members_hooks_once_with_its_own_input_and_output():
    control, _ = _hooked_run(False)
    planned, _ = _hooked_run(True)
    assert len(control) == 4 and planned == control       # once per forward, b's real input and output
    # the check can fail: a hook fired on the parent's call of b would see the segment's output as b's
    torch.manual_seed(0)
    m = Chain()
    x0 = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert control[1][2] == pytest.approx(m.b(m.a(x0)).sum().item())
        assert control[1][2] != pytest.approx(m.c(m.b(m.a(x0))).sum().item())


def test_segment_mutes_a_members_hooks_only_until_the_parent_calls_it():
    torch.manual_seed(0)
    model = Chain()
    tables = (model.b._forward_pre_hooks, model.b._forward_hooks)
    calls = []
    model.b.register_forward_hook(lambda m, a, o: calls.append(1))
    handle = remat.apply(model, hand_plan(model, ["[0:3]"]))
    seg = handle.wrappers[0]
    x = torch.randn(2, 6)
    seg(x)                                                 # the first member alone, as a parent that then raises
    assert model.b._forward_hooks is not tables[1] and not model.b._forward_hooks   # muted
    model(x).sum().backward()                              # the next call puts them back first
    assert model.b._forward_pre_hooks is tables[0] and model.b._forward_hooks is tables[1]
    assert len(calls) == 3                                 # seg(x), the forward, the replay in backward
    seg(x)
    handle.remove()                                        # and so does remove
    assert model.b._forward_hooks is tables[1] and len(model.b._forward_hooks) == 1
