"""``PlannerSpec``: a planner name and its parameters, typed. One ``parse``, one ``format``.

NOTE [planner specs]
A planner travels as text (``remat plan --planner``, ``remat frontier --plans``, ``plan.json``'s
``planner``, a frontier point's ``planner`` and label); this is its one grammar:

    spec      := [origin "->"] own
    own       := kind [":" K] ["@" budget]
    kind      := none | all | uniform | sqrt | selective | checkpoint_sequential | first-k
               | floor | greedy | optimal | torch-budget

- ``uniform:K`` needs K; ``checkpoint_sequential`` and ``first-k`` take an optional K and
  without it choose K at a budget (they then take a budget, as ``greedy`` and ``optimal`` do).
- ``planner@X`` (frontier sweep points): planned at budget X, kept as its text (bytes, a unit
  or a share of the control's peak; remat.plan.budget parses it). Only a planner that takes a
  budget takes ``@X``.
- ``torch-budget@R``: not a remat planner, the unplanned model compiled at torch's
  activation_memory_budget ratio R (NOTE [budget aimed at a peak] in frontier/run.py).
- ``origin->own`` (NOTE [closed loop fallbacks] in closed_loop.py): the closed loop asked
  ``origin`` for a plan, its pick missed the budget when measured, and the fallback ``own``
  shipped; ``optimal->all``. Or its pick fitted but lost (or tied) the time race against the
  simple plan ``own``, which shipped (NOTE [time race] in closed_loop.py; ``plan.time_race`` says
  which): ``optimal->first-k:2``.
``format(parse(text))`` is ``text`` for every spec remat writes; parsing lower-cases and strips
spaces, and writes K as a plain integer (``uniform:02`` formats as ``uniform:2``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Annotated

from .._codec import Via
from .._json import SHORT
from ..errors import PlanError


class PlannerKind(enum.Enum):
    NONE = "none"
    ALL = "all"
    UNIFORM = "uniform"                              # K required (NOTE [uniform:K])
    SQRT = "sqrt"
    SELECTIVE = "selective"
    CHECKPOINT_SEQUENTIAL = "checkpoint_sequential"  # K optional (NOTE [baseline families])
    FIRST_K = "first-k"                              # K optional
    FLOOR = "floor"
    GREEDY = "greedy"
    OPTIMAL = "optimal"
    TORCH_BUDGET = "torch-budget"                    # torch's activation_memory_budget; not a remat planner


_TAKES_K = (PlannerKind.UNIFORM, PlannerKind.CHECKPOINT_SEQUENTIAL, PlannerKind.FIRST_K)
_BUDGET_KINDS = (PlannerKind.OPTIMAL, PlannerKind.GREEDY, PlannerKind.CHECKPOINT_SEQUENTIAL, PlannerKind.FIRST_K)
_REMATS_OWN = (PlannerKind.OPTIMAL, PlannerKind.GREEDY, PlannerKind.FLOOR)   # not a baseline

# ``remat plan --planner`` choices, in the order the help lists them
PLANNER_SPECS = ("optimal", "greedy", "sqrt", "uniform:K", "all", "selective", "checkpoint_sequential",
                 "checkpoint_sequential:K", "first-k", "first-k:K", "floor", "none")
BUDGET_PLANNERS = tuple(k.value for k in _BUDGET_KINDS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerSpec:
    """One planner spec (NOTE [planner specs])."""

    kind: PlannerKind
    k: int | None = None                   # uniform:K, checkpoint_sequential:K, first-k:K
    budget: str | None = None              # planner@X: the budget text X ("50%", "1.5GiB", "123456")
    ratio: float | None = None             # torch-budget@R: activation_memory_budget in [0, 1]
    fallback_of: PlannerSpec | None = None  # origin->own: the planner whose pick missed

    def __post_init__(self) -> None:
        if self.kind is PlannerKind.UNIFORM and self.k is None:
            raise PlanError(f"uniform:K needs an integer K >= 1, got {self.format()!r}")
        if self.k is not None and self.kind not in _TAKES_K:
            raise PlanError(f"{self.kind.value} takes no K, got {self.format()!r}")
        if self.budget is not None and not self.needs_budget:
            raise PlanError(f"{self.format()!r}: only {', '.join(BUDGET_PLANNERS)} take a budget (planner@budget)")
        if self.ratio is not None and self.kind is not PlannerKind.TORCH_BUDGET:
            raise PlanError(f"{self.format()!r}: a ratio goes with torch-budget, as torch-budget@R")

    @property
    def needs_budget(self) -> bool:
        """Planned at a budget (greedy, optimal; checkpoint_sequential and first-k without K)."""
        return self.kind in _BUDGET_KINDS and self.k is None

    @property
    def family(self) -> str:
        """The planner the user asked for: the origin's kind for a fallback (``optimal->all``: optimal)."""
        return (self.fallback_of or self).kind.value

    @property
    def is_remats_own(self) -> bool:
        """remat's own planners (optimal, greedy, floor) as against a baseline, by :attr:`family`."""
        return (self.fallback_of or self).kind in _REMATS_OWN

    @property
    def planner(self) -> PlannerSpec:
        """This spec without its budget: the planner a ``planner@X`` sweep point runs."""
        return dataclasses.replace(self, budget=None)

    def after_miss_of(self, origin: PlannerSpec) -> PlannerSpec:
        """This fallback, shipped because ``origin``'s pick missed (NOTE [closed loop fallbacks])."""
        return dataclasses.replace(self, fallback_of=origin)

    def format(self) -> str:
        own = self.kind.value + ("" if self.k is None else f":{self.k}")
        if self.budget is not None:
            own += f"@{self.budget}"
        if self.ratio is not None:
            own += f"@{self.ratio:g}"
        return own if self.fallback_of is None else f"{self.fallback_of.format()}->{own}"

    def __str__(self) -> str:
        return self.format()

    # Equal to its text, as a str enum is to its value, so a caller's ``plan.planner == "optimal"`` reads
    # as it did when the field held the text; the hash agrees with that equality.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, PlannerSpec)):
            return self.format() == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.format())

    @classmethod
    def parse(cls, text: str | PlannerSpec) -> PlannerSpec:
        """Spec text -> PlannerSpec (NOTE [planner specs]); PlanError naming the valid planners if off."""
        if isinstance(text, PlannerSpec):
            return text
        origin, arrow, own = str(text).strip().rpartition("->")
        spec = _parse_own(own.strip(), str(text))
        return spec if not arrow else spec.after_miss_of(cls.parse(origin))


