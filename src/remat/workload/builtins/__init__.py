"""Built-in workloads: small but realistic training steps, one per architecture family."""

from __future__ import annotations

from ...errors import ShapeError


def check_sizes(workload: str, batch_size: int, **sizes: int) -> None:
    """Every size keyword of a built-in is a count (a width, a depth) of at least one: ``depth=-3`` built
    an empty ``ModuleList`` and a ``width=0`` model trains nothing, so each is refused here, naming the
    keyword, before any module is built (the loader has already checked it is an int). ``batch_size``
    may be 0: the step's own check (``TrainingStep``'s batch, in workload/contract.py) names an empty batch for every
    workload, so only a negative one is refused here."""
    for name, value, least in [("batch_size", batch_size, 0), *((n, v, 1) for n, v in sizes.items())]:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ShapeError(f"workload {workload!r}: {name}={value!r} must be an integer of at least {least}",
                             tip=f"pass a positive count, e.g. --shape {name}=2")
