"""Running the part of a command that calls the user's workload in a child process, and watching it from outside.

NOTE [workload in a child process]
``remat check`` is a CI gate: its exit code is the verdict. Run in-process, the user's code
could fake it or outlive it: a factory calling ``os._exit(0)`` ends the command with exit 0 and
no result; a ``batch()`` catching ``Exception`` in a retry loop swallows the alarm's
CheckTimeout and runs on; a factory ignoring SIGALRM never gets it. So the command's process
never runs the user's code. It decides everything
that needs none (the receipt read, the reports compared, the receipt against itself, the gate's
thresholds: ``start_check``), then starts a child::

    python -c "<set sys.path to the parent's; import this module; child_main(...)>" ENTRY FD REQUEST

in a new process group (``process_group=0``: set before ``exec``, so there is no moment when it
is not), stdin from /dev/null, stdout and stderr the parent's (the user's prints show as
before). ``ENTRY`` is a ``remat.*`` function (:data:`ENTRY_PREFIX`; the parent names it, never a
receipt); ``REQUEST`` its JSON arguments, written by the parent. The child writes JSON lines
to the pipe ``FD`` (:class:`MessageKind`): progress, the end of its first training step, and
last either its result or a typed error (:class:`ChildError`: a RematError by its class name,
out of memory, or a remat bug with its traceback). The parent reads them through the hardened
loader and the message's schema (NOTE [hostile JSON]): a line over :data:`MAX_MESSAGE_BYTES`
or off the schema ends the child and fails, exit 2.

The verdict needs both a result message and a clean exit (status 0). Anything else is a
:class:`~remat.errors.WorkloadProcessDied` (exit 2) naming the phase the child was in (the last
progress it reported) and how it ended: the exit status, or the signal (``SIGSEGV``, ``SIGKILL``
from the kernel's out-of-memory killer). A result followed by a crash at exit fails too.

The time limit is the parent's: it waits on the pipe with ``select`` and a deadline, so the
child cannot delay it. Past ``--timeout`` (or on Ctrl-C / SIGTERM of the parent) it stops the
child's whole tree (:func:`stop_tree`): SIGTERM to the child's process group, :data:`TERM_GRACE_S`
for it to clean up (the child raises ``Terminated`` for SIGTERM, so the distributed launcher's
``finally`` stops torchrun), then every process descended from the child, found by parent PID in
``/proc`` (torchrun and its ranks run in sessions of their own, out of reach of the group), is
frozen with SIGSTOP (a stopped process cannot start another; the scan repeats until it finds no
new one) and killed with SIGKILL, each only while ``/proc`` shows the same start time (a PID
reused meanwhile is left alone). The parent then raises CheckTimeout (exit 4) naming the phase,
at most :data:`TERM_GRACE_S` and a scan after the limit. Without ``/proc`` (not Linux) only the
child's process group is killed. After a normal exit, what is left of the child's process group
is killed too: nothing the workload started outlives the command.

What this does not claim: the child runs the user's code, which can write any message to the
pipe it inherited. The boundary makes death, early exit and hangs into failures, not a hostile
workload into an honest one (that code runs in CI with the check's permissions anyway).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from .._codec import JsonCodec, Short, json_field
from .._json import Enum, Int, JsonValue, Obj, Opt, Str, parse_json, validate
from ..errors import CheckTimeout, ChildBug, RematError, Terminated, WorkloadProcessDied
from ..types import ProgressFn, no_progress

ENTRY_PREFIX = "remat."       # a child runs only remat's own functions (a "module:function" under remat)
MAX_MESSAGE_BYTES = 16 * 2 ** 20   # one message line (bytes): a result is a few KiB
POLL_S = 0.1                  # how often the parent looks at the child between messages (s)
TERM_GRACE_S = 1.0            # after SIGTERM, how long the child gets before its tree is killed (s)
_MAX_TEXT = 200_000           # an error message or traceback (characters)
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from remat.workflow.child import child_main; sys.exit(child_main(sys.argv[2:]))")

__all__ = ["ChildError", "ChildReporter", "ErrorKind", "MessageKind", "run_in_child", "stop_tree"]


class MessageKind(str, enum.Enum):
    """One line the child writes to its pipe."""

    PROGRESS = "progress"       # what, done, total: the phase it is in
    PHASE = "phase"             # what: a phase with no count ("building the workload")
    FIRST_STEP = "first-step"   # its first training step ended
    RESULT = "result"           # the entry's JSON result: the last message
    ERROR = "error"             # a ChildError: the last message


class ErrorKind(str, enum.Enum):
    REMAT = "remat"                   # a RematError, by its class name in remat.errors
    OUT_OF_MEMORY = "out-of-memory"   # the step does not fit (the CLI's exit 2 for it)
    BUG = "bug"                       # anything else: a remat bug (exit 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChildError(JsonCodec):
    """An exception the child's entry raised, as data: the parent raises it again (:meth:`exception`)."""

    kind: ErrorKind
    name: Short                      # its class name
    message: str = json_field(default="")
    tip: str | None = None
    traceback_text: str | None = None
    exit_code: int = 2

    @classmethod
    def of(cls, exc: BaseException) -> "ChildError":
        from ..workload.contract import is_allocation_failure
        if isinstance(exc, RematError):
            return cls(kind=ErrorKind.REMAT, name=type(exc).__name__, message=exc.message, tip=exc.tip,
                       traceback_text=exc.traceback_text, exit_code=exc.exit_code)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        if is_allocation_failure(exc):
            return cls(kind=ErrorKind.OUT_OF_MEMORY, name=type(exc).__name__, message=first)
        return cls(kind=ErrorKind.BUG, name=type(exc).__name__, message=str(exc)[:_MAX_TEXT],
                   traceback_text="".join(traceback.format_exception(exc))[-_MAX_TEXT:], exit_code=3)

    def exception(self) -> RematError:
        if self.kind is ErrorKind.OUT_OF_MEMORY:
            return RematError(f"out of memory: {self.name}: {self.message}",
                              tip="use a smaller shape (--shape), or a larger machine")
        if self.kind is ErrorKind.BUG:
            return ChildBug(f"internal error in the workload's process: {self.name}: {self.message}\nThis is a "
                            "remat bug: please report it with the command line and the traceback above.",
                            traceback_text=self.traceback_text)
        cls = _REMAT_ERRORS.get(self.name, RematError)
        exc = cls.__new__(cls)
        RematError.__init__(exc, self.message, tip=self.tip)
        exc.traceback_text = self.traceback_text
        exc.exit_code = self.exit_code
        return exc


