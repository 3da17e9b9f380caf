"""Several example batches for ``remat.auto``: the step sample it plans for (NOTE [step sample])."""

from __future__ import annotations

from typing import Any

from ..errors import AutoError


class ExampleBatches:
    """``remat.auto(model, ExampleBatches(short, long), ...)``: plan for every batch, so the plan holds
    on the largest (padded batches: the longest sequence the run will see).

    Each batch is one sampled step, profiled and measured; the predicted and measured peak is the max
    over them, and a ``"70%"`` budget is of the largest unplanned peak. A marker type, not a bare
    list or tuple: ``(x, y)`` is itself one batch, so a list of batches could not be told from it.
    """

    def __init__(self, *batches: Any) -> None:
        if len(batches) == 1 and isinstance(batches[0], (list, tuple)) and not batches[0]:
            batches = ()
        if not batches:
            raise AutoError("ExampleBatches needs at least one batch", tip="ExampleBatches(batch_seq64, batch_seq128)")
        self.batches: tuple[Any, ...] = tuple(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __repr__(self) -> str:
        return f"ExampleBatches({len(self.batches)} batches)"
