"""remat.apply: exact wrapping, bitwise equivalence, removal, fingerprints, BatchNorm guard, export."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.wrap import ApplyHandle, CheckpointWrapper, SaveMatmulPolicy, apply, export_check_fn
from remat.errors import CandidateError, FingerprintMismatch, PlanError
from remat.plan import Plan
from remat.types import CheckpointMode
from remat.workload import load_workload

from .conftest import TINY, hand_plan as make_plan


def fwd_bwd(loaded, seed: int = 0, step: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    w = loaded.workload
    torch.manual_seed(seed)
    loss = w.loss(w.model, w.batch(step))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in w.model.named_parameters()}
    w.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("mode", [CheckpointMode.FULL, CheckpointMode.SELECTIVE])
def test_gpt_wrapped_is_bitwise_equal_and_replays(mode):
    control, planned = load_workload("gpt", TINY["gpt"]), load_workload("gpt", TINY["gpt"])  # dropout 0.1 on
    handle = apply(planned.workload.model, make_plan(planned.workload.model, ["h.0", "h.1"], mode=mode))
    for step in range(2):
        lc, gc = fwd_bwd(control, seed=step, step=step)
        lp, gp = fwd_bwd(planned, seed=step, step=step)
        assert torch.equal(lc, lp)
        assert gc.keys() == gp.keys()
        assert all(torch.equal(gc[n], gp[n]) for n in gc), [n for n in gc if not torch.equal(gc[n], gp[n])]
    # Checkpointing really happened: each block ran its forward once and replayed once per step.
    assert [(w.path, w.forward_calls, w.replay_calls) for w in handle.wrappers] == [("h.0", 2, 2), ("h.1", 2, 2)]
    assert all(isinstance(w, CheckpointWrapper) and w.mode is mode for w in handle.wrappers)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _saved_and_replayed(loaded) -> tuple[int, int]:
    """(tensors packed by autograd outside any checkpoint, addmm calls during backward)."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    w = loaded.workload
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = w.loss(w.model, w.batch(0))
    with _CountOps() as ops:
        loss.backward()
    return count, ops.counts.get("addmm", 0)


def test_checkpointing_saves_fewer_tensors_and_selective_keeps_matmuls():
    res = {}
    for label, mode in (("none", None), ("full", CheckpointMode.FULL), ("selective", CheckpointMode.SELECTIVE)):
        lw = load_workload("mlp", TINY["mlp"])  # 4 blocks, 2 linears each
        if mode is not None:
            apply(lw.workload.model, make_plan(lw.workload.model, [f"blocks.{i}" for i in range(4)], mode=mode))
        res[label] = _saved_and_replayed(lw)
    # Inside a checkpoint autograd saves nothing the outer hooks see: far fewer tensors kept.
    assert res["full"][0] < res["none"][0] / 2, res
    assert res["selective"][0] < res["none"][0] / 2, res
    # FULL replays the block forwards in backward (at least each block's ``up`` addmm: early_stop ends the
    # replay once GELU's input is rebuilt, so ``down`` need not rerun); SELECTIVE keeps matmul outputs.
    assert res["none"][1] == 0 and res["full"][1] >= 4 and res["selective"][1] == 0, res


def test_remove_restores_the_model_exactly():
    lw = load_workload("gpt", TINY["gpt"])
    model = lw.workload.model
    model.eval()  # no dropout: outputs comparable across calls
    x, _ = lw.workload.batch(0)
    before_out = model(x).detach()
    dicts = {n: dict(vars(m)) for n, m in model.named_modules()}
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    handle = apply(model, make_plan(model, ["h.0", "h.1"]))
    assert isinstance(handle, ApplyHandle) and handle.active
    assert isinstance(model.h[0].__dict__["forward"], CheckpointWrapper)
    assert list(model.state_dict()) == keys                                      # names unchanged
    assert all(p is params[n] for n, p in model.named_parameters())             # identity unchanged
    assert torch.equal(model(x), before_out)
    model(x).sum().backward()
    opt.step()  # the optimizer built before apply still steps the same parameter objects

    handle.remove()
    assert not handle.active
    for n, m in model.named_modules():
        assert vars(m).keys() == dicts[n].keys(), n
        assert all(vars(m)[k] is v for k, v in dicts[n].items()), n
    assert "forward" not in model.h[0].__dict__
    assert list(model.state_dict()) == keys
    with pytest.raises(PlanError, match="already removed"):
        handle.remove()


