"""`remat distributed`: per-rank peaks against the per-device budget, the multi-node path (two torchruns on
one host emulating two nodes), collective timeouts and each rank's own wall-clock limit."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remat.cli.main import main
from remat.distributed import DistributedConfig, DistributedReport, Engine, run_distributed
from remat.distributed.launch import free_port, multinode_commands
from remat.distributed.worker import FAULT_ENV
from remat.errors import DistributedError
from remat.plan.model import Boundary, Plan
from remat.profile.fingerprint import fingerprint
from remat.types import CheckpointMode
from remat.workload import load_workload

SHAPE = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "batch_size": 2, "vocab": 64}
SHAPE_ARG = ",".join(f"{k}={v}" for k, v in SHAPE.items())
FAST = ["--dist-steps", "1", "--dist-comm-steps", "1", "--no-ablation", "--dist-timeout", "30"]


@pytest.fixture
def rank_env(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return monkeypatch


def block_plan(*, budget_bytes: int | None = None, preserve_rng_state: bool = True) -> Plan:
    model = load_workload("gpt", SHAPE).workload.model
    return Plan(planner="all", budget_bytes=budget_bytes, reserve=0.0, preserve_rng_state=preserve_rng_state,
                boundaries=[Boundary(module=f"h.{i}", mode=CheckpointMode.FULL, saved_bytes=0, replay_ms=0.0)
                            for i in range(SHAPE["n_layer"])],
                excluded=[], predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=10_000,
                baseline_step_ms=0.0, fingerprint=fingerprint(model))


def test_a_plan_over_its_budget_exits_1_naming_the_ranks(rank_env, tmp_path, capsys):
    """The plan's budget (1 KiB) is below any rank's planned peak: exit 1, every rank named, although the plan
    is the control's training step (bitwise)."""
    plan_path = block_plan(budget_bytes=1024).save(tmp_path / "plan.json")
    code = main(["distributed", "--workload", "gpt", "--shape", SHAPE_ARG, "--plan", str(plan_path),
                 "--world-size", "2", "--engine", "ddp", "--out", str(tmp_path / "out"), *FAST,
                 "--dist-wall-timeout", "120"])
    printed = capsys.readouterr().out
    assert code == 1
    d = json.loads((tmp_path / "out" / "distributed.json").read_text())
    assert d["equivalence"]["ok"] is True and d["budget_bytes"] == 1024
    assert d["over_budget_ranks"] == [0, 1] and d["passed"] is False
    assert "2 of 2 ranks over the per-device budget" in printed
    # the safe twin, on the peaks the ranks measured: a budget at the largest planned peak passes, a byte
    # under it names exactly the rank(s) at that peak
    peaks = {r["rank"]: r["peak_bytes"] for r in d["per_rank"]["plan"]}
    top = max(peaks.values())
    assert DistributedReport.from_json({**d, "budget_bytes": top}).passed
    under = DistributedReport.from_json({**d, "budget_bytes": top - 1})
    assert [r.rank for r in under.over_budget] == [r for r, p in peaks.items() if p == top] and not under.passed


def test_emit_config_prints_complete_commands_and_refuses_an_uneven_split(tmp_path, capsys):
    plan_path = block_plan().save(tmp_path / "plan.json")
    args = ["distributed", "--workload", "gpt", "--shape", SHAPE_ARG, "--plan", str(plan_path), "--world-size", "4",
            "--out", "out", "--emit-config", str(tmp_path / "run.json"), "--master-addr", "node0.example"]
    assert main([*args, "--nnodes", "2"]) == 0
    printed = capsys.readouterr().out
    for k in (0, 1):
        cmd = multinode_commands(tmp_path / "run.json", "out", world_size=4, nnodes=2, master_addr="node0.example")[k]
        assert f"node {k}: {shlex.join(cmd)}" in printed
        assert cmd[cmd.index("--node-rank") + 1] == str(k) and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert "NNODES" not in printed and "NPROC" not in printed and "HOST0" not in printed
    cfg = DistributedConfig.load(tmp_path / "run.json")
    assert cfg.world_size == 4 and cfg.wall_timeout_s == 3600.0   # each rank's own limit (no launcher there)
    assert main([*args, "--nnodes", "3"]) == 2
    assert "does not split evenly over 3 node(s)" in capsys.readouterr().err


