"""Starting the ranks with torchrun, watching them, and turning any failure into a typed error.

NOTE [launcher]
The ranks are started by PyTorch's own launcher, ``python -m torch.distributed.run``
(torchrun), run as a child process of the caller, each rank being
``python -m remat.distributed.worker --config DIR/config.json --out DIR``. Why this and not
``torch.multiprocessing.spawn``:

* it is the way the job runs for real: the same rank program, the same environment contract
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), the same rendezvous, locally and on many
  nodes; a local run exercises the multi-node code path;
* the elastic agent already does the first half of teardown: when a rank fails it stops the
  others (SIGTERM, then SIGKILL after ``--shutdown-timeout``) and exits non-zero
  (``--max-restarts 0``: a measurement is never silently retried);
* ranks are fresh interpreters (no fork of a process holding torch threads) and rebuild the
  workload from the spec and shape in the config: nothing torch is pickled across processes;
* the caller (CLI, test, notebook) never holds torch.distributed state, so a wedged rank can
  always be abandoned: the caller waits on torchrun with a wall-clock limit and then kills
  stragglers by the PIDs the ranks wrote (NOTE [rank files], worker.py).
The cost is start-up: about 3-5 s per run here (the agent and each rank import torch).

Locally (what :func:`launch_ranks` runs; the port is a free loopback port picked per run)::

    python -m torch.distributed.run --nnodes 1 --nproc-per-node N --master-addr 127.0.0.1 \
        --master-port PORT --max-restarts 0 --monitor-interval 0.1 --shutdown-timeout 5 \
        -m remat.distributed.worker --config DIR/config.json --out DIR

Several nodes: ``remat distributed ... --emit-config run.json --nnodes 2 --master-addr HOST0``
writes the config once (``world_size`` = nodes x ranks per node; its ``wall_timeout_s`` is each
rank's own limit, NOTE [rank wall clock] in worker.py) and prints, from
:func:`multinode_commands`, the complete command for each node (nothing left to fill in)::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank K --master-addr HOST0 --master-port 29500 \
        --max-restarts 0 -m remat.cli.distributed_rank --config run.json --out DIR

``remat.cli.distributed_rank`` is this package's rank program plus what the local command
does after the run: every node's local rank 0 writes ``DIR/distributed.json`` and prints the
table (NOTE [rank report] in worker.py), and every rank exits with the verdict (NOTE
[teardown]), so each node's torchrun exits non-zero when the plan is not the control's step or
a rank is over the budget. ``torch.set_num_threads`` divides the node's cores by
``LOCAL_WORLD_SIZE`` (= world size on one node).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from .._json import Enum, Int, Num, Obj, Opt, Str, read_json_file, validate
from ..errors import DistributedError
from ..types import ProgressFn, no_progress
from .config import DistributedConfig
from .report import DistributedReport
from .worker import REPORT_NAME, rank_file

WORKER_MODULE = "remat.distributed.worker"
DEFAULT_WALL_TIMEOUT_S = 3600.0
_POLL_S = 0.1
_GRACE_S = 5.0  # after SIGTERM: how long torchrun and the ranks get before SIGKILL
R = TypeVar("R")


def free_port() -> int:
    """A free TCP port on the loopback interface (bound, read, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(config_path: Path, out: Path, world_size: int, port: int,
                     module: str = WORKER_MODULE) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            "--monitor-interval", "0.1", "--shutdown-timeout", str(int(_GRACE_S)),
            "-m", module, "--config", str(config_path), "--out", str(out)]


MULTINODE_MODULE = "remat.cli.distributed_rank"   # the rank program that also renders (NOTE [launcher])


def multinode_commands(config_path: Path | str, out: Path | str, *, world_size: int, nnodes: int,
                       master_addr: str, master_port: int = 29500, module: str = MULTINODE_MODULE) -> list[list[str]]:
    """The torchrun command of each node (index = node rank) for a job of ``world_size`` ranks on ``nnodes``
    nodes, rendezvous at ``master_addr:master_port`` (node 0's host): NOTE [launcher]."""
    if nnodes < 1 or world_size % nnodes:
        raise DistributedError(f"world size {world_size} does not split evenly over {nnodes} node(s)",
                               tip="give --nnodes a divisor of --world-size (ranks per node = world size / nnodes)")
    return [["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(world_size // nnodes),
             "--node-rank", str(k), "--master-addr", master_addr, "--master-port", str(master_port),
             "--max-restarts", "0", "-m", module, "--config", str(config_path), "--out", str(out)]
            for k in range(nnodes)]


# -- the ranks' state, from their files --------------------------------------------------------------

