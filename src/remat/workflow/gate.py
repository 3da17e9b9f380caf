"""The gate's thresholds: budget, reserve, tolerances and fixture limits, from the repository, never the receipt.

NOTE [gate thresholds]
A receipt is data from a pull request, so ``remat check`` does not let it say how strict the
check is. Each threshold comes from, first that gives it:
1. a command-line flag (``--budget``, ``--reserve``, ``--device-memory``, ``--peak-tolerance``,
   ``--saving-tolerance``, ``--time-tolerance``, ``--max-world-size``);
2. ``[tool.remat]`` in ``pyproject.toml`` in the current directory (``budget``, ``reserve``,
   ``device-memory``, ``peak-tolerance``, ``saving-tolerance``, ``time-tolerance``, ``max-seeds``,
   ``max-steps``, ``timeout``, ``max-world-size``): a file the repository's owners review like code;
3. budget, reserve and device memory only: the receipt's own, and only after the consistency checks pass
   (NOTE [receipt consistency] in workflow/consistency.py); the report says so;
4. remat's defaults (:data:`DEFAULTS`). A saving tolerance the receipt records is used when it
   is no looser than the default (a receipt may tighten the gate, never loosen it).
A budget here is bytes (``64MiB``): a percentage of the unmodified peak would move with the
model the gate is there to watch. Every threshold carries where it came from.
The world size is a pin, not a threshold: a receipt made at a world size is re-run by launching
that many processes, so a receipt whose ``world_size.world_size`` is above ``max-world-size``
(default: this machine's CPU cores, ``os.cpu_count()``) is refused before anything runs or
launches (a FIXTURE finding, exit 1), ``--quick`` or not; and the up-front estimate
(``fixture_plan`` in workflow/check.py) counts every process the check starts and every step
they run.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
from pathlib import Path
from typing import Any

from .._json import read_bounded_bytes
from ..errors import BudgetError, WorkloadError
from ..plan import parse_budget, parse_capacity, parse_reserve
from ..receipt.model import Receipt
from ..units import mib

PYPROJECT = "pyproject.toml"
MAX_WORLD_SIZE = 1 << 16    # the receipt schema's bound on a world size
MAX_PYPROJECT_BYTES = 2 ** 20


class Source(str, enum.Enum):
    """Where a threshold came from (NOTE [gate thresholds])."""

    FLAG = "command line"
    PROJECT = f"{PYPROJECT} [tool.remat]"
    RECEIPT = "the receipt (consistent; no repository value)"
    DEFAULT = "remat's default"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateSettings:
    """Thresholds as one source gives them; None: that source leaves it out."""

    budget: str | int | None = None          # bytes, or a size with a unit ("64MiB"); never a percentage
    reserve: str | float | None = None       # share of the budget kept free ("5%", 0.05)
    device_memory: str | int | None = None   # the device's capacity, bytes ("2GiB"): enforced on the CPU while checking
    peak_tolerance: str | float | None = None     # the measured peak may exceed the claimed one by this share
    saving_tolerance: str | float | None = None   # a boundary's measured saving may fall this share below its claim
    time_tolerance: str | float | None = None     # the overhead may exceed the claimed one by this share of the step
    max_seeds: int | None = None             # the largest equivalence fixture check runs (seeds)
    max_steps: int | None = None             # ... and steps per seed (also warm-up and timing steps)
    timeout_s: float | None = None           # the whole check (s)
    max_world_size: int | None = None        # the most ranks a world-size receipt may launch (default: CPU cores)

    def __post_init__(self) -> None:
        _check_budget(self.budget)
        if self.device_memory is not None:
            parse_capacity(self.device_memory)
        for name in ("reserve", "peak_tolerance", "saving_tolerance", "time_tolerance"):
            if getattr(self, name) is not None:
                parse_reserve(getattr(self, name))
        for name in ("max_seeds", "max_steps"):
            _check_count(name, getattr(self, name))
        _check_timeout(self.timeout_s)
        _check_world_size(self.max_world_size)


def _check_budget(budget: str | int | None) -> None:
    """A gate budget is bytes, never a share of the unmodified peak (NOTE [gate thresholds])."""
    if isinstance(budget, str) and budget.strip().endswith("%"):
        raise BudgetError(f"the gate's budget must be bytes, got {budget!r}",
                          tip="a percentage of the unmodified peak moves with the model: write e.g. 64MiB")
    if budget is not None:
        parse_budget(budget, 1)


def _check_count(name: str, v: Any) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 10_000):
        raise WorkloadError(f"{name.replace('_', '-')} must be an integer from 1 to 10000, got {v!r}")


def _check_world_size(v: Any) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WORLD_SIZE):
        raise WorkloadError(f"max-world-size must be an integer from 1 to {MAX_WORLD_SIZE}, got {v!r}")


def _check_timeout(t: Any) -> None:
    """Seconds, more than 0 and at most a week."""
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 7 * 86400):
        raise WorkloadError(f"timeout must be a number of seconds in (0, 604800], got {t!r}")


# the keys of [tool.remat] the gate reads, and the GateSettings field each sets
PROJECT_KEYS = {"budget": "budget", "reserve": "reserve", "device-memory": "device_memory",
                "peak-tolerance": "peak_tolerance",
                "saving-tolerance": "saving_tolerance", "time-tolerance": "time_tolerance",
                "max-seeds": "max_seeds", "max-steps": "max_steps", "timeout": "timeout_s",
                "max-world-size": "max_world_size"}
DEFAULTS = GateSettings(peak_tolerance=0.05, saving_tolerance=0.10, time_tolerance=0.10, max_seeds=10, max_steps=20,
                        timeout_s=3600.0, max_world_size=min(os.cpu_count() or 1, MAX_WORLD_SIZE))


def tool_remat(cwd: Path | None = None) -> dict[str, Any]:
    """The ``[tool.remat]`` table of ``pyproject.toml`` in ``cwd``; {} when there is none."""
    path = (cwd or Path.cwd()) / PYPROJECT
    if not path.is_file():
        return {}
    data = read_bounded_bytes(path, error=WorkloadError, what=PYPROJECT, max_bytes=MAX_PYPROJECT_BYTES)
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path} is not valid TOML: {exc}") from None
    tool = table.get("tool")
    remat = tool.get("remat") if isinstance(tool, dict) else None
    return remat if isinstance(remat, dict) else {}


def project_gate(cwd: Path | None = None) -> GateSettings:
    """The thresholds ``[tool.remat]`` gives (NOTE [gate thresholds]); a bad value is a WorkloadError naming the key."""
    table = tool_remat(cwd)
    given = {field: table[key] for key, field in PROJECT_KEYS.items() if key in table}
    try:
        return GateSettings(**given)
    except (BudgetError, WorkloadError) as exc:
        raise WorkloadError(f"{PYPROJECT} [tool.remat]: {exc.message}", tip=exc.tip) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Threshold:
    value: float
    source: Source

    def describe(self, name: str, shown: str) -> str:
        return f"{name} {shown} from {self.source}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Thresholds:
    """What the gate checks against, each with its source."""

    budget_bytes: Threshold
    reserve: Threshold
    peak_tolerance: Threshold
    saving_tolerance: Threshold
    time_tolerance: Threshold
    device_memory_bytes: Threshold | None = None   # None: no device capacity stated anywhere (NOTE [blocked receipt])

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.device_memory_bytes is None else int(self.device_memory_bytes.value)

    @property
    def effective_budget_bytes(self) -> int:
        """budget x (1 - reserve): what the re-measured peak must stay under (bytes)."""
        return int(self.budget_bytes.value * (1.0 - self.reserve.value))

    def describe(self) -> list[str]:
        device = [] if self.device_memory_bytes is None else \
            [self.device_memory_bytes.describe("device memory", mib(int(self.device_memory_bytes.value)))]
        return [self.budget_bytes.describe("budget", mib(int(self.budget_bytes.value))), *device,
                self.reserve.describe("reserve", f"{self.reserve.value:.0%}"),
                self.peak_tolerance.describe("peak tolerance", f"{self.peak_tolerance.value:.0%}"),
                self.saving_tolerance.describe("saving tolerance", f"{self.saving_tolerance.value:.0%}"),
                self.time_tolerance.describe("time tolerance", f"{self.time_tolerance.value:.0%} of the step")]


def first_given(field: str, flags: GateSettings, project: GateSettings) -> tuple[Any, Source] | None:
    """A setting from the command line, else from ``[tool.remat]``; None when neither gives it."""
    for settings, source in ((flags, Source.FLAG), (project, Source.PROJECT)):
        if getattr(settings, field) is not None:
            return getattr(settings, field), source
    return None


def _fraction(field: str, flags: GateSettings, project: GateSettings, fallback: Threshold) -> Threshold:
    given = first_given(field, flags, project)
    return fallback if given is None else Threshold(value=parse_reserve(given[0]), source=given[1])


def resolve_thresholds(receipt: Receipt, flags: GateSettings, project: GateSettings) -> Thresholds:
    """Each threshold from its first source (NOTE [gate thresholds]); call only on a consistent receipt."""
    d = receipt.decision
    budget = first_given("budget", flags, project)
    device = first_given("device_memory", flags, project)
    default_saving = float(DEFAULTS.saving_tolerance or 0.0)
    claimed = receipt.settings.saving_tolerance
    saving = Threshold(value=claimed, source=Source.RECEIPT) if claimed <= default_saving \
        else Threshold(value=default_saving, source=Source.DEFAULT)
    return Thresholds(
        budget_bytes=Threshold(value=d.budget_bytes, source=Source.RECEIPT) if budget is None
        else Threshold(value=parse_budget(budget[0], 1), source=budget[1]),
        reserve=_fraction("reserve", flags, project, Threshold(value=d.reserve, source=Source.RECEIPT)),
        peak_tolerance=_fraction("peak_tolerance", flags, project,
                                 Threshold(value=float(DEFAULTS.peak_tolerance or 0.0), source=Source.DEFAULT)),
        saving_tolerance=_fraction("saving_tolerance", flags, project, saving),
        time_tolerance=_fraction("time_tolerance", flags, project,
                                 Threshold(value=float(DEFAULTS.time_tolerance or 0.0), source=Source.DEFAULT)),
        device_memory_bytes=Threshold(value=parse_capacity(device[0]), source=device[1]) if device is not None
        else None if receipt.context.device_memory_bytes is None
        else Threshold(value=receipt.context.device_memory_bytes, source=Source.RECEIPT))


def limit(field: str, flags: GateSettings, project: GateSettings) -> Any:
    """A fixture limit or the timeout: the command line's, ``[tool.remat]``'s, else the default."""
    given = first_given(field, flags, project)
    return getattr(DEFAULTS, field) if given is None else given[0]
