"""``remat`` entry point.

NOTE [exit codes]
  0    success
  1    a check ran and failed (verify, check): RematError subclasses with exit_code = 1
  2    bad input: a typed RematError with a one-line message (and a tip), or an argparse usage
       error (``main`` returns every code, argparse's included, and never raises SystemExit); also when the *user's own code* raised (workload factory, batch, loss, the model's
       forward or backward, the optimizer): a UserCodeError, shown with that code's traceback
  2    also out of memory (torch.OutOfMemoryError, or CPU "can't allocate memory"): the step does not fit
  3    a remat bug: any other exception that is not a RematError; the traceback is printed, please report it
  4    ``remat check`` ran (or would run) past its time limit (``--timeout``): a CheckTimeout, nothing decided
  130  interrupted (Ctrl-C), at any moment, torch's import included: one line, no traceback
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


def _interrupted() -> int:
    try:
        sys.stderr.write("remat: interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError, KeyboardInterrupt):
        pass
    return 130


@contextlib.contextmanager
def _exit_at_once_on_interrupt() -> Iterator[None]:
    """While torch, numpy, scipy and rich import, Ctrl-C exits at once (130, one line).

    A KeyboardInterrupt raised inside those imports is not reliably ours to catch: some import
    code swallows it (the command then ran on as if nothing happened), and one raised through
    the interpreter's own code runner makes Python re-kill itself with SIGINT after ``main``
    returned (exit -2); both were seen here. Nothing has been written yet, so exiting on the
    spot loses nothing. Afterwards Python's own handler is back, and Ctrl-C is a
    KeyboardInterrupt the commands clean up after (the distributed launcher stops its ranks).
    """
    def handler(signum: int, frame: Any) -> None:
        os.write(2, b"remat: interrupted\n")
        os._exit(130)
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:   # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with _exit_at_once_on_interrupt():
            parser = build_parser()       # imports every command, and with them torch
            import rich.markup  # noqa: F401 - imported here, under the handler

            from . import render  # noqa: F401
        return _main(parser, argv)
    except KeyboardInterrupt:
        return _interrupted()


def _main(parser: Any, argv: Sequence[str] | None) -> int:
    from rich.markup import escape

    from ..errors import RematError
    from .render import err_console
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # usage errors (exit 2), --help and --version (0): main always returns the code
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except RematError as exc:
        # messages carry user text (paths, module names): never let rich read them as markup
        if exc.traceback_text:
            err_console.print(escape(exc.traceback_text), style="dim", highlight=False, soft_wrap=True)
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        if exc.tip:
            err_console.print(f"[yellow]tip:[/] {escape(exc.tip)}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        return _interrupted()
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