def test_apply_twice_is_refused_and_instance_forward_is_restored():
    lw = load_workload("mlp", TINY["mlp"])
    model = lw.workload.model
    custom = model.blocks[0].forward  # a user's own instance-level forward must come back as it was
    model.blocks[0].forward = custom
    plan = make_plan(model, ["blocks.0"])
    with apply(model, plan) as handle:
        with pytest.raises(PlanError, match="already checkpointed"):
            apply(model, plan)
        assert handle.wrapper("blocks.0").original_forward is custom
    assert model.blocks[0].__dict__["forward"] is custom


def test_apply_from_plan_json_and_top_level_call(tmp_path):
    lw = load_workload("mlp", TINY["mlp"])
    path = make_plan(lw.workload.model, ["blocks.1"]).save(tmp_path / "plan.json")
    handle = remat.apply(lw.workload.model, str(path))
    assert [w.path for w in handle.wrappers] == ["blocks.1"]
    handle.remove()
    assert callable(remat.apply) and remat.wrap.apply is apply


def test_fingerprint_mismatch_lists_the_differences():
    small = load_workload("gpt", TINY["gpt"])
    bigger = load_workload("gpt", {**TINY["gpt"], "n_layer": 3})
    plan = make_plan(small.workload.model, ["h.0"])
    with pytest.raises(FingerprintMismatch) as err:
        apply(bigger.workload.model, plan)
    assert "module h.2 is new" in str(err.value)
    assert "parameter h.2.attn.c_attn.weight is new" in str(err.value)
    assert "forward" not in bigger.workload.model.h[0].__dict__  # nothing was wrapped


def test_unknown_module_is_a_candidate_error():
    lw = load_workload("gpt", TINY["gpt"])
    plan = make_plan(lw.workload.model, ["h.9"])  # right fingerprint, wrong path
    with pytest.raises(CandidateError, match="'h.9'.*did you mean"):
        apply(lw.workload.model, plan)
    with pytest.raises(PlanError, match="nested"):
        apply(lw.workload.model, make_plan(lw.workload.model, ["h.0", "h.0.mlp"]))


def _bn_step(lw) -> dict[str, torch.Tensor]:
    w = lw.workload
    loss = w.loss(w.model, w.batch(0))
    loss.backward()
    return {**{n: b.clone() for n, b in w.model.named_buffers()},
            **{f"grad {n}": p.grad.clone() for n, p in w.model.named_parameters()}}


def test_guard_keeps_batchnorm_buffers_equal_to_the_control():
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    control = _bn_step(load_workload("cnn", TINY["cnn"]))
    results = {}
    for guarded in (True, False):
        lw = load_workload("cnn", TINY["cnn"])
        apply(lw.workload.model, make_plan(lw.workload.model, blocks, guarded=guarded))
        results[guarded] = _bn_step(lw)
    nbt = "blocks.0.bn1.num_batches_tracked"
    assert all(torch.equal(control[k], results[True][k]) for k in control)  # buffers and grads, bitwise
    assert int(control[nbt]) == 1 and int(results[True][nbt]) == 1
    # Negative control: unguarded, the replay updates BatchNorm a second time (pytorch issue 96136).
    assert int(results[False][nbt]) == 2
    assert not torch.equal(control["blocks.0.bn1.running_mean"], results[False]["blocks.0.bn1.running_mean"])
    assert all(torch.equal(control[k], results[False][k]) for k in control if k.startswith("grad "))
    assert torch.equal(control["stem.1.running_mean"], results[False]["stem.1.running_mean"])  # outside any boundary


def test_export_check_fn_drives_torch_apply_activation_checkpointing():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, CheckpointWrapper as TorchCheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper)

    control, planned = load_workload("gpt", TINY["gpt"]), load_workload("gpt", TINY["gpt"])
    model = planned.workload.model
    check_fn = export_check_fn(make_plan(model, ["h.1"]), model)
    assert check_fn(model.h[1]) and not check_fn(model.h[0]) and not check_fn(model)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=check_fn)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, TorchCheckpointWrapper)]
    assert wrapped == ["h.1"]
    lc, gc = fwd_bwd(control)
    lp, gp = fwd_bwd(planned)
    assert torch.equal(lc, lp)
    gp = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in gp.items()}
    assert gp.keys() == gc.keys() and all(torch.equal(gc[n], gp[n]) for n in gc)

    cnn = load_workload("cnn", TINY["cnn"]).workload.model
    with pytest.raises(PlanError, match="buffer guard"):
        export_check_fn(make_plan(cnn, ["blocks.0"], guarded=True), cnn)


