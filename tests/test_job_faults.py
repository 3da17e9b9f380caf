"""remat.auto in a job whose ranks are not alike (NOTE [job faults] in remat/autoplan/job.py, NOTE [dry runs
in a job] in remat/profile/shared.py): rank-local timings never change what the ranks run, and every fault
is a JobFault naming the rank, on every rank that can still say so.

The jobs are tests/fixtures/job_faults.py on 2 gloo ranks (FSDP2 per block), started by hand rather than
by torchrun, whose agent ends the surviving rank within a second of the other's exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remat.errors import JobFault, UserCodeError
from remat.profile.model import CandidateCost
from remat.profile.shared import dry_run_leaders
from remat.types import CheckpointMode

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "job_faults.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path: Path, case: str, world: int = 2, **env: str) -> dict[int, dict]:
    """``case`` on ``world`` ranks; each rank's JSON (a rank that died writes none)."""
    out = tmp_path / case
    port = str(_free_port())
    base = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "WORLD_SIZE": str(world), **env}
    procs = [subprocess.Popen([sys.executable, str(FIXTURE), str(out), case], cwd=ROOT,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout=300)   # a hang bound, not a speed claim
    finally:
        for p in procs:
            p.kill()
    results = {}
    for r in range(world):
        f = out / f"rank{r}.json"
        if f.exists():
            results[r] = json.loads(f.read_text())
    return results


def test_a_rank_slowed_inside_one_block_still_runs_the_same_dry_runs(tmp_path):
    """Rank 1's blocks.1.mlp sleeps 40 ms per forward (its twins take under 1 ms): before the ranks agreed
    the grouping, rank 1 alone split blocks.1.mlp into its own dry-run group, ran one pass more than
    rank 0, and gloo aborted. Now both plan, with one digest, and train on."""
    res = _job(tmp_path, "skew")
    assert sorted(res) == [0, 1], res
    assert all("error" not in r for r in res.values()), res
    assert res[0]["digest"] == res[1]["digest"]
    assert all(len(r["losses"]) == 3 for r in res.values())


@pytest.fixture(scope="module")
def differ(tmp_path_factory) -> dict[int, dict]:
    """One job, three refused calls in turn (the fixture's ``differ``): rank 1's model, batch, budget."""
    return _job(tmp_path_factory.mktemp("differ"), "differ")


@pytest.mark.parametrize("case, words", [
    ("model", ["different models", "rank 0:", "rank 1:"]),
    ("batch", ["different example-batch shapes", "rank 0: (8, 64) int64", "rank 1: (8, 48) int64"]),
    ("budget", ["different budgets", "rank 0: 75%", "rank 1: 80%"]),
])
def test_ranks_that_differ_are_refused_before_the_first_profiled_step(differ, case, words):
    for r in (0, 1):
        res = differ[r][case]
        assert res["error"] == "JobFault", res
        assert all(w in res["message"] for w in words), res["message"]
        assert "losses" not in res and "digest" not in res   # refused: nothing planned, nothing trained


def test_a_rank_that_never_calls_auto_is_named_and_no_collective_pairs_with_it(tmp_path):
    res = _job(tmp_path, "absent", REMAT_AUTO_ARRIVAL_TIMEOUT="5")
    assert res[0]["error"] == "JobFault"
    assert "rank(s) 1 of 2 did not call remat.auto within 5 s" in res[0]["message"]
    assert "losses" not in res[1]   # rank 1 never completed a training step: its collectives had no partner


@pytest.mark.parametrize("case, named", [("killed", "rank(s) 1 recorded no error"),
                                         ("raises", "rank 1 raised UserCodeError")])
def test_a_peer_lost_during_planning_is_named_not_blamed_on_the_loss(tmp_path, case, named):
    res = _job(tmp_path, case)
    assert res[0]["error"] == "JobFault", res[0]
    assert named in res[0]["message"] and "lost a peer" in res[0]["message"]
    if case == "raises":   # the rank whose own code raised keeps its own error
        assert res[1]["error"] == "UserCodeError" and "data loader ran dry" in res[1]["message"]
    else:
        assert 1 not in res


class _TwoRanks:
    """A RankReduce for one process that plays rank ``me`` of two: the other rank's values are given."""

    def __init__(self, me: int, other: list) -> None:
        self.me, self.other = me, other

    def gather(self, value):
        return [value, self.other.pop(0)] if self.me == 0 else [self.other.pop(0), value]

    def median_ms(self, values):
        theirs = self.gather(list(values))
        return [(a + b) / 2 for a, b in zip(*theirs)]

    def max_bytes(self, value):
        return max(self.gather(value))


def _level(fwd_ms: list[float]) -> list[CandidateCost]:
    return [CandidateCost(name=f"blocks.{i}.mlp", class_name="Sequential", order=i, parent=None, fwd_ms=t,
                          input_bytes=64, saved_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: 128},
                          replay_ms={CheckpointMode.KEEP: 0.0, CheckpointMode.FULL: t},
                          replay_extra_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: 0})
            for i, t in enumerate(fwd_ms)]


def test_dry_run_groups_read_agreed_times_not_this_ranks():
    """The grouping on each of two ranks whose own times differ (rank 1's blocks.1.mlp is slow there only):
    each rank alone groups differently (the desync), agreed over the ranks they group alike."""
    fast, slow = [0.5, 0.5, 0.5, 0.5], [0.5, 41.0, 0.5, 0.5]
    sigs = {f"blocks.{i}.mlp": ("Sequential", "same bytes") for i in range(4)}
    alone = [dry_run_leaders(sigs, _level(t)) for t in (fast, slow)]
    assert alone[0] != alone[1]                                    # the hazard: rank-local groups
    seen_by = [dry_run_leaders(sigs, _level(fast), _TwoRanks(0, [list(sigs.values()), slow])),
               dry_run_leaders(sigs, _level(slow), _TwoRanks(1, [list(sigs.values()), fast]))]
    assert seen_by[0] == seen_by[1]


def test_only_a_collective_that_lost_its_peer_is_a_lost_peer():
    from remat.autoplan.job import _peer_lost
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:23769")
    try:
        raise UserCodeError("the workload's loss raised RuntimeError") from lost
    except UserCodeError as wrapped:
        assert _peer_lost(wrapped) is lost        # the collective's own error, for the message
    assert _peer_lost(torch.distributed.DistBackendError("NCCL communicator was aborted")) is not None
    try:   # the safe twin: the user's own error, wrapped the same way
        raise UserCodeError("the workload's loss raised ValueError") from ValueError("bad labels")
    except UserCodeError as wrapped:
        assert _peer_lost(wrapped) is None


def test_arrival_timeout_comes_from_the_environment_or_is_refused(monkeypatch):
    from remat.autoplan.job import ARRIVAL_TIMEOUT_S, arrival_timeout_s
    monkeypatch.delenv("REMAT_AUTO_ARRIVAL_TIMEOUT", raising=False)
    assert arrival_timeout_s() == ARRIVAL_TIMEOUT_S
    monkeypatch.setenv("REMAT_AUTO_ARRIVAL_TIMEOUT", "12.5")
    assert arrival_timeout_s() == 12.5
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv("REMAT_AUTO_ARRIVAL_TIMEOUT", bad)
        with pytest.raises(JobFault, match="REMAT_AUTO_ARRIVAL_TIMEOUT"):
            arrival_timeout_s()
