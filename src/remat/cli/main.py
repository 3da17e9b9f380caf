"""``remat`` entry point.

NOTE [exit codes]
  0    success
  1    a check ran and failed (verify, check): RematError subclasses with exit_code = 1
  2    bad input: a typed RematError with a one-line message (and a tip), or an argparse usage
       error; also when the *user's own code* raised (workload factory, batch, loss, the model's
       forward or backward, the optimizer): a UserCodeError, shown with that code's traceback
  2    also out of memory (torch.OutOfMemoryError, or CPU "can't allocate memory"): the step does not fit
  3    a remat bug: any other exception that is not a RematError; the traceback is printed, please report it
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

import sys
from typing import Any, Sequence

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


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:   # also while torch or rich imports (NOTE [exit codes])
        return _interrupted()


def _main(argv: Sequence[str] | None) -> int:
    from ..errors import RematError
    parser = build_parser()
    args = parser.parse_args(argv)
    from rich.markup import escape

    from .render import err_console
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
