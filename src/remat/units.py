"""Byte units shared by every stage (pure Python: the planner uses it too): remat's one byte formatter."""

from __future__ import annotations

KIB = 2 ** 10  # bytes
MIB = 2 ** 20  # bytes
GIB = 2 ** 30  # bytes
_FIXED = {"B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB}


def fmt_bytes(n: int | float | None, unit: str | None = None) -> str:
    """Bytes for a reader (``'-'`` for None), the one formatter every stage uses.

    ``unit=None``: GiB from 1 GiB, MiB from 64 KiB (so figures side by side mostly share a
    unit), KiB from 1 KiB, else B. ``unit="MiB"`` (or B, KiB, GiB): always that unit, two
    decimals, for figures compared line by line (see :func:`mib`).
    """
    if n is None:
        return "-"
    x = float(n)
    if unit is not None:
        if unit not in _FIXED:
            raise ValueError(f"unknown byte unit {unit!r}; choose one of {', '.join(_FIXED)}")
        return f"{x:.0f} B" if unit == "B" else f"{x / _FIXED[unit]:.2f} {unit}"
    if abs(x) >= GIB:
        return f"{x / GIB:.2f} GiB"
    if abs(x) >= 64 * KIB:
        return f"{x / MIB:.2f} MiB"
    if abs(x) >= KIB:
        return f"{x / KIB:.1f} KiB"
    return f"{x:.0f} B"


def mib(n: int | float | None) -> str:
    """``'12.34 MiB'`` (``'-'`` for None): the one unit for figures read side by side."""
    return fmt_bytes(n, "MiB")
