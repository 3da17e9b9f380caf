"""What a failed check of a receipt is about: :class:`FindingKind` and :class:`CheckFinding`."""

from __future__ import annotations

import dataclasses
import enum
from .._codec import JsonCodec, Text


class FindingKind(str, enum.Enum):
    """What a failed check is about (the order ``check_receipt`` checks in)."""

    WORKLOAD = "workload"         # the receipt names other code than the user's
    PIN = "pin"                   # the receipt's shape, dtype, autocast or world size is not the repository's pin
    REPORT = "report"             # report.html/report.md beside it show another receipt, or are missing
    DECISION = "decision"         # the receipt ships nothing
    # the receipt contradicts itself (NOTE [receipt consistency] in workflow/consistency.py)
    BUDGET = "budget"             # effective budget, headroom, reserve left or clears disagree with budget x (1 - reserve)
    RECORDS = "records"           # the plan's boundaries (module, mode) disagree with the boundary records or the frontier
    FIXTURE = "fixture"           # a fixture size (seeds, steps, world size) past the gate's limits, or unlike remat receipt's
    CLAIMS = "claims"             # claimed figures (peaks, times, overhead, verdicts) contradict each other
    STATEMENTS = "statements"     # a sentence or list (why, rejected reasons, unsupported, RNG, memory source) is not
                                  # what the receipt's own data give (NOTE [receipt statements])
    # re-run on the user's workload
    SHAPE = "shape"               # a shape keyword (or its default) changed
    MODEL = "model"               # a boundary's module changed or is gone; the fingerprint differs
    EQUIVALENCE = "equivalence"   # the paired-step fixture fails
    PEAK = "peak"                 # the peak no longer clears budget x (1 - reserve)
    PEAK_CLAIM = "peak-claim"     # the peak exceeds the receipt's claimed peak by more than the tolerance
    CONTROL = "control"           # the unplanned step's re-measured peak or held bytes differ from the claims
    ENVIRONMENT = "environment"   # the receipt was made under another torch release than the one checking it
    SAVING = "saving"             # a boundary saves less than its claim, past the tolerance
    TIME = "time"                 # the overhead exceeds the claimed one past the tolerance and the noise
    DEVICE = "device"             # a step the receipt ran no longer fits the device's memory (NOTE [blocked receipt])

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckFinding(JsonCodec):
    """One thing that no longer holds. ``boundary`` names the module when it is about one. Its JSON
    (``to_json``/``from_json``, NOTE [codecs from the types]) is how a check run in a child process
    reports it (NOTE [workload in a child process] in workflow/child.py)."""

    kind: FindingKind
    message: Text
    boundary: Text | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FindingKind(self.kind))
