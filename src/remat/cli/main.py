"""``remat`` entry point.

NOTE [exit codes]
  0  success
  1  a check ran and failed (verify, check): RematError subclasses with exit_code = 1
  2  bad input (typed RematError), or argparse usage errors
  3  an unexpected internal error (a bug in remat: the traceback is printed, please report it)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from rich.markup import escape

from ..errors import RematError
from .render import err_console

# One module per subcommand, each with ``add_parser(subparsers)`` that sets ``func``.
COMMANDS = ("trace", "plan", "verify", "frontier", "distributed", "receipt", "check", "demo")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    parser = argparse.ArgumentParser(prog="remat", description="Plan, apply and prove activation checkpointing.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"remat.cli.cmd_{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RematError as exc:
        # messages carry user text (paths, module names): never let rich read them as markup
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        if exc.tip:
            err_console.print(f"[yellow]tip:[/] {escape(exc.tip)}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except Exception as exc:  # a bug in remat, or an error from the user's own model code
        err_console.print_exception(max_frames=8)
        err_console.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(str(exc))}\n"
                          "If the traceback ends in your model or loss code, fix it there; otherwise this "
                          "is a remat bug: please report it with the command line.", highlight=False)
        return 3


if __name__ == "__main__":
    sys.exit(main())
