"""Budget and reserve parsing (``--budget 1.5GiB`` / ``60%``, ``--reserve 5%``), and the impossible-budget error."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from ..errors import BudgetError, Option, spell
from ..units import mib


# Decimal (SI) and binary (IEC) units, matched case-insensitively. Bare "K/M/G" are refused:
# they are ambiguous between the two.
_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
    "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
}
# re.ASCII: ``\d`` alone matches every Unicode digit (Arabic-Indic "٣", fullwidth "３"), and Decimal()
# reads them all; a budget is typed in ASCII, and one that is not is a paste gone wrong, never a setting.
_QUANTITY = re.compile(
    r"^\s*(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>%|[A-Za-z]+)?\s*$", re.ASCII)
_BUDGET_FORMS = "bytes (123456), a size with a unit (800MiB, 1.5GiB, 2GB) or a percentage of the no-checkpoint peak (60%)"


# NOTE [bounded budget parsing]
# ``Decimal("1e999999999")`` is built instantly, but ``int()`` of it writes a billion digits
# (minutes), and arithmetic on it overflows (``decimal.Overflow``, ``OverflowError``). So the
# text is capped in length and the number's order of magnitude is read from its exponent
# (``Decimal.adjusted()``, no expansion) before any arithmetic: a budget is at most
# :data:`MAX_BUDGET_BYTES` and at least one byte; a percentage at most :data:`MAX_PERCENT`.
MAX_TEXT = 64
MAX_BUDGET_BYTES = 2 ** 60     # 1 EiB: no device remat plans for holds more
MAX_PERCENT = Decimal(10 ** 6)  # a budget a million percent of the peak is no budget


def _magnitude_ok(value: Decimal, limit: Decimal) -> bool:
    """``0 < value <= limit``, decided from the exponent first so a huge exponent costs nothing."""
    if value.adjusted() > limit.adjusted() + 1:
        return False
    if value.adjusted() < -30:       # far below one byte of any unit: caught as "less than one byte"
        return True
    return value <= limit


_FRACTION_TIP = ("a share of the unplanned step's peak is a percentage string (\"70%\", not 0.7); "
                 "an amount is whole bytes or has a unit (\"1.5GiB\")")


def _whole_bytes(value: float) -> int:
    """A float budget as bytes: only a finite, whole number of at least one byte (``8e9``); a fraction
    (``0.7``, ``1.5``) is refused, never rounded down to a byte count nobody meant (NOTE [bounded budget parsing])."""
    if not math.isfinite(value):
        raise BudgetError(f"budget must be {_BUDGET_FORMS}; got {value!r}")
    if not value.is_integer():
        raise BudgetError(f"budget={value!r} is not a whole number of bytes", tip=_FRACTION_TIP)
    if not 0 < value <= MAX_BUDGET_BYTES:
        raise BudgetError(f"budget must lie between 1 byte and {MAX_BUDGET_BYTES} bytes (1 EiB), got {value!r}")
    return int(value)


def format_bytes(n: int) -> str:
    """``'1234567 bytes (1.18 MiB)'``: every budget message gives both."""
    return f"{n} bytes ({mib(n)})"


def check_budget_syntax(text: str | int | float) -> None:
    """BudgetError when ``text`` is not a budget ``parse_budget`` takes: the one check callers make
    before minutes of measuring, while a percentage cannot be resolved yet (no baseline peak)."""
    parse_budget(text, 1 << 50)   # any baseline: a share of it is well formed whatever it is


def parse_budget(text: str | int | float, baseline_peak_bytes: int) -> int:
    """Whole-step peak budget in bytes (a fraction of a byte from a larger unit rounded down).

    ``text``: ``123456`` (bytes), ``800MiB``/``1.5GiB``/``2GB``/``512kB`` (units: B, kB, MB, GB, TB,
    KiB, MiB, GiB, TiB, any case), or ``60%`` of ``baseline_peak_bytes`` (the measured peak of the
    unmodified step). Malformed, zero or negative, a byte count with a fraction (``1.5``, ``"1.5"``, a
    float share such as ``0.7``: a share is ``"70%"``) or digits other than ASCII -> BudgetError.
    """
    value, unit, text = _quantity(text)
    if value <= 0:
        raise BudgetError(f"budget must be positive, got {text!r}")
    if value.adjusted() < -30:
        raise BudgetError(f"budget {text!r} is less than one byte")
    nbytes = _share_bytes(value, text, baseline_peak_bytes) if unit == "%" else _unit_bytes(value, unit, text)
    if nbytes > MAX_BUDGET_BYTES:
        raise BudgetError(f"budget {text!r} is out of range: at most {MAX_BUDGET_BYTES} bytes (1 EiB)")
    if nbytes < 1:
        raise BudgetError(f"budget {text!r} is less than one byte")
    return nbytes


def _quantity(text: str | int | float) -> tuple[Decimal, str | None, str | int]:
    """(the number, its unit or "%" or None for bytes, ``text`` as the messages quote it); BudgetError
    when it is not a budget's form."""
    if isinstance(text, bool):
        raise BudgetError(f"budget must be {_BUDGET_FORMS}; got {text!r}")
    if isinstance(text, float):
        text = _whole_bytes(text)
    if isinstance(text, int):
        if not 0 < text <= MAX_BUDGET_BYTES:
            raise BudgetError(f"budget must lie between 1 byte and {MAX_BUDGET_BYTES} bytes (1 EiB), got {show_number(text)}")
        return Decimal(text), None, text
    if len(str(text)) > MAX_TEXT:
        raise BudgetError(f"malformed budget {str(text)[:MAX_TEXT]!r}...: longer than {MAX_TEXT} characters; "
                          f"expected {_BUDGET_FORMS}")
    m = _QUANTITY.match(str(text))
    if m is None:
        other = "" if str(text).isascii() else " (it has characters other than ASCII: write its digits 0-9)"
        raise BudgetError(f"malformed budget {text!r}{other}: expected {_BUDGET_FORMS}")
    try:
        return Decimal(m["num"]), m["unit"], text
    except InvalidOperation:   # an exponent too long for decimal itself (the regex admits only decimals)
        raise BudgetError(f"malformed budget {text!r}: the number is out of range; expected {_BUDGET_FORMS}") from None


