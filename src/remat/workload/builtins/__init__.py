"""Built-in workloads: small but realistic training steps, one per architecture family."""

from __future__ import annotations

from ...errors import ShapeError


def check_sizes(workload: str, **sizes: int) -> None:
    """Every size keyword of a built-in is a count (a batch, a width, a depth) of at least one: ``depth=-3``
    built an empty ``ModuleList`` and a ``width=0`` model trains nothing, so each is refused here, naming
    the keyword, before any module is built (the loader has already checked it is an int)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShapeError(f"workload {workload!r}: {name}={value!r} must be an integer of at least 1",
                             tip=f"pass a positive count, e.g. --shape {name}=2")
