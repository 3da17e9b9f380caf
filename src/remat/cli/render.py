"""Rendering helpers for the CLI: bytes, tables, progress (rich)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..types import ProgressFn

console = Console()
err_console = Console(stderr=True)


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
