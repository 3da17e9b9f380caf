"""Rendering helpers for the CLI: bytes, tables, progress (rich)."""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..types import ProgressFn

console = Console()
err_console = Console(stderr=True)

# NOTE [printed receipt strings]
# What ``remat check`` prints about a receipt (findings, what held, what was skipped) quotes strings
# a pull request wrote: module and class names, reasons, workload specs. A CI log is read line by
# line, by people and by the runner, so such a string must not be able to start a line of its own:
# every control character (newlines, carriage returns, the ESC that starts an ANSI sequence, C1
# controls such as the one-byte CSI), the Unicode line and paragraph separators and the invisible
# format characters (zero-width, bidirectional overrides) are printed as a visible ``\xNN`` /
# ``\uNNNN``; and since rich wraps a long line wherever there is a space, ``::`` (GitHub's
# workflow commands, ``::error ...``, ``::set-output ...``, at the start of any line) and the
# legacy ``##[`` are broken up (``: :``, ``# #[``) wherever they occur, not only at the start.
# Rich markup is escaped last. One function does all of it: :func:`untrusted`.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")


def _visible(m: re.Match[str]) -> str:
    code = ord(m[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def untrusted(text: object) -> str:
    """``text`` (from a receipt) as one printable line of rich markup (NOTE [printed receipt strings])."""
    line = _UNPRINTABLE.sub(_visible, str(text)).replace("::", ": :").replace("##[", "# #[")
    return escape(line)


@contextlib.contextmanager
def progress_bar() -> Iterator[ProgressFn]:
    """A ProgressFn that draws one rich bar per task description (on stderr)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err_console, transient=True) as prog:
        tasks: dict[str, int] = {}

        def update(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = prog.add_task(what, total=total)
            prog.update(tasks[what], completed=done, total=total)

        yield update