def _share_bytes(value: Decimal, text: str | int, baseline_peak_bytes: int) -> int:
    """``value`` percent of the no-checkpoint peak, in bytes (rounded down)."""
    if not _magnitude_ok(value, MAX_PERCENT):
        raise BudgetError(f"budget {text!r} is out of range: a percentage of the no-checkpoint peak is at most "
                          f"{MAX_PERCENT}%")
    if baseline_peak_bytes <= 0:
        raise BudgetError(f"a percentage budget ({text!r}) needs the no-checkpoint peak, "
                          f"which is {baseline_peak_bytes} bytes")
    return int(Decimal(baseline_peak_bytes) * value / 100)


def _unit_bytes(value: Decimal, unit: str | None, text: str | int) -> int:
    """``value`` ``unit`` in bytes (None: bytes; a larger unit's fraction of a byte rounded down)."""
    scale = 1 if unit is None else _UNITS.get(unit.lower())
    if scale is None:
        raise BudgetError(f"unknown unit {unit!r} in budget {text!r}; use one of "
                          "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB or %")
    if scale == 1 and value != value.to_integral_value():
        # "1.5" bytes: no byte count has a fraction, so it is a share or a unit left out; rounding it
        # down made 1.5 one byte. A larger unit's fraction of a byte ("1.3GiB") is rounded down, as documented.
        raise BudgetError(f"budget {text!r} is not a whole number of bytes",
                          tip=_FRACTION_TIP)
    if not _magnitude_ok(value, Decimal(MAX_BUDGET_BYTES) / scale):
        raise BudgetError(f"budget {text!r} is out of range: at most {MAX_BUDGET_BYTES} bytes (1 EiB)")
    return int(value * scale)


# NOTE [the reserve]
# The reserve (default 5%: ``--reserve``, ``remat.auto(reserve=)``) is the share of the budget a
# plan keeps free: its predicted peak, and the closed loop's measured one, must stay under
# budget x (1 - reserve), the *effective budget*. It holds room for what one measured step does
# not show: the CUDA caching allocator's rounding and fragmentation (``max_memory_allocated``
# counts tensors, not the blocks that hold them), the CUDA context and other processes, step-to-
# step variation, and on CPU what the tracker cannot see (NOTE [peaks at the edge] in
# remat/memory/reference.py). So "70%" with the default reserve asks for a peak under 66.5% of
# the unplanned one. The closed loop measures the baseline families too (NOTE [closed loop
# fallbacks]): a budget one of them meets by measurement ships. A plan measured under the budget
# itself but inside the reserve is not shipped (it leaves less headroom than asked); the
# BudgetMissed error names it and the reserve that would ship it (``reserve_that_ships`` in
# remat/closed_loop.py), so such a budget is never refused without that offer.