class RankStatus(str, enum.Enum):
    """What a rank's files say it did (:func:`rank_state`)."""

    DONE = "done"                  # wrote its done file
    ERROR = "error"                # wrote an error file (its kind: :class:`RankErrorKind`)
    STOPPED = "stopped"            # the launcher sent it SIGTERM (hung, or a peer failed)
    DIED = "died"                  # started (pid file) and vanished without a word
    NOT_STARTED = "not started"    # no file at all


class RankErrorKind(str, enum.Enum):
    """Whose fault a rank's error is (NOTE [rank errors]): the user's code, the user's input, or remat's."""

    USER = "user"
    INPUT = "input"
    INTERNAL = "internal"


@dataclasses.dataclass(frozen=True)
class RankState:
    rank: int
    kind: RankStatus
    detail: str
    tip: str | None = None
    error_kind: RankErrorKind | None = None     # for ERROR (NOTE [rank errors])
    time: float | None = None         # for "error": when the rank recorded it (time.time())
    traceback: str | None = None

    @property
    def follow_on(self) -> bool:
        """An error a rank hits because a *peer* failed (a collective lost its peer, or timed out waiting)."""
        text = self.detail.lower()
        return self.kind is RankStatus.ERROR and any(p in text for p in _FOLLOW_ON)


# What a collective raises on the surviving ranks when a peer fails first (gloo, NCCL, the store).
_FOLLOW_ON = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "socket timeout", "timed out", "gloo", "nccl", "recvbytes", "sendbytes",
              "ncclremoteerror", "process group has been destroyed")

_ERROR_FILE = Obj({"rank": Int(0, 1 << 20), "type": Str(max_len=200), "message": Str(max_len=20_000),
                   "tip": Opt(Str(max_len=20_000)), "what": Str(max_len=2_000)},
                  {"kind": Enum("user", "input", "internal"), "time": Num(0, 1e11), "traceback": Str(max_len=20_000)})


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _progress_text(out: Path, rank: int) -> str:
    text = _read(rank_file(out, rank, "progress"))
    if not text or len(text.split(" ", 2)) < 3:
        return "before its first step"
    done, total, what = text.strip().split(" ", 2)
    return f"after {done}/{total} steps ({what})"


def rank_state(out: Path, rank: int) -> RankState:
    if rank_file(out, rank, "done").exists():
        return RankState(rank, RankStatus.DONE, "finished")
    path = rank_file(out, rank, "error.json")
    if path.exists():
        try:
            e = read_json_file(path, error=DistributedError, what="rank error file", max_bytes=1 << 20)
            validate(e, _ERROR_FILE, error=DistributedError, what="rank error file")
        except DistributedError:
            return RankState(rank, RankStatus.ERROR, "raised an error (unreadable error file)")
        return RankState(rank, RankStatus.ERROR, f"raised {e['type']}: {e['message']} (during {e['what']})", e.get("tip"),
                         error_kind=RankErrorKind(e.get("kind", "internal")), time=e.get("time"), traceback=e.get("traceback"))
    if _read(rank_file(out, rank, "sigterm")):
        return RankState(rank, RankStatus.STOPPED, f"was stopped by the launcher {_progress_text(out, rank)}")
    if rank_file(out, rank, "pid").exists():
        return RankState(rank, RankStatus.DIED, f"died {_progress_text(out, rank)} without reporting an error "
                                       "(crashed, was killed, or exited)")
    return RankState(rank, RankStatus.NOT_STARTED, "never started")


def lead_culprits(states: list[RankState]) -> list[RankState]:
    """The failed ranks, the real cause first (NOTE [rank errors]): errors that are not follow-ons
    (earliest first), then ranks that died without a word, then follow-on errors (earliest first)."""
    def when(s: RankState) -> float:
        return s.time if s.time is not None else float("inf")
    causes = sorted((s for s in states if s.kind is RankStatus.ERROR and not s.follow_on), key=when)
    died = [s for s in states if s.kind is RankStatus.DIED]
    follow = sorted((s for s in states if s.kind is RankStatus.ERROR and s.follow_on), key=when)
    return causes + died + follow


def _log_tail(log: Path, lines: int = 15) -> str:
    text = _read(log) or ""
    return "\n".join(text.strip().splitlines()[-lines:])


def diagnose(out: Path, world_size: int, *, returncode: int | None, timed_out: float | None, log: Path) -> DistributedError:
    """One typed error naming the rank(s) at fault, with every rank's state."""
    states = [rank_state(out, r) for r in range(world_size)]
    tip = _failure_tip(out, states, log)
    if timed_out is not None:
        stuck = [s for s in states if s.kind != "done"]
        return DistributedError(
            f"the distributed run did not finish within {timed_out:g} s and was stopped; "
            + "; ".join(f"rank {s.rank} {s.detail}" for s in (stuck or states)), tip=tip)
    culprits = lead_culprits(states)
    if culprits:
        return _culprit_error(culprits[0], states, tip)
    return _no_culprit_error(states, returncode, tip, log)