def test_two_nodes_on_one_host_exit_non_zero_on_both_when_the_plan_breaks_equivalence(rank_env, tmp_path, capsys):
    """Two torchruns (--nnodes 2 --node-rank 0/1, one rank each, loopback rendezvous) run the printed commands;
    the plan drops the RNG state, so the replay redraws dropout masks (gpt, dropout 0.1): both exit non-zero,
    and each node has the report and prints the table."""
    plan_path = block_plan(preserve_rng_state=False).save(tmp_path / "plan.json")
    port = free_port()
    assert main(["distributed", "--workload", "gpt", "--shape", SHAPE_ARG, "--plan", str(plan_path),
                 "--world-size", "2", "--engine", "ddp", "--out", "out", *FAST, "--dist-wall-timeout", "150",
                 "--emit-config", str(tmp_path / "run.json"), "--nnodes", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(port)]) == 0
    lines = [ln.split(": ", 1)[1] for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("node ")]
    assert len(lines) == 2
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    procs = []
    for k, line in enumerate(lines):
        node = tmp_path / f"node{k}"       # each "node" its own folder: out/ and run.json are relative
        node.mkdir()
        (node / "run.json").write_text((tmp_path / "run.json").read_text())
        cmd = shlex.split(line.replace(str(tmp_path / "run.json"), "run.json"))
        assert cmd[0] == "torchrun"
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd[1:]], cwd=node, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), outs
    for k, text in enumerate(outs):
        d = json.loads((tmp_path / f"node{k}" / "out" / "distributed.json").read_text())
        assert d["world_size"] == 2 and d["equivalence"]["ok"] is False and d["equivalence"]["grads_match"] is False
        assert "DIFFERENT" in text and "FAILED" in text, text
        assert (tmp_path / f"node{k}" / "out" / f"rank-{k}.done").exists()   # it finished; the verdict failed


def test_a_collective_timeout_names_the_rank_and_the_collective(rank_env, tmp_path):
    """Rank 1 hangs after its first step; rank 0 waits in DDP's all-reduce past the 3 s collective timeout."""
    rank_env.setenv(FAULT_ENV, "hang:1:1")
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(DistributedConfig(spec="gpt", shape=SHAPE, world_size=2, engine=Engine.DDP, ablation=False,
                                          steps=1, warmup=2, comm_steps=1, timeout_s=3.0),
                        work_dir=tmp_path, wall_timeout_s=120)
    msg = info.value.message
    assert msg.startswith("rank 0 raised DistributedError: rank 0: a collective timed out after 3 s waiting for a "
                          "peer: all_reduce of "), msg
    assert "rank 1 was stopped by the launcher after 1/" in msg and "user" not in msg.split("(then")[0]
    assert info.value.exit_code == 2 and time.monotonic() - t0 < 100


def test_each_rank_keeps_its_own_wall_clock_limit(rank_env, tmp_path):
    """NOTE [rank wall clock]: with no launcher limit in reach (120 s), the ranks stop themselves at 4 s."""
    rank_env.setenv(FAULT_ENV, "hang:1:1")
    with pytest.raises(DistributedError) as info:
        run_distributed(DistributedConfig(spec="gpt", shape=SHAPE, world_size=2, engine=Engine.DDP, ablation=False,
                                          steps=1, warmup=2, comm_steps=1, timeout_s=60.0, wall_timeout_s=4.0),
                        work_dir=tmp_path, wall_timeout_s=120)
    assert "did not finish within 4 s (the wall-clock limit)" in info.value.message
    assert info.value.exit_code == 2