def _subclasses(cls: type) -> list[type]:
    return [cls] + [s for c in cls.__subclasses__() for s in _subclasses(c)]


_REMAT_ERRORS: dict[str, type[RematError]] = {c.__name__: c for c in _subclasses(RematError)
                                              if c.__module__ == "remat.errors"}

# One message line's schema (NOTE [hostile JSON]): each kind's fields, bounded.
_TEXT = Str(max_len=_MAX_TEXT)
_MESSAGE = Obj({"kind": Enum(*(k.value for k in MessageKind))},
               {"what": Str(max_len=2_000), "done": Int(0, 2 ** 31), "total": Int(0, 2 ** 31),
                "result": JsonValue(),
                "error": Obj({"kind": Enum(*(k.value for k in ErrorKind)), "name": Str(max_len=2_000)},
                             {"message": _TEXT, "tip": Opt(_TEXT), "traceback_text": Opt(_TEXT),
                              "exit_code": Int(1, 4)})})


# -- the child's side --------------------------------------------------------------------------------

class ChildReporter:
    """The child's end of the pipe: one JSON line per message, whole lines only (a lock: the first-step
    watch writes from its own thread)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()

    def send(self, kind: MessageKind, **body: Any) -> None:
        data = (json.dumps({"kind": kind.value, **body}, allow_nan=False) + "\n").encode()
        with self.lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]

    def progress(self, what: str, done: int, total: int) -> None:
        self.send(MessageKind.PROGRESS, what=what, done=int(done), total=int(total))

    def phase(self, what: str) -> None:
        self.send(MessageKind.PHASE, what=what)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def child_main(argv: list[str]) -> int:
    """The child's program (``_BOOT``): ``ENTRY FD REQUEST``; the entry's result or error on FD, then exit 0.
    Anything that ends it otherwise (an exit of the user's code, a signal) leaves no result: the parent's
    to report."""
    entry, fd, request = argv[0], int(argv[1]), json.loads(argv[2])
    signal.signal(signal.SIGTERM, _raise_terminated)   # the parent's stop: the launcher's ``finally`` runs
    reporter = ChildReporter(fd)
    module, _, name = entry.partition(":")
    if not module.startswith(ENTRY_PREFIX):
        raise SystemExit(f"remat child: refusing entry {entry!r}")
    from ..workload.contract import watch_first_step
    first = watch_first_step()
    threading.Thread(target=lambda: first.wait() and reporter.send(MessageKind.FIRST_STEP), daemon=True).start()
    try:
        result = getattr(importlib.import_module(module), name)(request, reporter)
    except KeyboardInterrupt:   # the parent's SIGTERM (its time limit, or its own Ctrl-C): no result, quietly
        return 143
    except Exception as exc:
        reporter.send(MessageKind.ERROR, error=ChildError.of(exc).to_json())
    else:
        reporter.send(MessageKind.RESULT, result=result)
    for stream in (sys.stdout, sys.stderr):   # the user's prints, before the exit the parent waits for
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return 0


# -- the parent's side --------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class _Watch:
    """What the parent knows of the child so far."""

    phase: str = "starting (importing torch and remat)"
    result: Any = None
    has_result: bool = False
    error: ChildError | None = None


def run_in_child(entry: str, request: dict[str, Any], *, command: str, timeout_s: float | None = None,
                 t0: float | None = None, progress: ProgressFn = no_progress,
                 on_first_step: Callable[[], None] = lambda: None) -> Any:
    """Run ``entry(request, reporter)`` (``remat.module:function``) in a child process and return its JSON
    result (NOTE [workload in a child process]). ``timeout_s`` (s) counts from ``t0`` (``time.perf_counter()``;
    default now); past it the child's tree is killed and :class:`CheckTimeout` names ``command`` and the
    phase. Raises the child's typed error again, or :class:`WorkloadProcessDied` when it ended without one."""
    if not entry.startswith(ENTRY_PREFIX):
        raise ValueError(f"not one of remat's functions: {entry!r}")
    start = time.perf_counter() if t0 is None else t0
    deadline = None if timeout_s is None else start + timeout_s
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path), entry, str(write_fd),
                                 json.dumps(request)], stdin=subprocess.DEVNULL, pass_fds=(write_fd,),
                                process_group=0)
    finally:
        os.close(write_fd)
    watch = _Watch()
    try:
        _follow(proc, read_fd, watch, deadline, progress, on_first_step)
    except CheckTimeout:   # ours, or the CLI's alarm (the same limit) arriving first
        stop_tree(proc)
        raise CheckTimeout(f"{command} ran past its --timeout of {timeout_s or 0:g} s, {watch.phase}: stopped (the "
                           "workload's process and everything it started were killed), nothing decided",
                           tip="raise --timeout (or timeout in [tool.remat]); a step that never ends (a batch() "
                               "retrying for ever, a factory waiting on something) shows in the phase above") from None
    finally:
        stop_tree(proc)
        os.close(read_fd)
    return _outcome(proc, watch, command)