def _failure_tip(out: Path, states: list[RankState], log: Path) -> str:
    """Where every rank's files are, and the stopped ranks' stacks."""
    tip = f"every rank's files and torchrun's output are in {out} ({log.name})"
    stacks = [s.rank for s in states if s.kind is RankStatus.STOPPED]
    if stacks:
        tip += "; where the stopped ranks were: " + ", ".join(rank_file(out, r, "sigterm").name for r in stacks)
    return tip


def _culprit_error(first: RankState, states: list[RankState], tip: str) -> DistributedError:
    """The rank at fault first (NOTE [rank errors]), then every other rank's state."""
    head = f"rank {first.rank} {first.detail}"
    rest = "; ".join(f"rank {s.rank} {s.detail}" for s in states if s is not first)
    return DistributedError(head + (f" (then: {rest})" if rest else ""), tip=first.tip or tip,
                            traceback_text=first.traceback if first.error_kind in (RankErrorKind.USER, RankErrorKind.INTERNAL) else None,
                            internal=first.error_kind is RankErrorKind.INTERNAL)


def _no_culprit_error(states: list[RankState], returncode: int | None, tip: str, log: Path) -> DistributedError:
    """No rank failed on its own: torchrun failed before any started, or rank 0 wrote no report."""
    if all(s.kind is RankStatus.NOT_STARTED for s in states):
        return DistributedError(f"torchrun exited with code {returncode} before any rank started:\n{_log_tail(log)}",
                                tip=tip)
    if all(s.kind is RankStatus.DONE for s in states):
        return DistributedError(f"every rank finished but rank 0 wrote no {REPORT_NAME} (torchrun exit code "
                                f"{returncode})", tip=tip)
    others = "; ".join(f"rank {s.rank} {s.detail}" for s in states)
    return DistributedError(f"the distributed run failed (torchrun exit code {returncode}): {others}", tip=tip)


# -- processes --------------------------------------------------------------------------------------

def _alive_rank_pid(out: Path, rank: int, module: str = WORKER_MODULE) -> int | None:
    """This run's rank process, if it still exists (checked against its command line, not only the PID)."""
    text = _read(rank_file(out, rank, "pid"))
    if not text:
        return None
    try:
        pid = int(json.loads(text)["pid"]) if len(text) < 4096 else -1
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError, KeyError, json.JSONDecodeError):
        return None
    return pid if module in cmdline and str(out) in cmdline else None


def kill_stragglers(out: Path, world_size: int, grace_s: float = _GRACE_S, module: str = WORKER_MODULE) -> list[int]:
    """SIGTERM, then SIGKILL, every rank process of this run still alive; returns the ranks that were."""
    alive = {r: pid for r in range(world_size) if (pid := _alive_rank_pid(out, r, module)) is not None}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive.values():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive_rank_pid(out, r, module) for r in alive):
            time.sleep(_POLL_S)
        if not any(_alive_rank_pid(out, r, module) for r in alive):
            break
    return sorted(alive)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM torchrun (it forwards the signal to its ranks), then SIGKILL it after the grace period."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=_GRACE_S + 2.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=_GRACE_S)


def _clean(out: Path, world_size: int, report_name: str = REPORT_NAME) -> None:
    (out / report_name).unlink(missing_ok=True)
    for r in range(world_size):
        for kind in ("pid", "progress", "error.json", "sigterm", "done"):
            rank_file(out, r, kind).unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankProgram(Generic[R]):
    """What torchrun starts on every rank and what rank 0 leaves behind (NOTE [launcher])."""

    module: str                  # ``python -m MODULE --config DIR/config.json --out DIR``
    report_name: str             # rank 0's report, DIR/report_name
    name: str                    # "distributed": the report is the "distributed report", a temporary DIR remat-NAME-*
    read_report: Callable[[Any], R]   # the report's JSON -> the report
    diagnose: Callable[[Path, DistributedConfig, int | None, float | None], DistributedError]
    # (DIR, config, torchrun's exit code, the wall limit if hit) -> the error naming the rank at fault


def diagnose_launch(out: Path, config: DistributedConfig, returncode: int | None, timed_out: float | None) -> DistributedError:
    """:func:`diagnose` for a launch of ``config`` in ``out``."""
    return diagnose(out, config.world_size, returncode=returncode, timed_out=timed_out, log=out / "torchrun.log")


DISTRIBUTED_PROGRAM = RankProgram(module=WORKER_MODULE, report_name=REPORT_NAME, name="distributed",
                                  read_report=DistributedReport.from_json, diagnose=diagnose_launch)


