"""The rank program: ``python -m remat.distributed.worker --config run.json --out DIR``, one per rank.

It is started by torchrun (``torch.distributed.run``), locally by :mod:`remat.distributed.launch`
or by hand on several nodes (NOTE [launcher]), and reads the standard torchrun environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``PORT``).
Each rank rebuilds the workload from the config, runs the control and the plan, and rank 0
gathers every rank's :class:`RankResult` and writes ``DIR/distributed.json``.

NOTE [rank files]
Besides the report, every rank leaves files in DIR that let the launcher tell what happened
to it without trusting any one process to say so:

  rank-R.pid        {"pid", "host"}: written first; the launcher kills stragglers by this PID
  rank-R.progress   "done total what": the last step finished
  rank-R.error.json the exception a rank caught (type, message, tip, traceback tail)
  rank-R.sigterm    non-empty when the launcher stopped the rank (faulthandler writes the stack
                    from the signal handler itself, so even a rank blocked in C++ leaves it)
  rank-R.done       the rank reached the end (report gathered, barrier passed)

A started rank with none of error/sigterm/done died on its own (crash, os._exit, OOM kill).

NOTE [rank errors]
The error file says what kind of failure it was, with the same rule as one process (NOTE
[exit codes] in remat.cli.main): ``user`` (the workload's own code raised: its traceback),
``input`` (a typed RematError) or ``internal`` (anything else: a remat bug), and when it
happened (``time``). When one rank fails, its peers usually fail a moment later inside a
collective (gloo: "Connection closed by peer"); the launcher leads with the earliest error
that is not such a follow-on (launch.diagnose), and exits as that rank's kind says.

NOTE [teardown]
Success: ``barrier()``, ``destroy_process_group()``, ``os._exit(code)``, where ``code`` is the
verdict every rank reads from the same report (0: the plan is the control's step and fits the
per-device budget on every rank; 1: it is not, or it does not), so that on several nodes each
torchrun exits non-zero on a failed check as ``remat distributed`` does locally. Failure: the
error file, then ``os._exit`` at once with the error's exit code (NOTE [exit codes] in
remat.cli.main: 2 for a typed error, 3 for a remat bug), no barrier, no destroy: both can block
on a dead peer. Exiting through ``os._exit`` skips interpreter shutdown, where a gloo thread
join once hung holding the GIL. The launcher waits with a timeout in any case and kills
stragglers by PID.

NOTE [rank report]
Rank 0 gathers every rank's :class:`RankResult`, assembles the report and broadcasts its JSON
back, so every rank decides the same verdict from the same figures and every node's local
rank 0 writes ``DIR/distributed.json``: on several nodes each node has the report and the
table, not only rank 0's.

NOTE [rank wall clock]
On several nodes no remat launcher watches the ranks (each node's torchrun is started by
hand), so ``DistributedConfig.wall_timeout_s`` arms a timer in every rank: past it the rank
records a DistributedError naming what it was doing, with its main thread's stack, and exits
2, the code the local launcher's wall-clock limit gives. torchrun then stops the rank's peers.
Locally the launcher's own limit applies (the config leaves it None).

NOTE [collective timeouts]
A collective that waits longer than ``timeout_s`` for a peer raises a bare RuntimeError from
gloo ("Timed out waiting 20000ms for recv operation") or NCCL, often inside the backward that
remat runs as the user's code. The rank turns it into a DistributedError naming itself, the
collective (the last one the engine's hooks saw start, or remat's own gather/broadcast/barrier)
and the limit, never "your code failed": a peer stalled or died, or the limit is too short.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from .._io import atomic_write_json
from ..errors import DistributedError, RematError, UserCodeError
from ..measure import StepClock, time_steps
from ..memory.measure import measure_step_peak, track_step_state
from ..plan.model import Plan
from ..types import MemorySource, Phase
from ..workload.contract import TrainingStep
from ..verify.compare import diff_tensor
from ..verify.model import TOLERANCES
from ..workload.loader import load_workload
from .config import REENTRANT_FIND_UNUSED_TIP, DistributedConfig, Engine
from .engines import EngineContext, make_context, unwrap, wrap
from .instrument import CollectiveEvent, CommRecorder, ComputeTimer, ShardAwareTracker
from .intervals import exposed_ns, total_ns
from .report import (CollectiveCount, DistributedReport, GradComparison, RankResult, RankSide,
                     assemble)

REPORT_NAME = "distributed.json"
# Test-only fault injection (read from the environment, which torchrun passes on to every rank):
FAULT_ENV = "REMAT_DISTRIBUTED_TEST_FAULT"   # "exit|hang|raise:RANK:STEP" (after STEP steps)


def rank_file(out: Path, rank: int, kind: str) -> Path:
    return out / f"rank-{rank}.{kind}"


class RankFiles:
    """NOTE [rank files]: this rank's side of them."""

    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        self.what = "starting"
        self._sigterm_file: Any = None

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for kind in ("error.json", "sigterm", "done", "progress"):
            rank_file(self.out, self.rank, kind).unlink(missing_ok=True)
        self._sigterm_file = open(rank_file(self.out, self.rank, "sigterm"), "w")  # noqa: SIM115 (lives until exit)
        faulthandler.register(signal.SIGTERM, file=self._sigterm_file, all_threads=True, chain=True)
        atomic_write_json(rank_file(self.out, self.rank, "pid"), {"pid": os.getpid(), "host": socket.gethostname()})

    def progress(self, done: int, total: int, what: str) -> None:
        self.what = what
        path = rank_file(self.out, self.rank, "progress")
        tmp = path.with_suffix(".progress.tmp")
        tmp.write_text(f"{done} {total} {what}\n")
        os.replace(tmp, path)

    def error(self, exc: BaseException) -> None:
        """NOTE [rank errors]: what the launcher needs to lead with the real cause and pick the exit code."""
        if isinstance(exc, UserCodeError):
            kind, tb = "user", exc.traceback_text or ""
        elif isinstance(exc, RematError):
            kind, tb = "input", "".join(traceback.format_exception(exc))
        else:
            kind, tb = "internal", "".join(traceback.format_exception(exc))
        atomic_write_json(rank_file(self.out, self.rank, "error.json"), {
            "rank": self.rank, "type": type(exc).__name__,
            "message": (exc.message if isinstance(exc, RematError) else str(exc))[:4000],
            "tip": exc.tip if isinstance(exc, RematError) else None,
            "what": self.what, "kind": kind, "time": time.time(),
            "traceback": tb[-4000:],
        })

    def done(self) -> None:
        rank_file(self.out, self.rank, "done").write_text("ok\n")


