"""A DDP job trained after ``remat.auto`` is the job without remat, bit for bit: planning leaves no
state in DDP's reducer (NOTE [DDP reducer after planning] in src/remat/autoplan/reducer.py).

The 4-rank job is tests/fixtures/auto_ddp_state_job.py (4 ranks: at 2, a sum of two ranks is the
same in any bucket layout, so the 2-rank job in tests/test_examples.py cannot see this)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from remat.autoplan.reducer import ReducerState
from remat.errors import AutoError

ROOT = Path(__file__).resolve().parents[1]
RANKS = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    """Each rank's arms: control, auto, apply (auto's plan), auto-unrestored (the job without the fix)."""
    out = tmp_path_factory.mktemp("auto_ddp_state")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           str(ROOT / "tests" / "fixtures" / "auto_ddp_state_job.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def differing(a: list[list[float]], b: list[list[float]]) -> int:
    """How many elements of two models' parameters differ (at all)."""
    return sum(x != y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


def test_ddp_after_auto_trains_bitwise_as_without_remat_and_as_apply(job):
    boundaries = {tuple(r["auto"]["boundaries"]) for r in job}
    assert len(boundaries) == 1 and next(iter(boundaries))                  # one non-empty plan on every rank
    for r in job:
        control = r["control"]
        n = len(control["params"])
        assert control["buckets_before"] == [list(range(n))] and not control["rebuilt_before"]  # DDP's constructor's
        for arm in ("auto", "apply"):
            assert r[arm]["buckets_before"] == control["buckets_before"] and not r[arm]["rebuilt_before"]
            assert r[arm]["losses"] == control["losses"]                              # bitwise
            assert differing(r[arm]["params"], control["params"]) == 0                # bitwise, after 4 steps
            assert r[arm]["buckets_after"] == control["buckets_after"]


def test_without_the_fix_the_comparison_fails(job):
    """The negative control: remat.auto with the reducer left as planning left it (already rebuilt)
    trains the job's first step in another bucket layout, and its parameters come out different."""
    for r in job:
        control, unrestored = r["control"], r["auto-unrestored"]
        assert unrestored["rebuilt_before"] and unrestored["buckets_before"] != control["buckets_before"]
        assert differing(unrestored["params"], control["params"]) > 0


def test_the_rebuild_is_back_in_the_jobs_second_step(job):
    """DDP's rebuild briefly holds the old and the new bucket (here one bucket of every parameter,
    4 bytes each) in step 2; after planning left it rebuilt, step 2 was lower by that bucket."""
    for r in job:
        bucket = 4 * sum(len(p) for p in r["control"]["params"])              # float32, counted by hand
        for arm in ("control", "auto", "apply"):
            peaks = r[arm]["peaks"]
            assert peaks[1] - peaks[2] >= bucket, (arm, peaks)
        peaks = r["auto-unrestored"]["peaks"]
        assert peaks[1] == peaks[2]
        assert r["auto"]["peaks"][1] - peaks[1] >= bucket


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Calls:
    """A comm hook's state: how many buckets it reduced."""

    def __init__(self) -> None:
        self.n = 0


def counting_allreduce(state, bucket):   # unannotated: DDP refuses the string annotations of this module
    state.n += 1
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def ddp(**kwargs) -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), **kwargs)


def bucket_params(model: nn.parallel.DistributedDataParallel) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in b.parameters()] for b in model.reducer._get_zeros_like_grad_buckets()]


@pytest.mark.parametrize("static_graph", [False, True])
def test_a_new_reducer_is_new_again_with_its_hook_and_grads_as_a_new_ddp(group, static_graph):
    x = torch.randn(4, 8)
    fresh = ddp(static_graph=static_graph)
    # 100 B buckets: DDP's first iteration reduces all 4 parameters in one bucket, the rebuilt ones split
    model, calls = ddp(static_graph=static_graph, bucket_cap_mb=1e-4), Calls()
    model.register_comm_hook(calls, counting_allreduce)
    initial, state = bucket_params(model), ReducerState(model)
    old = model.reducer
    for _ in range(3):                                        # what planning does to it: it rebuilds
        model(x).sum().backward()
    assert initial == [[0, 1, 2, 3]] and bucket_params(model) != initial      # the check can fail
    state.restore()
    assert model.reducer is not old and bucket_params(model) == initial and not model._has_rebuilt_buckets
    calls.n = 0
    for m in (model, fresh):
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    assert calls.n == 1                                      # the user's hook, on the new reducer, for its one bucket
    plain = ddp().module                                     # world size 1: DDP's gradients are the plain ones
    plain(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_reducer_that_ran_a_backward_is_kept_and_builtin_hooks_are_refused(group):
    model = ddp()
    model(torch.randn(4, 8)).sum().backward()                # its first iteration's order is recorded
    reducer, state = model.reducer, ReducerState(model)
    state.restore()
    assert model.reducer is reducer
    model = ddp()
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(AutoError, match="built-in comm hook"):
        ReducerState(model)