def launch_ranks(config: DistributedConfig, program: RankProgram[R], *, what: str, work_dir: Path | str | None = None,
           wall_timeout_s: float | None = None, progress: ProgressFn = no_progress) -> R:
    """Run ``config`` on ``config.world_size`` local ranks of ``program``; its report, or a :class:`DistributedError`.

    ``work_dir`` receives ``config.json``, the report, torchrun's log and the rank files (a
    temporary folder when None: removed after a success, kept after a failure and named in the
    error's tip). ``wall_timeout_s`` bounds the whole run; ``what`` labels its progress. A port
    taken between picking and binding it is retried once, on another.
    """
    _check_devices(config)
    temporary = work_dir is None
    out = Path(tempfile.mkdtemp(prefix=f"remat-{program.name}-")) if work_dir is None else Path(work_dir)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.json")
    limit = DEFAULT_WALL_TIMEOUT_S if wall_timeout_s is None else float(wall_timeout_s)
    for attempt in range(2):
        returncode, timed_out = _launch_once(config, program, out, limit, progress, what)
        report_path = out / program.report_name
        # a failed check exits non-zero on every rank after a full run (NOTE [teardown] in worker.py)
        finished = returncode == 0 or all(rank_state(out, r).kind is RankStatus.DONE for r in range(config.world_size))
        if finished and timed_out is None and report_path.is_file():
            report = program.read_report(read_json_file(report_path, error=DistributedError,
                                                        what=f"{program.name} report"))
            if temporary:
                shutil.rmtree(out, ignore_errors=True)
            return report
        if attempt == 0 and timed_out is None and _port_taken(out):
            continue  # the free port was taken between picking and binding it: once more, on another
        raise program.diagnose(out, config, returncode, timed_out)
    raise AssertionError("unreachable")


def _check_devices(config: DistributedConfig) -> None:
    if config.device.startswith("cuda"):
        import torch
        if torch.cuda.device_count() < config.world_size:
            raise DistributedError(f"world size {config.world_size} on CUDA needs {config.world_size} GPUs on this "
                                   f"host, found {torch.cuda.device_count()}",
                                   tip="NCCL needs one GPU per rank; for more ranks than GPUs use --device cpu (gloo)")


def _port_taken(out: Path) -> bool:
    """torchrun failed to bind its port, before rank 0 got anywhere."""
    log_text = (_read(out / "torchrun.log") or "").lower()
    port_taken = "address already in use" in log_text or "eaddrinuse" in log_text
    return port_taken and rank_state(out, 0).kind in (RankStatus.NOT_STARTED, RankStatus.ERROR)


def _launch_once(config: DistributedConfig, program: RankProgram[Any], out: Path, wall_timeout_s: float,
                 progress: ProgressFn, what: str) -> tuple[int | None, float | None]:
    """Run torchrun once; (its exit code, the wall limit if it was hit)."""
    _clean(out, config.world_size, program.report_name)
    cmd = torchrun_command(out / "config.json", out, config.world_size, free_port(), program.module)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // config.world_size)), "PYTHONUNBUFFERED": "1"}
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            timed_out = _watch(proc, out, wall_timeout_s, progress, what)
        finally:  # also on KeyboardInterrupt: nothing outlives the caller
            _stop(proc)
            kill_stragglers(out, config.world_size, module=program.module)
    return proc.returncode, timed_out


def _watch(proc: subprocess.Popen[bytes], out: Path, wall_timeout_s: float, progress: ProgressFn,
           what: str) -> float | None:
    """Poll torchrun until it exits, reporting rank 0's progress; the wall limit (s) if it ran past it."""
    deadline = time.monotonic() + wall_timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return wall_timeout_s
        text = _read(rank_file(out, 0, "progress"))
        if text and len(parts := text.split(" ", 2)) == 3:
            try:
                progress(what, int(parts[0]), int(parts[1]))
            except ValueError:
                pass
        time.sleep(_POLL_S)
    return None


def run_distributed(config: DistributedConfig, *, work_dir: Path | str | None = None,
                    wall_timeout_s: float | None = None, progress: ProgressFn = no_progress) -> DistributedReport:
    """Measure ``config.spec`` at ``config.shape`` on ``config.world_size`` ranks, without and with ``config.plan``.

    Every rank rebuilds the workload itself. ``config.timeout_s`` bounds each collective
    (``init_process_group(timeout=...)``); ``wall_timeout_s`` bounds the whole run. ``work_dir``:
    as :func:`launch_ranks`. Raises :class:`DistributedError` naming the rank when one dies, fails or times out.
    """
    return launch_ranks(config, DISTRIBUTED_PROGRAM, what=f"{config.engine.value} x{config.world_size}",
                  work_dir=work_dir, wall_timeout_s=wall_timeout_s, progress=progress)
