"""How an arm is compiled (:class:`CompileSpec`): torch-free, so a plan (remat.plan.model) can carry one
without importing torch. The compiling itself is remat.measure.compiled (NOTE [compiled arms])."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

from .._codec import FloatAsWritten, JsonCodec, json_field
from .._json import Enum, Num
from ..errors import RematError

BACKENDS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileSpec(JsonCodec):
    """How an arm is compiled. ``memory_budget``: torch's ``activation_memory_budget`` (a ratio of
    saved-activation bytes in [0, 1]; None leaves torch's own setting, 1.0 by default)."""

    # both keys are in every file (the schema requires them), though a caller may leave either out
    backend: Annotated[str, Enum(*BACKENDS)] = json_field(default="inductor", required=True)
    memory_budget: Annotated[FloatAsWritten, Num(0, 1)] | None = json_field(default=None, required=True)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RematError(f"unknown torch.compile backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        b = self.memory_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                              or not 0.0 <= b <= 1.0):
            raise RematError(f"activation_memory_budget must lie in [0, 1], got {b!r}")

    def describe(self) -> str:
        budget = "" if self.memory_budget is None else f", activation_memory_budget={self.memory_budget:g}"
        return f"torch.compile(model, backend={self.backend}{budget})"
