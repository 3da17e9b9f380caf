"""Arguments shared by several subcommands, and loading the workload they name."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..errors import OutputError, WorkloadError
from ..workload import LoadedWorkload, load_workload, parse_shape
from ..workload.contract import watch_first_step


MAX_THREADS = 4096
MAX_SECONDS = 7 * 24 * 3600.0


def bounded_int(lo: int, hi: int):  # noqa: ANN201 - an argparse ``type``
    """An argparse type: an integer in [lo, hi]. A count past ``hi`` is a typo or a hang, never a setting."""
    def parse(text: str) -> int:
        try:
            if not text.isascii():   # int() reads every Unicode digit ("٣" is 3): a count is typed in ASCII
                raise ValueError(text)
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must lie in [{lo}, {hi}], got {text[:40]}")
        return value
    return parse


def bounded_float(lo: float, hi: float):  # noqa: ANN201 - an argparse ``type``
    """An argparse type: a finite number in (lo, hi]."""
    def parse(text: str) -> float:
        try:
            if not text.isascii():   # as bounded_int: float() reads every Unicode digit
                raise ValueError(text)
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
        if not lo < value <= hi:
            raise argparse.ArgumentTypeError(f"must lie in ({lo:g}, {hi:g}], got {text[:40]}")
        return value
    return parse


def add_budget_args(p: argparse.ArgumentParser, *, budget_needs: str, device_memory: str) -> None:
    """``--budget``, ``--device-memory`` and ``--reserve`` as plan, receipt and frontier take them: ``budget_needs``
    says when --budget is required, ``device_memory`` what the capacity does in that command."""
    p.add_argument("--budget", default=None,
                   help="whole-step peak budget: bytes with a unit (1.5GiB, 800MiB) or a share of the "
                        "no-checkpoint peak (60%%); " + budget_needs)
    p.add_argument("--device-memory", default=None,
                   help="the device's capacity (e.g. 2GiB): the budget when --budget is left out" + device_memory)
    p.add_argument("--reserve", default="5%", help="share of the budget kept free (default 5%%)")


def out_folder(text: str) -> Path:
    """An argparse type for ``--out``: the folder as an absolute path, resolved against the directory the
    command started in, before any workload loads. A factory may ``os.chdir`` (a training script that
    moves to its data folder), and a relative ``--out`` would then land beside its data."""
    return Path(text).absolute()


WORKLOAD_DEFAULTS = {"workload": "gpt", "shape": "", "device": "cpu", "dtype": "float32"}


def add_workload_args(p: argparse.ArgumentParser, *, from_plan: bool = False) -> None:
    """``--workload --shape --device --dtype --timeout``. ``from_plan``: each defaults to what the
    ``--plan`` file records (NOTE [plan workload]; :func:`fill_from_plan`), else to WORKLOAD_DEFAULTS."""
    d = dict.fromkeys(WORKLOAD_DEFAULTS) if from_plan else WORKLOAD_DEFAULTS
    recorded = " (default: the one the --plan file records, when it is a built-in)" if from_plan else " (default: gpt)"
    p.add_argument("--workload", default=d["workload"],
                   help="built-in name (gpt, cnn, mlp), path/to/file.py:fn or package.module:fn" + recorded)
    p.add_argument("--shape", default=d["shape"], help="shape keywords for the workload factory, e.g. batch_size=8,seq_len=256"
                   + (" (default: the plan's)" if from_plan else ""))
    p.add_argument("--device", default=d["device"], help="cpu or cuda (default: " + ("the plan's, else " if from_plan else "") + "cpu)")
    p.add_argument("--dtype", default=d["dtype"], choices=["float32", "bfloat16", "float16"])
    add_timeout_arg(p)


def add_autocast_arg(p: argparse.ArgumentParser, *, from_plan: bool = False) -> None:
    """``--autocast bf16|fp16``: the forward phase under torch.autocast (NOTE [autocast steps])."""
    p.add_argument("--autocast", default=None, choices=["bf16", "fp16", "bfloat16", "float16"],
                   help="run the step's forward (model call and loss) under torch.autocast in this dtype, as a "
                        "mixed-precision training loop does; verify then compares at that dtype's tolerance "
                        "(stated in the report)" + (" (default: as the --plan file records)" if from_plan else ""))


def fill_from_plan(args: argparse.Namespace, recorded: Any) -> None:
    """Fill the workload flags not given from ``recorded`` (a PlanWorkload or None; NOTE [plan workload]).
    A recorded spec is used only when it is a built-in; otherwise WorkloadError names it."""
    from ..workload import BUILTINS
    if args.workload is None:
        if recorded is None:
            raise WorkloadError("--workload not given, and the plan file does not record the workload it was made "
                                "for (made by an older remat, or not by `remat plan`)",
                                tip="name it: --workload gpt|cnn|mlp|path/to/file.py:fn, with the --shape it was planned at")
        if recorded.spec not in BUILTINS:
            raise WorkloadError(f"the plan file was made for workload {recorded.spec!r}; remat never imports code a "
                                "plan file names", tip=f"name it yourself: --workload {recorded.spec}")
        args.workload = recorded.spec
    same = recorded is not None and recorded.spec == args.workload
    for name in ("shape", "device", "dtype"):
        if getattr(args, name) is None:
            value = getattr(recorded, name) if same else None
            setattr(args, name, (",".join(f"{k}={v}" for k, v in value.items()) if name == "shape" else value)
                    if value is not None else WORKLOAD_DEFAULTS[name])
    if getattr(args, "autocast", None) is None and same:
        args.autocast = recorded.autocast


def add_timeout_arg(p: argparse.ArgumentParser) -> None:
    """``--timeout SECONDS``: the whole command's time limit; past it, exit 4 (NOTE [exit codes] in remat.cli.main)."""
    p.add_argument("--timeout", dest="command_timeout_s", type=bounded_float(0, MAX_SECONDS), default=None, metavar="SECONDS",
                   help="time limit for the whole command in seconds, a hanging workload included; past it: exit 4")