class _Pipe:
    """The parent's end of the pipe: whole lines, each taken as one message."""

    def __init__(self, fd: int, watch: _Watch, progress: ProgressFn, on_first_step: Callable[[], None]) -> None:
        self.fd, self.watch, self.progress, self.on_first_step = fd, watch, progress, on_first_step
        self.buf = b""
        self.open = True

    def read(self, wait_s: float) -> bool:
        """Take what arrives within ``wait_s`` (s); whether anything did."""
        if not self.open or not select.select([self.fd], [], [], max(0.0, wait_s))[0]:
            return False
        data = os.read(self.fd, 1 << 16)
        self.open = bool(data)
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            _take(line, self.watch, self.progress, self.on_first_step)
        if len(self.buf) > MAX_MESSAGE_BYTES:
            raise WorkloadProcessDied(f"the workload's process wrote a message over {MAX_MESSAGE_BYTES} bytes to "
                                      f"remat's pipe, {self.watch.phase}: stopped, nothing decided")
        return bool(data)


def _follow(proc: subprocess.Popen[bytes], fd: int, watch: _Watch, deadline: float | None, progress: ProgressFn,
            on_first_step: Callable[[], None]) -> None:
    """Read messages until the child exits, then what it left in the pipe; CheckTimeout past the deadline.
    A process the child started may hold the pipe open after it exits: its exit is what ends the wait."""
    pipe = _Pipe(fd, watch, progress, on_first_step)

    def left() -> float:
        return POLL_S if deadline is None else min(POLL_S, deadline - time.perf_counter())

    while proc.poll() is None:
        if left() <= 0:
            raise CheckTimeout("past the deadline")
        if not pipe.read(left()):
            time.sleep(max(0.0, left()) if not pipe.open else 0.0)
    while pipe.read(0.0):   # what it wrote before it exited
        if left() <= 0:
            raise CheckTimeout("past the deadline")