# A PlannerSpec field of a JSON type (plan.json, a frontier point, a verify report, remat.auto's report): held
# typed, written as its text (NOTE [planner specs]), at most SHORT in a file
PlannerText = Annotated[PlannerSpec, SHORT, Via(str, PlannerSpec.parse)]   # str(spec) is spec.format()


def _parse_own(text: str, whole: str) -> PlannerSpec:
    name, at, after = text.partition("@")
    name, colon, arg = name.strip().lower().partition(":")
    try:
        kind = PlannerKind(name)
    except ValueError:
        raise _unknown(whole) from None
    if kind is PlannerKind.UNIFORM and not colon:
        raise _unknown(whole)
    k = _parse_k(kind, arg, whole) if colon else None
    if kind is PlannerKind.TORCH_BUDGET:
        try:
            ratio = float(after) if at else None
        except ValueError:
            raise PlanError(f"torch-budget@R needs a number R, got {after!r}") from None
        return PlannerSpec(kind=kind, ratio=ratio)
    return PlannerSpec(kind=kind, k=k, budget=after.strip() if at else None)


def _unknown(text: str) -> PlanError:
    return PlanError(f"unknown planner {text!r}; valid: {', '.join(PLANNER_SPECS)}")


def _parse_k(kind: PlannerKind, arg: str, whole: str) -> int:
    if kind not in _TAKES_K:
        raise _unknown(whole)
    try:
        return int(arg)
    except ValueError:
        what = "an integer K >= 1" if kind is PlannerKind.UNIFORM else "an integer K"
        raise PlanError(f"{kind.value}:K needs {what}, got {arg!r}") from None
