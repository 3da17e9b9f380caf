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

Locally (what :func:`run_config` runs; the port is a free loopback port picked per run)::

    python -m torch.distributed.run --nnodes 1 --nproc-per-node N --master-addr 127.0.0.1 \
        --master-port PORT --max-restarts 0 --monitor-interval 0.1 --shutdown-timeout 5 \
        -m remat.distributed.worker --config DIR/config.json --out DIR

Several nodes: write the config once (``DistributedConfig(...).save("run.json")``, or
``remat distributed ... --emit-config run.json``) with ``world_size`` = nodes x ranks per
node, put it on every node, and start the same rank program with torchrun's usual arguments
on each node::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        --rdzv-id JOB --max-restarts 0 -m remat.distributed.worker --config run.json --out DIR

Rank 0's node then has ``DIR/distributed.json`` (read it with ``DistributedReport.from_json``);
every node has its ranks' files (NOTE [rank files]). ``torch.set_num_threads`` divides the
node's cores by ``LOCAL_WORLD_SIZE`` (= world size on one node).
"""

from __future__ import annotations

import dataclasses
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
from typing import Any, Mapping

from .._json import Enum, Int, Num, Obj, Opt, Str, read_json_file, validate
from ..errors import DistributedError
from ..plan.model import Plan
from ..types import ProgressFn, no_progress
from .config import DistributedConfig, Engine
from .report import DistributedReport
from .worker import REPORT_NAME, rank_file

WORKER_MODULE = "remat.distributed.worker"
DEFAULT_WALL_TIMEOUT_S = 3600.0
_POLL_S = 0.1
_GRACE_S = 5.0  # after SIGTERM: how long torchrun and the ranks get before SIGKILL


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


# -- the ranks' state, from their files --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RankState:
    rank: int
    kind: str            # "done", "error", "stopped", "died", "not started"
    detail: str
    tip: str | None = None
    error_kind: str | None = None     # for "error": "user", "input" or "internal" (NOTE [rank errors])
    time: float | None = None         # for "error": when the rank recorded it (time.time())
    traceback: str | None = None

    @property
    def follow_on(self) -> bool:
        """An error a rank hits because a *peer* failed (a collective lost its peer, or timed out waiting)."""
        text = self.detail.lower()
        return self.kind == "error" and any(p in text for p in _FOLLOW_ON)


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
        return RankState(rank, "done", "finished")
    path = rank_file(out, rank, "error.json")
    if path.exists():
        try:
            e = read_json_file(path, error=DistributedError, what="rank error file", max_bytes=1 << 20)
            validate(e, _ERROR_FILE, error=DistributedError, what="rank error file")
        except DistributedError:
            return RankState(rank, "error", "raised an error (unreadable error file)")
        return RankState(rank, "error", f"raised {e['type']}: {e['message']} (during {e['what']})", e.get("tip"),
                         error_kind=e.get("kind", "internal"), time=e.get("time"), traceback=e.get("traceback"))
    if _read(rank_file(out, rank, "sigterm")):
        return RankState(rank, "stopped", f"was stopped by the launcher {_progress_text(out, rank)}")
    if rank_file(out, rank, "pid").exists():
        return RankState(rank, "died", f"died {_progress_text(out, rank)} without reporting an error "
                                       "(crashed, was killed, or exited)")
    return RankState(rank, "not started", "never started")


def lead_culprits(states: list[RankState]) -> list[RankState]:
    """The failed ranks, the real cause first (NOTE [rank errors]): errors that are not follow-ons
    (earliest first), then ranks that died without a word, then follow-on errors (earliest first)."""
    def when(s: RankState) -> float:
        return s.time if s.time is not None else float("inf")
    causes = sorted((s for s in states if s.kind == "error" and not s.follow_on), key=when)
    died = [s for s in states if s.kind == "died"]
    follow = sorted((s for s in states if s.kind == "error" and s.follow_on), key=when)
    return causes + died + follow


def _log_tail(log: Path, lines: int = 15) -> str:
    text = _read(log) or ""
    return "\n".join(text.strip().splitlines()[-lines:])


def diagnose(out: Path, world_size: int, *, returncode: int | None, timed_out: float | None, log: Path) -> DistributedError:
    """One typed error naming the rank(s) at fault, with every rank's state."""
    states = [rank_state(out, r) for r in range(world_size)]
    others = "; ".join(f"rank {s.rank} {s.detail}" for s in states)
    tip = f"every rank's files and torchrun's output are in {out} ({log.name})"
    stacks = [s.rank for s in states if s.kind == "stopped"]
    if stacks:
        tip += "; where the stopped ranks were: " + ", ".join(rank_file(out, r, "sigterm").name for r in stacks)
    if timed_out is not None:
        stuck = [s for s in states if s.kind != "done"]
        return DistributedError(
            f"the distributed run did not finish within {timed_out:g} s and was stopped; "
            + "; ".join(f"rank {s.rank} {s.detail}" for s in (stuck or states)), tip=tip)
    culprits = lead_culprits(states)
    if culprits:
        first = culprits[0]
        head = f"rank {first.rank} {first.detail}"
        rest = "; ".join(f"rank {s.rank} {s.detail}" for s in states if s is not first)
        return DistributedError(head + (f" (then: {rest})" if rest else ""), tip=first.tip or tip,
                                traceback_text=first.traceback if first.error_kind in ("user", "internal") else None,
                                internal=first.error_kind == "internal")
    if all(s.kind == "not started" for s in states):
        return DistributedError(f"torchrun exited with code {returncode} before any rank started:\n{_log_tail(log)}",
                                tip=tip)
    if all(s.kind == "done" for s in states):
        return DistributedError(f"every rank finished but rank 0 wrote no {REPORT_NAME} (torchrun exit code "
                                f"{returncode})", tip=tip)
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