def _maybe_fault(rank: int, steps_done: int) -> None:
    """Test-only: make this rank exit or hang after ``steps_done`` steps (FAULT_ENV)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, r, s = spec.split(":")
    if int(r) == rank and int(s) == steps_done:
        if kind == "exit":
            os._exit(1)
        if kind == "raise":     # an untyped error in remat's own rank code: a stand-in for a remat bug
            raise RuntimeError(f"injected remat fault on rank {rank} after {steps_done} steps")
        while kind == "hang":
            time.sleep(1.0)


def _apply_plan(model: torch.nn.Module, plan: Plan) -> Any:
    """``remat.wrap.apply``: non-reentrant checkpointing of exactly the planned modules; returns its handle."""
    from ..wrap import apply
    return apply(model, plan)


def _leading_dim(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (tuple, list)):
        for b in batch:
            n = _leading_dim(b)
            if n:
                return n
    if isinstance(batch, dict):
        for b in batch.values():
            n = _leading_dim(b)
            if n:
                return n
    return 0


def equivalence_criterion(device: str, dtype: str) -> str:
    """Bitwise on CPU float32 (same engine config, NOTE [distributed equivalence]), else verify's rule.

    NOTE [distributed equivalence]
    One equivalence rule in remat: a gradient matches when ``max |plan - control| <= atol +
    rtol * max |control|`` with the per-dtype tolerances of remat.verify (NOTE [tolerances]
    there: a per-tensor max-norm bound, not element-wise ``allclose``, which flags
    near-zero entries of a gradient whose scale is set by its large ones). Where the same
    engine configuration is known to be bitwise repeatable (CPU float32, docs/TORCH-NOTES.md),
    bitwise equality is required instead.
    """
    if device.startswith("cpu") and dtype == "float32":
        return "bitwise"
    tol = TOLERANCES.get(dtype, TOLERANCES["float32"])
    return f"per-tensor max-norm (rtol={tol.rtol:g}, atol={tol.atol:g}; remat verify's {dtype} tolerance)"


class GradSnapshot:
    """A phase marker that copies the gradients once, after the first backward (before the optimizer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.grads: list[tuple[str, torch.Tensor | None]] | None = None

    def __call__(self, phase: Phase) -> None:
        if phase is not Phase.OPTIMIZER or self.grads is not None:
            return
        out: list[tuple[str, torch.Tensor | None]] = []
        for name, p in unwrap(self.model).named_parameters():
            g = p.grad
            if g is not None:
                g = getattr(g, "_local_tensor", g).detach().clone()  # FSDP2: this rank's shard
            out.append((name, g))
        self.grads = out


def compare_grads(control: list[tuple[str, torch.Tensor | None]],
                  plan: list[tuple[str, torch.Tensor | None]]) -> GradComparison:
    """By position (wrappers may rename modules; the parameter order is the model's), with
    remat.verify's per-tensor rule (NOTE [distributed equivalence])."""
    mismatched: list[str] = []
    if len(control) != len(plan):
        mismatched.append(f"parameter count {len(control)} (control) vs {len(plan)} (plan)")
    bitwise, within, worst, worst_name = True, True, 0.0, None
    for (name, a), (_, b) in zip(control, plan):
        if a is None or b is None:
            if (a is None) != (b is None):
                mismatched.append(f"{name}: gradient missing on the {'control' if a is None else 'plan'} side")
            continue
        if a.shape != b.shape:
            mismatched.append(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        d = diff_tensor(name, a, b)
        if not d.bitwise:
            bitwise = False
            if d.max_abs > worst or worst_name is None:
                worst, worst_name = d.max_abs, name
            within = within and d.ok
    return GradComparison(params_compared=min(len(control), len(plan)), bitwise_equal=bitwise,
                          within_tolerance=within, max_abs_diff=worst, worst_param=worst_name, mismatched=mismatched)


@dataclasses.dataclass
class _Built:
    step: TrainingStep
    recorder: CommRecorder | None
    handle: Any


class RankRunner:
    """Everything one rank measures, for the control and then for the plan."""

    def __init__(self, config: DistributedConfig, ctx: EngineContext, files: RankFiles) -> None:
        self.cfg = config
        self.ctx = ctx
        self.files = files
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.cuda = ctx.device.type == "cuda"
        self.clock = StepClock(ctx.device)   # NOTE [device-correct timing]
        self.recorder: CommRecorder | None = None
        self.finished = False   # every step ran (what follows is remat's own gather/broadcast/barrier)
        self.done = 0
        per_side = config.warmup + config.steps + 1 + config.comm_steps
        per_side += (config.warmup + config.steps) if config.ablation else 0
        self.total = per_side * (2 if config.plan is not None else 1)

    # -- building -------------------------------------------------------------------------------
    def build(self, plan: Plan | None, *, timed: bool) -> _Built:
        loaded = load_workload(self.cfg.spec, self.cfg.shape, device=str(self.ctx.device), dtype=self.cfg.dtype)
        model = loaded.workload.model
        handle = _apply_plan(model, plan) if plan is not None else None  # the plan first, then the engine
        recorder = CommRecorder() if timed else None
        wrapped = wrap(model, self.ctx, recorder)
        step = TrainingStep(dataclasses.replace(loaded.workload, model=wrapped))
        if recorder is not None:
            self.recorder = recorder   # NOTE [collective timeouts]: the last collective started is named
        return _Built(step, recorder, handle)

    def last_collective(self) -> str | None:
        """The collective the engine's hooks saw start last, e.g. ``all_reduce of 1.2 MiB (step 3)``."""
        last = self.recorder.last if self.recorder is not None else None
        if last is None:
            return None
        return f"{last.op} of {last.nbytes} bytes"

    def data_step(self, i: int) -> int:
        """Rank r's i-th step reads the workload's batch(i * world_size + r): disjoint data per rank."""
        return i * self.world_size + self.rank

    def seed(self) -> None:
        torch.manual_seed(self.cfg.seed + 1000 * self.rank)  # dropout: same masks for control and plan

    def run_step(self, built: _Built, i: int, what: str, marker: Callable[[Phase], None] | None = None) -> float:
        loss = built.step.run(self.data_step(i), marker) if marker else built.step.run(self.data_step(i))
        self.done += 1
        self.files.progress(self.done, self.total, what)
        _maybe_fault(self.rank, self.done)
        return loss

    def peak(self, built: _Built, i: int) -> tuple[int, str | None, MemorySource]:
        if self.cuda:
            m = measure_step_peak(built.step, self.data_step(i))
            return m.peak_bytes, None, m.source
        with ShardAwareTracker(keep_timeline=False) as tracker:
            track_step_state(tracker, built.step)
            built.step.run(self.data_step(i), marker=tracker.mark)
        phase = tracker.peak_phase
        return tracker.peak_bytes, None if phase is None else phase.value, MemorySource.CPU_LIVE_TENSORS

    # -- one side ----------------------------------------------------------------------------------
    def side(self, label: str, plan: Plan | None) -> tuple[RankSide, GradSnapshot, MemorySource, int]:
        cfg = self.cfg
        built = self.build(plan, timed=True)
        rec = built.recorder
        assert rec is not None
        snapshot = GradSnapshot(built.step.workload.model)
        samples = _leading_dim(built.step.workload.batch(self.data_step(0)))
        self.seed()
        i = 0
        loss0 = float("nan")
        for w in range(cfg.warmup):
            loss = self.run_step(built, i, f"{label}: warm-up", snapshot if w == 0 else None)
            loss0 = loss if w == 0 else loss0
            i += 1

        def timed(k: int) -> None:
            rec.step = k - i
            self.run_step(built, k, f"{label}: timed steps")
        step_ms = time_steps(built.step, range(i, i + cfg.steps), clock=self.clock, run=timed)
        i += cfg.steps
        rec.step = -1
        per_step = [_count(rec.of_step(k)) for k in range(cfg.steps)]
        peak_bytes, peak_phase, memory_source = self.peak(built, i)
        self.done += 1
        self.files.progress(self.done, self.total, f"{label}: peak step")
        i += 1
        exposed: list[float] | None = None if self.cuda else []
        comm: list[float] | None = None if self.cuda else []
        for j in range(cfg.comm_steps):
            rec.step = cfg.steps + j
            timer = ComputeTimer()
            with timer:
                self.run_step(built, i, f"{label}: overlap steps")
            i += 1
            events = rec.of_step(cfg.steps + j)
            intervals = [(e.start_ns, e.end_ns) for e in events]
            if exposed is not None and comm is not None:
                exposed.append(exposed_ns(intervals, timer.intervals) / 1e6)
                comm.append(total_ns(intervals) / 1e6)
        self._release(built)
        ablation = self.ablation(label, plan) if cfg.ablation else None
        side = RankSide(step_ms=step_ms, peak_bytes=peak_bytes, peak_phase=peak_phase, exposed_comm_ms=exposed,
                        comm_ms=comm, collectives=per_step[0],
                        collectives_stable=all(c == per_step[0] for c in per_step), ablation_step_ms=ablation,
                        loss0=loss0)
        return side, snapshot, memory_source, samples

    def ablation(self, label: str, plan: Plan | None) -> list[float]:
        built = self.build(plan, timed=False)
        self.seed()
        for i in range(self.cfg.warmup):
            self.run_step(built, i, f"{label}: ablation warm-up")
        out = time_steps(built.step, range(self.cfg.warmup, self.cfg.warmup + self.cfg.steps), clock=self.clock,
                         run=lambda k: self.run_step(built, k, f"{label}: ablation (no-op comm)"))
        self._release(built)
        return out

    def _release(self, built: _Built) -> None:
        if built.handle is not None and hasattr(built.handle, "remove"):
            built.handle.remove()
        built.step = None  # type: ignore[assignment]
        gc.collect()

    def run(self) -> RankResult:
        control, snap_c, source, samples = self.side("control", None)
        plan_side, grads = None, None
        if self.cfg.plan is not None:
            plan_side, snap_p, _, _ = self.side("plan", self.cfg.plan)
            grads = compare_grads(snap_c.grads or [], snap_p.grads or [])
        self.finished = True
        return RankResult(rank=self.rank, host=socket.gethostname(), samples_per_step=samples, memory_source=source,
                          control=control, plan=plan_side, grads=grads)


def _count(events: list[CollectiveEvent]) -> dict[str, CollectiveCount]:
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for e in events:
        counts[e.op] += 1
        nbytes[e.op] += e.nbytes
    return {op: CollectiveCount(count=counts[op], bytes=nbytes[op]) for op in sorted(counts)}


def _notes(cfg: DistributedConfig) -> list[str]:
    notes = ["ablation_step_ms: the same steps with a no-op comm hook (no communication); "
             "only its time is meaningful, the numbers it trains on are not"]
    if cfg.device.startswith("cuda"):
        notes.append("exposed_comm_ms is null on CUDA: comm-hook callbacks do not mark kernel completion; "
                     "it needs the profiler's kernel trace, which is not read yet")
    elif cfg.engine is Engine.FSDP2:
        notes.append("peak bytes count each DTensor by its local shard (NOTE [FSDP2 peaks on CPU])")
    return notes


def _env_int(name: str, *, default: int | None = None) -> int:
    """A torchrun environment variable as an int (``default`` when it is unset and a default is given)."""
    if default is not None and name not in os.environ:
        return default
    try:
        return int(os.environ[name])
    except (KeyError, ValueError) as exc:
        raise DistributedError(f"environment variable {name} is missing or not an integer: this program is meant "
                               "to be started by torchrun (python -m torch.distributed.run)") from exc


class RankWallClock:
    """NOTE [rank wall clock]: past ``limit_s`` seconds, record a DistributedError and exit 2."""

    def __init__(self, limit_s: float | None, files: RankFiles) -> None:
        self.limit_s, self.files = limit_s, files
        self._main = threading.main_thread().ident

    def start(self) -> None:
        if self.limit_s is not None:
            timer = threading.Timer(self.limit_s, self._fire)
            timer.daemon = True
            timer.start()

    def _fire(self) -> None:
        frame = sys._current_frames().get(self._main or -1)
        exc = DistributedError(
            f"rank {self.files.rank}: the distributed run did not finish within {self.limit_s:g} s (the wall-clock "
            f"limit) and was stopped during {self.files.what}",
            tip="raise --dist-wall-timeout, or look at the ranks' files for the one that stalled")
        exc.traceback_text = "".join(traceback.format_stack(frame)) if frame is not None else None
        try:
            self.files.error(exc)
        finally:
            os._exit(exc.exit_code)


# What gloo, NCCL's watchdog and the c10d store say when a wait runs past the process group's timeout.
_TIMEOUT_TEXT = ("timed out waiting", "collective operation timeout", "socket timeout", "wait timeout",
                 "timed out after", "timeout waiting")


def _typed_failure(exc: BaseException, rank: int, cfg: DistributedConfig, files: RankFiles,
                   runner: RankRunner | None) -> DistributedError | None:
    """The DistributedError a torch/gloo failure stands for (NOTE [collective timeouts]), or None to re-raise."""
    text = f"{exc} {exc.__cause__}"
    if "Expected to mark a variable ready only once" in text:
        # DDP raises it in the backward, which remat runs as the user's code (NOTE [user code errors])
        return DistributedError(
            f"rank {rank}: DDP marked a parameter ready twice in one backward ('Expected to mark a variable "
            "ready only once'): reentrant activation checkpointing with find_unused_parameters=True",
            tip=REENTRANT_FIND_UNUSED_TIP)
    if not any(t in text.lower() for t in _TIMEOUT_TEXT):
        return None
    during = files.what
    # during the steps, the engine's hooks know the collective; after them, files.what names remat's own
    collective = runner.last_collective() if runner is not None and not runner.finished else None
    what = f"{collective} (the last collective it started, during {during})" if collective else during
    return DistributedError(
        f"rank {rank}: a collective timed out after {cfg.timeout_s:g} s waiting for a peer: {what}; "
        f"torch said: {str(exc.__cause__ or exc).strip()[:300]}",
        tip="a peer rank stalled or died first (see the other ranks' states); if a step is legitimately slower, "
            "raise --dist-timeout (seconds any one collective may take)")


def _share_report(result: RankResult, cfg: DistributedConfig, out: Path, files: RankFiles) -> DistributedReport:
    """NOTE [rank report]: gather on rank 0, assemble, broadcast the report back; every node writes it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    files.what = "gathering results (gather_object to rank 0)"
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    box: list[Any] = [None]
    if rank == 0:
        assert gathered is not None
        box[0] = assemble(gathered, cfg, torch_version=torch.__version__, notes=_notes(cfg),
                          comm_source=("ddp comm hook (default_hooks.allreduce_hook, end stamped in fut.then)"
                                       if cfg.engine is Engine.DDP else
                                       "fsdp2 custom comm (DefaultAllGather/DefaultReduceScatter, timed)"),
                          criterion=equivalence_criterion(cfg.device, cfg.dtype)).to_json()
    files.what = "sharing the report (broadcast_object_list from rank 0)"
    dist.broadcast_object_list(box, src=0)
    if _env_int("LOCAL_RANK", default=0) == 0:
        atomic_write_json(out / REPORT_NAME, box[0])
    return DistributedReport.from_json(box[0])


def _init(cfg: DistributedConfig, files: RankFiles) -> tuple[int, torch.device]:
    """Check the torchrun environment, set threads and device, join the process group; (rank, device)."""
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size != cfg.world_size:
        raise DistributedError(f"rank {rank}: torchrun started {world_size} ranks but the config asks for "
                               f"{cfg.world_size}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_world))
    if cfg.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    files.what = "init_process_group (rendezvous of every rank)"
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    return rank, device


def run_rank(cfg: DistributedConfig, out: Path, files: RankFiles) -> int:
    """One rank's whole run; the verdict's exit code (NOTE [teardown])."""
    RankWallClock(cfg.wall_timeout_s, files).start()
    rank, runner = _env_int("RANK"), None
    try:
        rank, device = _init(cfg, files)
        files.what = "building the engine"
        runner = RankRunner(cfg, make_context(cfg, device), files)
        report = _share_report(runner.run(), cfg, out, files)
        files.what = "teardown (barrier)"
        dist.barrier()
    except (RuntimeError, UserCodeError) as exc:
        typed = _typed_failure(exc, rank, cfg, files, runner)
        if typed is None:
            raise
        raise typed from exc
    dist.destroy_process_group()
    return 0 if report.passed else 1


def main(argv: list[str] | None = None, *, prog: str = "python -m remat.distributed.worker",
         run: Callable[[DistributedConfig, Path, RankFiles], int] = run_rank) -> NoReturn:
    """One rank's process of any engine, started by torchrun: parse, run, report any failure to the rank files,
    exit with the run's verdict or the failure's exit code (NOTE [teardown]). ``prog``/``run``: another rank
    program of DDP and FSDP2 on the same config (remat.cli.distributed_rank); the pipeline engine runs
    ``distributed/pipeline/worker.py``'s."""
    parser = argparse.ArgumentParser(prog=prog, description="one rank of a remat distributed run (start it with torchrun)")
    parser.add_argument("--config", required=True, type=Path,
                        help="distributed config JSON (DistributedConfig; remat distributed --emit-config writes one)")
    parser.add_argument("--out", required=True, type=Path, help="folder for the report and the rank files")
    args = parser.parse_args(argv)
    files = RankFiles(args.out, int(os.environ.get("RANK", "0")))
    code = 0
    try:
        files.start()
        cfg = DistributedConfig.load(args.config)
        if cfg.engine is Engine.PIPELINE:
            from .pipeline.worker import run_pipeline_rank
            run = run_pipeline_rank
        code = run(cfg, args.out, files) or 0
        files.done()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the error file
        try:
            files.error(exc)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        code = exc.exit_code if isinstance(exc, RematError) else 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NOTE [teardown]


if __name__ == "__main__":
    main()