def test_selective_policy_saves_matmuls_only():
    policy = SaveMatmulPolicy()
    aten = torch.ops.aten
    from torch.utils.checkpoint import CheckpointPolicy
    assert policy.decide(aten.addmm.default) is CheckpointPolicy.MUST_SAVE
    assert policy.decide(aten.convolution.default) is CheckpointPolicy.MUST_SAVE
    assert policy.decide(aten.gelu.default) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy.decide(aten.native_dropout.default) is CheckpointPolicy.PREFER_RECOMPUTE


def _tiny_plan_and_model() -> tuple[nn.Module, Plan]:
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    return m, make_plan(m, ["0"])


@pytest.mark.parametrize("first", ["function", "stage"])
def test_remat_apply_is_a_plain_function_whatever_was_imported_first(first, monkeypatch):
    """``remat.apply`` is the function, never a module, and its signature does not change with import order."""
    import inspect
    import types as pytypes
    for name in [n for n in sys.modules if n == "remat.wrap" or n.startswith("remat.wrap.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(remat.__dict__, "apply", raising=False)
    monkeypatch.delitem(remat.__dict__, "wrap", raising=False)
    before = str(inspect.signature(remat.apply))
    if first == "stage":
        import importlib
        importlib.import_module("remat.wrap.handle")   # the stage's modules loaded first
    assert isinstance(remat.apply, pytypes.FunctionType)
    assert str(inspect.signature(remat.apply)) == before
    assert "plan" in inspect.signature(remat.apply).parameters
    m, plan = _tiny_plan_and_model()
    handle = remat.apply(m, plan)
    assert isinstance(handle, remat.ApplyHandle)
    m(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert handle.wrappers[0].replay_calls == 1
    handle.remove()


def test_fingerprint_differences_are_records_by_path():
    """A difference under module 10 is not one under module 1 (a substring test said it was)."""
    from remat.profile import DiffKind, fingerprint
    a = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(11)])
    b = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(10)], torch.nn.Linear(2, 3))
    diffs = fingerprint(a).differences(fingerprint(b))
    assert {(d.kind, d.name) for d in diffs} == {(DiffKind.PARAMETER, "10.weight"),
                                                      (DiffKind.PARAMETER, "10.bias")}
    assert all(d.under("10") and d.under("10", strictly=True) for d in diffs)
    assert not any(d.under("1") for d in diffs)
    assert "parameter 10.weight: [2, 2] float32 -> [3, 2] float32" in [str(d) for d in diffs]


# -- NOTE [module names] ---------------------------------------------------------------------------

def test_module_names_torch_accepts_round_trip_through_plan_json(tmp_path):
    """torchvision's RegNet names blocks ``block1-0``: a plan naming them is written, read back by the
    hardened loader, applied and removed exactly; names no module can have are still refused."""
    import json
    from remat.errors import RematError
    from remat.plan import Plan

    from .conftest import hand_plan
    torch.manual_seed(0)
    trunk = torch.nn.Sequential()
    for name in ("block1-0", "block1+1", "stufe_ü"):
        trunk.add_module(name, torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()))
    model = torch.nn.Sequential()
    model.add_module("trunk_output", trunk)
    paths = ["trunk_output.block1-0", "trunk_output.block1+1", "trunk_output.stufe_ü"]
    plan = hand_plan(model, paths)
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert [b.module for b in loaded.boundaries] == paths
    x = torch.randn(4, 8, requires_grad=True)
    ref = model(x).sum()
    with apply(model, loaded):
        assert model(x).sum().item() == ref.item()
    for bad in ("trunk_output..block1-0", "trunk_output.block1-0\n", "trunk_output.block[1].x", "__import__('os')",
                "a b"):
        d = json.loads((tmp_path / "plan.json").read_text())
        d["boundaries"][0]["module"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(RematError, match="module path"):
            Plan.load(tmp_path / "bad.json")


def test_a_block_whose_name_a_plan_cannot_hold_is_excluded_with_the_reason():
    """A child named like code (spaces, quotes) is never offered: the plan it would be in could not be
    read back (NOTE [module names]); its siblings are profiled as usual."""
    from remat.profile import profile_step
    from remat.workload import TrainingStep, Workload
    torch.manual_seed(0)
    model = nn.Sequential()
    for name in ("ok-0", "not ok", "ok-2"):
        model.add_module(name, nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)))
    x = torch.randn(32, 16)
    step = TrainingStep(Workload(model=model, batch=lambda i: x, loss=lambda m, b: m(b).pow(2).mean()))
    report = profile_step(step, ["ok-0", "not ok", "ok-2"], warmup=1, repeats=1)
    assert "cannot be written in a plan" in report.excluded["not ok"]
    assert {c.name for c in report.candidates} >= {"ok-0", "ok-2"}