def _launch_once(config: DistributedConfig, out: Path, wall_timeout_s: float,
                 progress: ProgressFn, *, module: str = WORKER_MODULE, what: str | None = None,
                 report_name: str = REPORT_NAME) -> tuple[int | None, float | None]:
    """Run torchrun once; (its exit code, the wall limit if it was hit). ``module`` is the rank program
    (the pipeline engine has its own, remat.pipeline_parallel.worker, with the same rank files)."""
    _clean(out, config.world_size, report_name)
    cmd = torchrun_command(out / "config.json", out, config.world_size, free_port(), module)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // config.world_size)), "PYTHONUNBUFFERED": "1"}
    what = what or f"{config.engine.value} x{config.world_size}"
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        deadline = time.monotonic() + wall_timeout_s
        timed_out: float | None = None
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = wall_timeout_s
                    break
                text = _read(rank_file(out, 0, "progress"))
                if text and len(parts := text.split(" ", 2)) == 3:
                    try:
                        progress(what, int(parts[0]), int(parts[1]))
                    except ValueError:
                        pass
                time.sleep(_POLL_S)
        finally:  # also on KeyboardInterrupt: nothing outlives the caller
            _stop(proc)
            kill_stragglers(out, config.world_size, module=module)
    return proc.returncode, timed_out


def run_config(config: DistributedConfig, *, work_dir: Path | str | None = None,
               wall_timeout_s: float | None = None, progress: ProgressFn = no_progress) -> DistributedReport:
    """Run ``config`` on ``config.world_size`` local ranks; the report, or a :class:`DistributedError`.

    ``work_dir`` receives ``config.json``, ``distributed.json``, torchrun's log and the rank
    files (a temporary folder when None: removed after a success, kept after a failure and
    named in the error's tip).
    """
    if config.device.startswith("cuda"):
        import torch
        if torch.cuda.device_count() < config.world_size:
            raise DistributedError(f"world size {config.world_size} on CUDA needs {config.world_size} GPUs on this "
                                   f"host, found {torch.cuda.device_count()}",
                                   tip="NCCL needs one GPU per rank; for more ranks than GPUs use --device cpu (gloo)")
    temporary = work_dir is None
    out = Path(tempfile.mkdtemp(prefix="remat-distributed-")) if work_dir is None else Path(work_dir)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.json")
    limit = DEFAULT_WALL_TIMEOUT_S if wall_timeout_s is None else float(wall_timeout_s)
    for attempt in range(2):
        returncode, timed_out = _launch_once(config, out, limit, progress)
        report_path = out / REPORT_NAME
        if returncode == 0 and timed_out is None and report_path.is_file():
            report = DistributedReport.from_json(read_json_file(report_path, error=DistributedError,
                                                                what="distributed report"))
            if temporary:
                shutil.rmtree(out, ignore_errors=True)
            return report
        log_text = (_read(out / "torchrun.log") or "").lower()
        port_taken = "address already in use" in log_text or "eaddrinuse" in log_text
        if attempt == 0 and timed_out is None and port_taken and rank_state(out, 0).kind in ("not started", "error"):
            continue  # the free port was taken between picking and binding it: once more, on another
        raise diagnose(out, config.world_size, returncode=returncode, timed_out=timed_out, log=out / "torchrun.log")
    raise AssertionError("unreachable")


def run_distributed(spec: str, shape: Mapping[str, Any] | None = None, plan: Plan | None = None, *,
                    world_size: int, engine: Engine | str = Engine.DDP, steps: int = 10, warmup: int = 2,
                    comm_steps: int = 3, timeout_s: float = 120.0, device: str = "cpu", dtype: str = "float32",
                    seed: int = 0, ablation: bool = True, find_unused_parameters: bool = False,
                    use_reentrant: bool = False, work_dir: Path | str | None = None,
                    wall_timeout_s: float | None = None, progress: ProgressFn = no_progress) -> DistributedReport:
    """Measure the workload ``spec`` at ``shape`` on ``world_size`` ranks, without and with ``plan``.

    Every rank rebuilds the workload itself. ``timeout_s`` bounds each collective
    (``init_process_group(timeout=...)``); ``wall_timeout_s`` bounds the whole run. Raises
    :class:`DistributedError` naming the rank when one dies, fails or times out.
    """
    config = DistributedConfig(spec=spec, shape=dict(shape or {}), world_size=world_size, engine=Engine(engine),
                               plan=plan, device=device, dtype=dtype, steps=steps, warmup=warmup,
                               comm_steps=comm_steps, timeout_s=timeout_s, seed=seed, ablation=ablation,
                               find_unused_parameters=find_unused_parameters, use_reentrant=use_reentrant)
    return run_config(config, work_dir=work_dir, wall_timeout_s=wall_timeout_s, progress=progress)