HEARTBEAT_S = 5.0   # a progress line every this many seconds (s) while a workload builds and runs its first step
_BEATS: list[Callable[[], None]] = []   # stops of heartbeats that outlive load_from_args (stop_heartbeats)


def load_from_args(args: argparse.Namespace) -> LoadedWorkload:
    """Build the workload the arguments name; a factory or a first step slower than HEARTBEAT_S gets
    progress lines on stderr (NOTE [first step watch]) until it returns or the command ends."""
    with heartbeat(f"building workload {args.workload!r}", HEARTBEAT_S):
        loaded = load_workload(args.workload, parse_shape(args.shape), device=args.device, dtype=args.dtype,
                               autocast=getattr(args, "autocast", None))
    beat_until_first_step("running the first step")
    return loaded


def beat_until_first_step(what: str, until: threading.Event | None = None) -> None:
    """Progress lines ``what (N s)...`` until the process's next training step ends (or ``until`` is set: a
    child process's step, NOTE [workload in a child process]), or the command does."""
    _BEATS.append(start_heartbeat(what, HEARTBEAT_S, until=until or watch_first_step()))


def stop_heartbeats() -> None:
    """Stop the heartbeats still running when the command ends (main calls it)."""
    while _BEATS:
        _BEATS.pop()()


def refuse_autocast_with(args: argparse.Namespace, flag: str, why: str) -> None:
    """``--autocast`` where ``flag`` is on and does not run autocast: a typed error, never ignored."""
    if getattr(args, "autocast", None):
        raise WorkloadError(f"--autocast with {flag}: {why}", tip=f"drop --autocast, or {flag}")


@contextlib.contextmanager
def heartbeat(what: str, every_s: float) -> Iterator[None]:
    """While the block runs, print ``what (N s)`` on stderr every ``every_s`` seconds (none for a fast block)."""
    stop = start_heartbeat(what, every_s)
    try:
        yield
    finally:
        stop()


