"""remat.distributed: world size 2 on gloo (DDP and FSDP2), equivalence, teardown, refusals.

Every launch has a wall-clock limit (``wall_timeout_s``) and a short collective timeout, so a
regression fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import remat
from remat.cli.main import main
from remat.distributed import DistributedConfig, DistributedReport, Engine, run_distributed
from remat.distributed.intervals import exposed_ns, subtract, total_ns, union
from remat.distributed.launch import _alive_rank_pid
from remat.distributed.report import CollectiveCount, RankResult, RankSide, assemble
from remat.distributed.worker import FAULT_ENV, compare_grads
from remat.errors import DistributedError
from remat.plan.model import Boundary, Plan
from remat.profile.fingerprint import fingerprint
from remat.types import CheckpointMode, MemorySource
from remat.workload import Workload, load_workload

SHAPE = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "batch_size": 2, "vocab": 64}
FAST = dict(steps=2, warmup=2, comm_steps=1, timeout_s=20.0)
WALL_S = 75.0
REPORT_KEYS = {"world_size", "engine", "backend", "per_rank", "global_samples_per_s", "collectives",
               "exposed_comm_ms", "ablation_step_ms", "equivalence"}


@pytest.fixture
def rank_env(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return monkeypatch


def block_plan() -> Plan:
    model = load_workload("gpt", SHAPE).workload.model
    return Plan(planner="all", budget_bytes=None, reserve=0.0,
                boundaries=[Boundary(module=f"h.{i}", mode=CheckpointMode.FULL, saved_bytes=0, replay_ms=0.0)
                            for i in range(SHAPE["n_layer"])],
                excluded=[], predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=0,
                baseline_step_ms=0.0, fingerprint=fingerprint(model))


def check_report(d: dict, engine: str, ops: set[str]) -> None:
    assert REPORT_KEYS <= d.keys()
    assert (d["world_size"], d["engine"], d["backend"]) == (2, engine, "gloo")
    for side in ("control", "plan"):
        ranks = d["per_rank"][side]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["peak_bytes"] > 0 and 0 < r["p50_ms"] <= r["p95_ms"]
            assert r["exposed_comm_ms"] is not None and 0.0 <= r["exposed_comm_ms"] <= r["comm_ms"] + 1e-6
        assert d["global_samples_per_s"][side] > 0
        assert d["exposed_comm_ms"][side] is not None and d["exposed_comm_ms"][side] >= 0.0
        assert d["ablation_step_ms"][side] > 0
        assert set(d["collectives"][side]) == ops
        assert all(c["count"] > 0 and c["bytes"] > 0 for c in d["collectives"][side].values())
    # checkpointing drops activations: the planned peak is lower on every rank
    assert all(p["peak_bytes"] < c["peak_bytes"] for c, p in zip(d["per_rank"]["control"], d["per_rank"]["plan"]))
    eq = d["equivalence"]
    assert eq["criterion"] == "bitwise" and eq["grads_match"] and eq["bitwise_equal"] and eq["max_abs_diff"] == 0.0
    assert eq["loss_equal"] and eq["collective_counts_equal"] and eq["ok"]
    assert eq["collective_counts"]["control"] == eq["collective_counts"]["plan"]
    assert DistributedReport.from_json(json.loads(json.dumps(d))).to_json() == d
    # one context spelling (issue 13): "torch_version"; the older "torch" key is not read (issue 39)
    old = {("torch" if k == "torch_version" else k): v for k, v in d.items()}
    with pytest.raises(DistributedError, match="malformed distributed.json: KeyError: 'torch_version'"):
        DistributedReport.from_json(old)


# -- world size 2 on gloo ------------------------------------------------------------------------

def test_ddp_world_size_2_through_the_cli(rank_env, tmp_path):
    plan_path = block_plan().save(tmp_path / "plan.json")
    out = tmp_path / "out"
    code = main(["distributed", "--workload", "gpt", "--shape", ",".join(f"{k}={v}" for k, v in SHAPE.items()),
                 "--plan", str(plan_path), "--world-size", "2", "--engine", "ddp", "--out", str(out),
                 "--dist-steps", "2", "--dist-comm-steps", "1", "--dist-timeout", "20", "--dist-wall-timeout", "75"])
    assert code == 0
    d = json.loads((out / "distributed.json").read_text())
    check_report(d, "ddp", {"all_reduce"})
    # one bucket of every gradient, averaged: the bytes are the parameters' bytes (weight tying counted once)
    n_bytes = sum(p.numel() * 4 for p in load_workload("gpt", SHAPE).workload.model.parameters())
    assert d["collectives"]["control"]["all_reduce"]["bytes"] == n_bytes


def test_fsdp2_world_size_2(rank_env, tmp_path):
    config = DistributedConfig(spec="gpt", shape=SHAPE, plan=block_plan(), world_size=2, engine=Engine.FSDP2, **FAST)
    report = run_distributed(config, work_dir=tmp_path, wall_timeout_s=WALL_S)
    d = report.to_json()
    check_report(d, "fsdp2", {"all_gather", "reduce_scatter"})
    # the replay inside backward must not all-gather again: root + each block in forward, each block in backward
    assert d["collectives"]["plan"]["all_gather"]["count"] == 1 + 2 * SHAPE["n_layer"]
    assert d["collectives"]["plan"]["reduce_scatter"]["count"] == 1 + SHAPE["n_layer"]
    assert report.equivalence is not None and report.equivalence.ok


def test_killed_rank_raises_naming_it_and_leaves_no_process(rank_env, tmp_path):
    rank_env.setenv(FAULT_ENV, "exit:1:1")  # rank 1 calls os._exit(1) after its first step
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(DistributedConfig(spec="gpt", shape=SHAPE, world_size=2, engine=Engine.DDP, ablation=False,
                                          **FAST), work_dir=tmp_path, wall_timeout_s=WALL_S)
    assert time.monotonic() - t0 < 60
    assert info.value.message.startswith("rank 1 died after 1/")
    assert all(_alive_rank_pid(tmp_path.resolve(), r) is None for r in (0, 1))


def build_reentrant(batch_size: int = 4, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Workload:
    """A workload that checkpoints itself with use_reentrant=True (DDP + find_unused breaks on it)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 16)
            self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, self.emb(x), use_reentrant=True))

    model = Net().to(device=device, dtype=dtype)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 16, (batch_size,), generator=g)
        return x, x.roll(1)

    return Workload(model=model, batch=batch, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_reentrant_with_find_unused_parameters_is_refused(rank_env, tmp_path):
    # declared: refused before anything starts
    with pytest.raises(DistributedError, match="find_unused_parameters=True") as info:
        DistributedConfig(spec="gpt", shape={}, world_size=2, engine=Engine.DDP, find_unused_parameters=True,
                          use_reentrant=True)
    assert "Expected to mark a variable ready only once" in info.value.message and info.value.tip
    # undeclared (the workload does it itself): the rank's error is translated, naming the rank
    spec = f"{Path(__file__).resolve()}:build_reentrant"
    with pytest.raises(DistributedError, match=r"rank \d raised DistributedError: rank \d: DDP marked a parameter "
                                               r"ready twice") as info:
        run_distributed(DistributedConfig(spec=spec, shape={}, world_size=2, engine=Engine.DDP,
                                          find_unused_parameters=True, ablation=False, **FAST),
                        work_dir=tmp_path, wall_timeout_s=WALL_S)
    assert info.value.tip and "use_reentrant=False" in info.value.tip


# -- the parts, without launching -----------------------------------------------------------------

def test_intervals_and_exposed_communication():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert subtract([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == [(0, 2), (3, 5), (7, 9)]
    assert subtract([(0, 4), (6, 8)], [(0, 10)]) == []
    comm, compute = [(0, 10), (8, 14)], [(0, 6), (12, 20)]
    assert total_ns(comm) == 14 and exposed_ns(comm, compute) == 6  # [6, 12)
    assert exposed_ns([], compute) == 0 and exposed_ns(comm, []) == 14


def test_config_round_trip_and_validation():
    cfg = DistributedConfig(spec="gpt", shape=SHAPE, world_size=2, engine=Engine.FSDP2, plan=block_plan(), steps=3)
    back = DistributedConfig.from_json(json.loads(json.dumps(cfg.to_json())))
    assert back.to_json() == cfg.to_json() and back.backend == "gloo"
    with pytest.raises(DistributedError, match="at least 2"):
        DistributedConfig(spec="gpt", shape={}, world_size=2, warmup=1)
    with pytest.raises(DistributedError, match="DDP option"):
        DistributedConfig(spec="gpt", shape={}, world_size=2, engine=Engine.FSDP2, find_unused_parameters=True)


def _side(count: int, loss0: float = 1.0) -> RankSide:
    return RankSide(step_ms=[10.0, 12.0], peak_bytes=100, peak_phase="backward", exposed_comm_ms=[1.0],
                    comm_ms=[2.0], collectives={"all_reduce": CollectiveCount(count=count, bytes=64)},
                    collectives_stable=True, ablation_step_ms=[9.0], loss0=loss0)


def _report(results: list[RankResult]) -> DistributedReport:
    cfg = DistributedConfig(spec="gpt", shape={}, world_size=len(results), engine=Engine.DDP, steps=2, warmup=2,
                            comm_steps=1)
    return assemble(results, cfg, comm_source="test", torch_version=torch.__version__, criterion="bitwise", notes=[])


def test_distributed_equivalence_is_verifys_per_tensor_rule():
    # float32: verify allows max|diff| <= 1e-8 + 1e-5 * max|control| per tensor (NOTE [tolerances])
    from remat.verify.model import TOLERANCES
    tol = TOLERANCES["float32"]
    big = torch.tensor([1000.0, 1e-6, 0.0])
    # 1e-6 off on a near-zero entry: element-wise allclose(rtol=1e-5, atol=1e-7) rejects it, the max-norm rule
    # (scale set by the 1000.0 entry: bound 1e-8 + 1e-2) accepts it
    near = big + torch.tensor([0.0, 1e-6, 0.0])
    assert not torch.allclose(big, near, rtol=1e-5, atol=1e-7)
    ok = compare_grads([("w", big)], [("w", near)])
    assert not ok.bitwise_equal and ok.within_tolerance
    assert tol.allows(ok.max_abs_diff, 1000.0)
    # 0.1 off on the large entry: over the bound (1e-2), rejected
    far = big + torch.tensor([0.1, 0.0, 0.0])
    bad = compare_grads([("w", big)], [("w", far)])
    assert not bad.within_tolerance and bad.max_abs_diff == pytest.approx(0.1, rel=1e-3)
    from remat.distributed.worker import equivalence_criterion
    assert equivalence_criterion("cpu", "float32") == "bitwise"
    assert "rtol=0.016" in equivalence_criterion("cuda", "bfloat16")


def test_equivalence_checks_can_fail():
    a = [("w", torch.ones(3)), ("b", torch.zeros(2))]
    same = compare_grads(a, [(n, t.clone()) for n, t in a])
    assert same.bitwise_equal and same.max_abs_diff == 0.0
    off = compare_grads(a, [("w", torch.ones(3) + 1e-7), ("b", torch.zeros(2))])
    assert not off.bitwise_equal and off.worst_param == "w" and off.max_abs_diff > 0
    missing = compare_grads(a, [("w", torch.ones(3)), ("b", None)])
    assert missing.mismatched

    good = _report([RankResult(rank=r, host="h", samples_per_step=2, memory_source=MemorySource.CPU_LIVE_TENSORS,
                               control=_side(1), plan=_side(1), grads=same) for r in (0, 1)])
    assert good.equivalence is not None and good.equivalence.ok
    assert good.control.global_samples_per_s == pytest.approx(4 / 0.011)  # 2 ranks x 2 samples / slowest p50
    # a replay that re-issues a collective, or different gradients, is not the same training step
    extra = _report([RankResult(rank=r, host="h", samples_per_step=2, memory_source=MemorySource.CPU_LIVE_TENSORS,
                                control=_side(1), plan=_side(2 if r else 1), grads=same) for r in (0, 1)])
    assert extra.equivalence is not None and not extra.equivalence.collective_counts_equal and not extra.equivalence.ok
    diff = _report([RankResult(rank=r, host="h", samples_per_step=2, memory_source=MemorySource.CPU_LIVE_TENSORS,
                               control=_side(1), plan=_side(1), grads=off if r else same) for r in (0, 1)])
    assert diff.equivalence is not None and not diff.equivalence.grads_match
    assert diff.equivalence.worst == {"rank": 1, "param": "w"}


def test_distributed_is_exported():
    assert remat.DistributedError is DistributedError


def test_verify_world_size_flag_runs_the_same_plan_on_two_ranks(rank_env, tmp_path):
    """`remat verify --world-size 2`: single-process proof, then the distributed one (issue 6 CLI)."""
    plan_path = block_plan().save(tmp_path / "plan.json")
    out = tmp_path / "v"
    code = main(["verify", "--workload", "gpt", "--shape", ",".join(f"{k}={v}" for k, v in SHAPE.items()),
                 "--plan", str(plan_path), "--steps", "1", "--seeds", "1", "--timing-steps", "0", "--out", str(out),
                 "--world-size", "2", "--engine", "ddp", "--dist-steps", "2", "--dist-comm-steps", "1",
                 "--no-ablation", "--dist-timeout", "20", "--dist-wall-timeout", "75"])
    assert code == 0
    assert json.loads((out / "verify.json").read_text())["passed"] is True
    d = json.loads((out / "distributed.json").read_text())
    assert d["world_size"] == 2 and d["equivalence"]["ok"] is True