def parse_reserve(text: str | float) -> float:
    """Fraction of the budget kept free, from ``5%`` or ``0.05``; must lie in [0, 1) (NOTE [the reserve])."""
    if isinstance(text, bool):
        raise BudgetError(f"reserve must be a fraction like 0.05 or a percentage like 5%; got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _QUANTITY.match(str(text)) if len(str(text)) <= MAX_TEXT else None
        if m is None or m["unit"] not in (None, "%"):
            raise BudgetError(f"malformed reserve {text!r}: write a fraction like 0.05 or a percentage like 5%")
        value = float(m["num"]) / (100.0 if m["unit"] == "%" else 1.0)
    if not math.isfinite(value) or not 0.0 <= value < 1.0:
        hint = f" (did you mean {text}%?)" if isinstance(text, str) and "%" not in text and 1 <= value < 100 else ""
        raise BudgetError(f"reserve must lie in [0, 1) (0% to under 100%), got {text!r}{hint}")
    return value


def show_number(n: int) -> str:
    """An integer for a message: digits, or how many there are when there are too many to print."""
    s = str(n) if abs(n) < 10 ** 30 else f"an integer of {len(str(abs(n)))} digits"
    return s


def effective_budget(budget_bytes: int, reserve: float, margin_bytes: int = 0) -> int:
    """What the predicted peak must stay under: ``int(budget * (1 - reserve)) - margin`` (bytes).

    Same rounding as ``Plan.effective_budget_bytes``; ``margin_bytes`` is the closed-loop
    correction (NOTE [closed-loop margin] in remat.plan.planners).
    """
    return int(budget_bytes * (1.0 - reserve)) - int(margin_bytes)


def min_budget_for(floor_bytes: int, reserve: float, margin_bytes: int = 0) -> int:
    """Smallest budget (bytes) whose effective budget reaches ``floor_bytes``."""
    b = max(1, math.ceil((floor_bytes + margin_bytes) / (1.0 - reserve)))
    while effective_budget(b, reserve, margin_bytes) < floor_bytes:   # float rounding at the edge
        b += 1
    return b


class InfeasibleBudget(BudgetError):
    """No valid plan's predicted peak reaches the effective budget; carries the floor: predicted, or
    (``measured_by``: the plan that measured it) the lowest peak measured, which the tip's budget would ship."""

    def __init__(self, *, floor_bytes: int, budget_bytes: int, reserve: float, margin_bytes: int = 0,
                 explanation: str = "", control_peak_bytes: int | None = None, measured_by: str | None = None) -> None:
        self.floor_bytes = floor_bytes
        self.control_peak_bytes = control_peak_bytes
        self.measured_by = measured_by
        self.budget_bytes = budget_bytes
        self.reserve = reserve
        self.margin_bytes = margin_bytes
        self.explanation = explanation
        self.effective_budget_bytes = effective_budget(budget_bytes, reserve, margin_bytes)
        margin = f" - margin {margin_bytes} bytes" if margin_bytes else ""
        super().__init__(
            f"no plan reaches the effective budget of {format_bytes(self.effective_budget_bytes)} "
            f"(budget {format_bytes(budget_bytes)} x (1 - reserve {reserve:g}){margin}); "
            + (f"the floor, the lowest predicted peak any valid plan reaches, is {format_bytes(floor_bytes)}"
               if measured_by is None else
               f"the floor, the lowest peak measured ({measured_by}), is {format_bytes(floor_bytes)}")
            + (f". Why: {explanation}" if explanation else ""),
            tip=_infeasible_tip(min_budget_for(floor_bytes, reserve, margin_bytes), control_peak_bytes))


def _infeasible_tip(least_budget: int, control_peak_bytes: int | None) -> str:
    tip = (f"ask for a budget of at least {format_bytes(least_budget)}, lower the reserve, or make more "
           f"candidates plannable ({spell(Option.CANDIDATES)}; {spell(Option.ALLOW_HAZARDS)})")
    if control_peak_bytes is not None and least_budget >= control_peak_bytes:
        # checkpointing saves less than the reserve takes: the least workable budget fits the unplanned step
        tip += (f"; at that budget the unplanned step (peak {format_bytes(control_peak_bytes)}) fits without "
                "checkpointing: checkpointing saves less than the reserve holds back, so lower the reserve "
                "or the batch")
    return tip


def parse_capacity(text: str | int) -> int:
    """A device's capacity in bytes (``--device-memory`` / ``device_memory=``): an amount, never a share."""
    if isinstance(text, str) and text.strip().endswith("%"):
        raise BudgetError(f"{spell(Option.DEVICE_MEMORY, text)}: a device's capacity is an amount (bytes or 2GiB), "
                          "not a percentage", tip=f"a percentage is a budget: {spell(Option.BUDGET, '70%')}")
    try:
        return parse_budget(text, 0)
    except BudgetError as exc:
        raise BudgetError(f"{spell(Option.DEVICE_MEMORY, str(text)[:MAX_TEXT])}: "
                          + exc.message.replace("budget", "device memory"),
                          tip="bytes, or an amount with its unit: 2GiB, 800MiB") from None


def budget_on_device(budget: str | int | None, baseline_peak_bytes: int, capacity_bytes: int | None) -> int | None:
    """The budget in bytes on a device of ``capacity_bytes`` (NOTE [device capacity] in remat/autoplan/run.py):
    the capacity when no budget is given; a budget above the capacity is refused with both figures."""
    if budget is None:
        return capacity_bytes
    budget_bytes = parse_budget(budget, baseline_peak_bytes)
    if capacity_bytes is not None and budget_bytes > capacity_bytes:
        raise BudgetError(f"{spell(Option.BUDGET, str(budget))} is {format_bytes(budget_bytes)}, above the device's "
                          f"capacity of {format_bytes(capacity_bytes)}: no step can use memory the device does not have",
                          tip=f"leave the budget out to fit the device, or give one at or under its capacity "
                              f"({spell(Option.BUDGET, str(capacity_bytes))})")
    return budget_bytes