def start_heartbeat(what: str, every_s: float, until: threading.Event | None = None) -> Callable[[], None]:
    """Print ``what (N s)...`` on stderr every ``every_s`` seconds until ``until`` is set or the returned stop is called."""
    from .render import err_console
    done = until or threading.Event()
    stopped = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not (stopped.wait(every_s) or done.is_set()):
            err_console.print(f"{what} ({time.monotonic() - t0:.0f} s)...", highlight=False, markup=False)
    thread = threading.Thread(target=beat, name="remat-heartbeat", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join()
    return stop


def check_out_dir(out: Path, files: Iterable[str] = ()) -> None:
    """Refuse an ``--out`` that cannot take ``files`` (OutputError, exit 2), before minutes of measuring.

    Creates nothing: it finds the folder, or the nearest existing folder above it, and creates
    and removes one temporary file there (permission bits say nothing when running as root, and
    a read-only file system or ``/proc`` refuses writes whatever they say).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is an existing file, not a folder", tip="name a folder (it is created)")
    probe_dir = _nearest_existing(out)
    if not probe_dir.is_dir():
        raise OutputError(f"--out {out} cannot be created: {probe_dir} is a file, not a folder")
    try:
        _probe_write(probe_dir)
    except OSError as exc:
        where = "in it" if probe_dir == out else f"in {probe_dir}, where it would be created"
        raise OutputError(f"--out {out} is not writable: cannot create a file {where} ({exc.strerror or exc})",
                          tip="name a folder you can write to") from None
    for name in files:
        if (out / name).is_dir():
            raise OutputError(f"--out {out}: {out / name} is a folder, and remat writes a file there")


def _nearest_existing(out: Path) -> Path:
    """``out``, or the nearest existing folder above it; OutputError on a dangling symlink on the way."""
    probe_dir = out
    while not probe_dir.exists():
        if probe_dir.is_symlink():
            raise OutputError(f"--out {out}: {probe_dir} is a dangling symlink (to {os.readlink(probe_dir)})",
                              tip="remove the link, or name a folder that exists or can be created")
        if probe_dir.parent == probe_dir:
            break
        probe_dir = probe_dir.parent
    return probe_dir


def _probe_write(folder: Path) -> None:
    """Create, write (one byte, fsynced: a full disk refuses it) and remove a temporary file in ``folder``."""
    fd, tmp = tempfile.mkstemp(prefix=".remat-write-check.", dir=folder)
    try:
        os.write(fd, b"\0")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(tmp)


def add_compile_args(p: argparse.ArgumentParser) -> None:
    """``--compile`` and ``--compile-backend`` (NOTE [compiled arms] in remat/measure/compiled.py)."""
    from ..measure import BACKENDS
    p.add_argument("--compile", action="store_true",
                   help="run compiled: torch.compile of the model (in place), measured warm after compiling; "
                        "compiled peaks come from the CUDA allocator, or on CPU from torch.profiler's allocator events")
    p.add_argument("--compile-backend", default="inductor", choices=BACKENDS,
                   help="torch.compile backend with --compile (default inductor)")


def compile_from_args(args: argparse.Namespace):  # noqa: ANN201 - CompileSpec | None
    from ..measure import CompileSpec
    return CompileSpec(backend=args.compile_backend) if getattr(args, "compile", False) else None


def simulate_compile_from_args(args: argparse.Namespace):  # noqa: ANN201 - CompileSpec | None
    """``--target-device`` and ``--compile`` checked against ``--simulate`` (usage errors before any work),
    and the compile spec the flags give."""
    if args.target_device and not args.simulate:
        raise WorkloadError("--target-device only applies with --simulate", tip="add --simulate")
    compile = compile_from_args(args)
    if compile is not None and args.simulate:
        raise WorkloadError("--compile cannot be simulated: a compiled step's peak is measured, not modelled",
                            tip="drop --simulate, or --compile")
    return compile
