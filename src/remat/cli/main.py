"""``remat`` entry point.

NOTE [exit codes]
  0    success
  1    a check ran and failed (verify, check): RematError subclasses with exit_code = 1
  2    bad input: a typed RematError with a one-line message (and a tip), or an argparse usage
       error (``main`` returns every code, argparse's included, and never raises SystemExit); also when the *user's own code* raised (workload factory, batch, loss, the model's
       forward or backward, the optimizer): a UserCodeError, shown with that code's traceback;
       and when that code closed sys.stdout or sys.stderr (call_user reopens it, then raises)
  2    also out of memory (torch.OutOfMemoryError, or CPU "can't allocate memory"): the step does not fit
  2    also when the child process ``remat check`` runs the workload in died or exited before it reported its
       result (a factory calling ``os._exit(0)``, a segfault, a kill): a WorkloadProcessDied naming the
       phase and the exit status or signal (NOTE [workload in a child process] in remat/workflow/child.py)
  3    a remat bug: any other exception that is not a RematError; the traceback is printed, please report it
  4    the command ran (or, for ``remat check``, would run) past its time limit (``--timeout``): a
       CheckTimeout, nothing decided. Every command that runs a workload takes ``--timeout``
       (``common.add_timeout_arg``) and arms an alarm (SIGALRM) that raises that CheckTimeout
       wherever the main thread is, a hanging factory or ``batch()`` included. ``remat check``
       keeps its own ``--timeout`` (default from [tool.remat], else 3600 s), checked up front
       against the fixtures' estimate before anything runs (remat.workflow.check.Deadline), and runs
       the user's workload in a child process that the CLI's process watches with that deadline: past
       it, the child and everything it started are killed (within about a second) and the check exits
       4 naming the phase, whatever the workload does with SIGALRM or exceptions (NOTE [workload in a
       child process]); the alarm is armed too, for the parent's own work and a pipeline receipt
  130  interrupted (Ctrl-C), at any moment, torch's import included: one line, no traceback
  143  terminated (SIGTERM), handled like Ctrl-C: the CLI's handler raises ``Terminated`` (a
       KeyboardInterrupt), so the same cleanup runs (temp files removed, ranks stopped); one line
How remat tells the user's code from its own: every call into the workload goes through
``remat.workload.contract.call_user`` (NOTE [user code errors] there), which types what the
user's code raises and lets remat's own exceptions through. The same rule holds at any world
size: a rank records which kind it hit, and the launcher raises accordingly (launch.diagnose).

This module imports nothing heavy at the top (no torch, no rich): the console script imports
it, and a Ctrl-C during that import could not be caught; ``main`` imports the rest inside its
own ``try``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator, Sequence

from ..errors import CheckTimeout, Terminated

# One module per subcommand, each with ``add_parser(subparsers)`` that sets ``func``.
COMMANDS = ("trace", "plan", "verify", "frontier", "distributed", "receipt", "check", "demo")


def build_parser() -> Any:
    import argparse
    import importlib

    from .. import __version__
    parser = argparse.ArgumentParser(prog="remat", description="Plan, apply and prove activation checkpointing.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"remat.cli.cmd_{name}").add_parser(sub)
    return parser


def _interrupted(exc: BaseException | None = None) -> int:
    """One line on stderr; 143 after SIGTERM, 130 after Ctrl-C (NOTE [exit codes])."""
    code, word = (143, "terminated") if isinstance(exc, Terminated) else (130, "interrupted")
    try:
        sys.stderr.write(f"remat: {word}\n")
        sys.stderr.flush()
    except (OSError, ValueError, KeyboardInterrupt):
        pass
    return code


@contextlib.contextmanager
def _handling(handlers: dict[int, Any]) -> Iterator[None]:
    """Install ``handlers`` (signal number -> handler) for the block, then restore the previous ones.
    Outside the main thread (signals cannot be set there) it leaves them alone."""
    try:
        previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    except ValueError:   # not the main thread
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _exit_at_once_on_interrupt() -> contextlib.AbstractContextManager[None]:
    """While torch, numpy, scipy and rich import, Ctrl-C (130) and SIGTERM (143) exit at once, one line.

    A KeyboardInterrupt raised inside those imports is not reliably ours to catch: some import
    code swallows it (the command runs on as if nothing happened), and one raised through the
    interpreter's own code runner makes Python re-kill itself with SIGINT after ``main``
    returns (exit -2). Nothing has been written yet, so exiting on the
    spot loses nothing. Afterwards Ctrl-C is Python's KeyboardInterrupt and SIGTERM the CLI's
    ``Terminated``, which the commands clean up after (the distributed launcher stops its ranks).
    """
    def handler(signum: int, frame: Any) -> None:
        word, code = (b"terminated", 143) if signum == signal.SIGTERM else (b"interrupted", 130)
        os.write(2, b"remat: " + word + b"\n")
        os._exit(code)
    return _handling({signal.SIGINT: handler, signal.SIGTERM: handler})


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def time_limit(command: str, timeout_s: float | None) -> contextlib.AbstractContextManager[None]:
    """Raise CheckTimeout in the main thread once ``timeout_s`` (s) have passed (None: no limit)."""
    def expired(signum: int, frame: Any) -> None:
        raise CheckTimeout(f"remat {command} ran past its --timeout of {timeout_s:g} s: stopped, nothing decided")
    if timeout_s is None or not hasattr(signal, "setitimer"):
        return contextlib.nullcontext()
    return _armed(timeout_s, expired)


@contextlib.contextmanager
def _armed(timeout_s: float, expired: Any) -> Iterator[None]:
    with _handling({signal.SIGALRM: expired}):
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with _exit_at_once_on_interrupt():
            parser = build_parser()       # imports every command, and with them torch
            import rich.markup  # noqa: F401 - imported here, under the handler

            from . import render  # noqa: F401
        with _handling({signal.SIGTERM: _raise_terminated}):
            return _main(parser, argv)
    except KeyboardInterrupt as exc:
        return _interrupted(exc)


def _main(parser: Any, argv: Sequence[str] | None) -> int:
    from rich.markup import escape

    from ..errors import RematError
    from .render import err_console
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # usage errors (exit 2), --help and --version (0): main always returns the code
        return exc.code if isinstance(exc.code, int) else 2
    try:
        with time_limit(args.command, getattr(args, "command_timeout_s", None)):
            try:
                return int(args.func(args) or 0)
            finally:
                from .common import stop_heartbeats
                stop_heartbeats()
    except RematError as exc:
        # messages carry user text (paths, module names): never let rich read them as markup
        if exc.traceback_text:
            err_console.print(escape(exc.traceback_text), style="dim", highlight=False, soft_wrap=True)
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        if exc.tip:
            err_console.print(f"[yellow]tip:[/] {escape(exc.tip)}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except Exception as exc:  # a bug in remat (the user's code raises UserCodeError: NOTE [exit codes])
        from ..workload.contract import is_allocation_failure
        if is_allocation_failure(exc):   # the step does not fit this machine: not a remat bug
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            err_console.print(f"[bold red]error:[/] out of memory: {escape(type(exc).__name__)}: {escape(first)}",
                              highlight=False)
            err_console.print("[yellow]tip:[/] use a smaller shape (--shape), or a larger machine", highlight=False)
            return 2
        err_console.print_exception(max_frames=8)
        err_console.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))}\n"
                          "This is a remat bug: please report it with the command line and the traceback above.",
                          highlight=False)
        return 3


if __name__ == "__main__":
    sys.exit(main())