def _take(line: bytes, watch: _Watch, progress: ProgressFn, on_first_step: Callable[[], None]) -> None:
    """One message: validated (NOTE [hostile JSON]), then acted on; after the result only progress may follow
    (the first-step watch runs on a thread of its own), never a second result."""
    msg = parse_json(line, error=WorkloadProcessDied, source="a message from the workload's process",
                     max_bytes=MAX_MESSAGE_BYTES)
    validate(msg, _MESSAGE, error=WorkloadProcessDied, what="a message from the workload's process")
    kind = MessageKind(msg["kind"])
    ended = watch.has_result or watch.error is not None
    if kind is MessageKind.PROGRESS and not ended:
        watch.phase = f"at {msg.get('what', '?')} {msg.get('done', 0)}/{msg.get('total', 0)}"
        progress(msg.get("what", "?"), msg.get("done", 0), msg.get("total", 0))
    elif kind is MessageKind.PHASE and not ended:
        watch.phase = f"while {msg.get('what', '?')}"
    elif kind is MessageKind.FIRST_STEP:
        on_first_step()
    elif kind in (MessageKind.RESULT, MessageKind.ERROR) and ended:
        raise WorkloadProcessDied("the workload's process reported a second result to remat's pipe: nothing decided")
    elif kind is MessageKind.RESULT:
        watch.result, watch.has_result = msg.get("result"), True
    elif kind is MessageKind.ERROR and "error" in msg:
        watch.error = ChildError.from_json(msg["error"])


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def _outcome(proc: subprocess.Popen[bytes], watch: _Watch, command: str) -> Any:
    """The result, when the child sent one and exited 0; its error raised again; else WorkloadProcessDied."""
    code = proc.returncode
    ended = _how_it_ended(code)
    if code == 0 and watch.has_result:
        return watch.result
    if code == 0 and watch.error is not None:
        raise watch.error.exception()
    if watch.has_result or watch.error is not None:
        raise WorkloadProcessDied(
            f"{command}: the workload's process {ended} after it reported its "
            f"{'result' if watch.has_result else 'error'}: nothing decided",
            tip="something the workload left running (an atexit hook, a thread, native code) ended the process "
                "badly; a check needs it to exit cleanly")
    killed = code < 0
    raise WorkloadProcessDied(
        f"{command}: the workload's process {ended} before it reported a result, {watch.phase}: nothing decided",
        tip=("a crash in native code (SIGSEGV, SIGABRT) or a kill (the kernel's out-of-memory killer sends SIGKILL); "
             "run the workload once with `remat trace` to see it" if killed else
             "the workload ended the process itself (os._exit, or exit in native code, in its factory, batch(), "
             "loss, model or optimizer): a check needs each of them to return"))


# -- stopping a child and everything it started ------------------------------------------------------------

def _stat(pid: int) -> tuple[int, str] | None:
    """(parent PID, start time in clock ticks) of a process, from /proc; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[1]), fields[19]
    except (IndexError, ValueError):
        return None


def _descendants(known: dict[int, str]) -> dict[int, str]:
    """``known`` (PID -> start time) and every live process descended from one of them (by parent PID)."""
    try:
        pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return dict(known)
    children: dict[int, list[tuple[int, str]]] = {}
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append((pid, st[1]))
    out = dict(known)
    todo = [p for p, start in known.items() if (_stat(p) or (0, ""))[1] == start]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in out:
                out[child] = start
                todo.append(child)
    return out


def _signal(pid: int, start: str, sig: int) -> None:
    """Send ``sig`` to ``pid`` while it is still the process that started at ``start``."""
    st = _stat(pid)
    if st is None or st[1] != start:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float = TERM_GRACE_S) -> None:
    """Stop ``proc`` (a process-group leader) and everything it started (NOTE [workload in a child process]).
    The CLI's alarm (the same time limit) is held off until it is done, then raised as usual."""
    blocked = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        _stop_tree(proc, grace_s)
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def _stop_tree(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    root = _stat(proc.pid)
    known = _descendants({proc.pid: root[1]}) if root is not None and proc.poll() is None else {}
    if proc.poll() is None:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    stopped: set[int] = set()
    for _ in range(100):   # freeze, until a scan finds nothing new (a stopped process starts nothing)
        known = _descendants(known)
        new = [p for p in known if p not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, known[pid], signal.SIGSTOP)
            stopped.add(pid)
    for pid, start in known.items():
        _signal(pid, start, signal.SIGKILL)
    _killpg(proc.pid, signal.SIGKILL)   # the rest of its group (and everything, without /proc)
    proc.wait()
