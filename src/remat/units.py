"""Byte units shared by every stage (pure Python: the planner uses it too)."""

from __future__ import annotations

MIB = 2 ** 20  # bytes


def mib(n: int | float | None) -> str:
    """``'12.34 MiB'`` (``'-'`` for None): the one unit for figures read side by side."""
    return "-" if n is None else f"{n / MIB:.2f} MiB"
