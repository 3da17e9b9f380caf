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
they run. A ``max-world-size`` from ``[tool.remat]`` is capped by this machine's CPU cores (a
shared CI runner must not be oversubscribed by a file a pull request may edit along with the
receipt); only ``--max-world-size`` on the command line goes above them.

NOTE [gate pins]
The thresholds above say how strict the check is; the pins say *what* it re-measures. Without
them the receipt chooses: halve its batch size (and every figure with it) and check re-measures
the smaller step, which of course clears. ``[tool.remat]`` may pin, each compared with the
receipt before anything is loaded, measured or launched (a PIN finding, exit 1, in well under a
second):
- ``shape = {batch_size = 32, ...}``: each keyword's value in the receipt's resolved shape
  (defaults included), compared by value and type (``true`` is not ``1``);
- ``dtype = "float32"``: the receipt's dtype (aliases: fp32, bf16, fp16);
- ``autocast = "none" | "bf16" | "fp16"``: the autocast the step ran under ("none": without);
  ``remat check --autocast`` pins the same on the command line and wins over the file;
- ``world-size = N``: the world size the receipt was made at (1: a single-process receipt).
The largest fixture is pinned by ``max-seeds`` / ``max-steps`` and the most ranks by
``max-world-size`` (above). :class:`Pins` holds them; :func:`pin_findings` compares.
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


def max_world_size(flags: GateSettings, project: GateSettings) -> tuple[int, str]:
    """(the most ranks check may launch, where that came from): the flag's; else ``[tool.remat]``'s capped by
    this machine's CPU cores; else the cores (NOTE [gate thresholds])."""
    cores = min(os.cpu_count() or 1, MAX_WORLD_SIZE)
    if flags.max_world_size is not None:
        return flags.max_world_size, str(Source.FLAG)
    if project.max_world_size is not None:
        if project.max_world_size > cores:
            return cores, (f"{Source.PROJECT}'s {project.max_world_size}, capped by this machine's {cores} CPU cores; "
                           "--max-world-size goes above them")
        return project.max_world_size, str(Source.PROJECT)
    return cores, f"this machine's {cores} CPU cores"


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


# -- pins (NOTE [gate pins]) ---------------------------------------------------------------------------

NO_AUTOCAST = "none"
PIN_KEYS = ("shape", "dtype", "autocast", "world-size")
_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16", "float64": "float64", "fp64": "float64"}
MAX_PIN_KEYS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pins:
    """What the repository requires the receipt to have been made at; None: not pinned (NOTE [gate pins])."""

    shape: dict[str, int | float | str | bool] | None = None   # resolved-shape keywords and their values
    dtype: str | None = None              # canonical: float32, bfloat16, float16, float64
    autocast: str | None = None           # canonical autocast dtype, or NO_AUTOCAST
    world_size: int | None = None         # ranks (1: a single-process receipt)
    source: Source = Source.PROJECT

    @classmethod
    def parse(cls, table: dict[str, Any], source: Source = Source.PROJECT) -> "Pins":
        """Pins from ``[tool.remat]``-style keys; a bad value is a WorkloadError naming the key."""
        return cls(shape=_pin_shape(table.get("shape")), dtype=_pin_dtype(table.get("dtype")),
                   autocast=_pin_autocast(table.get("autocast")), world_size=_pin_world_size(table.get("world-size")),
                   source=source)

    def describe(self) -> list[str]:
        out = [] if self.shape is None else ["shape " + ", ".join(f"{k}={v!r}" for k, v in self.shape.items())]
        out += [] if self.dtype is None else [f"dtype {self.dtype}"]
        out += [] if self.autocast is None else [f"autocast {self.autocast}"]
        out += [] if self.world_size is None else [f"world size {self.world_size}"]
        return out


def _pin_shape(v: Any) -> dict[str, int | float | str | bool] | None:
    if v is None:
        return None
    if not isinstance(v, dict) or not v or len(v) > MAX_PIN_KEYS:
        raise WorkloadError(f"shape must be a table of shape keywords (shape = {{batch_size = 32}}), got {str(v)[:60]!r}")
    for k, x in v.items():
        ok = isinstance(x, (bool, str)) or (isinstance(x, int) and abs(x) < 2 ** 31) or \
            (isinstance(x, float) and x == x and abs(x) != float("inf"))
        if not k.isidentifier() or not ok or (isinstance(x, str) and len(x) > 256):
            raise WorkloadError(f"shape keyword {k[:40]!r} = {str(x)[:40]!r}: a keyword needs a number, string or "
                                "boolean value")
    return dict(v)


def _pin_dtype(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or v.lower() not in _DTYPE_NAMES:
        raise WorkloadError(f"dtype {str(v)[:40]!r} is not one of {', '.join(sorted(set(_DTYPE_NAMES.values())))}")
    return _DTYPE_NAMES[v.lower()]


def _pin_autocast(v: Any) -> str | None:
    """``"none"``: pinned to no autocast; bf16/fp16 (or their long names); None: not pinned."""
    if v is None:
        return None
    if isinstance(v, str) and v.lower() == NO_AUTOCAST:
        return NO_AUTOCAST
    from ..workload import parse_autocast
    if not isinstance(v, str):
        raise WorkloadError(f"autocast must be \"none\", \"bf16\" or \"fp16\", got {str(v)[:40]!r}")
    return parse_autocast(v)


def _pin_world_size(v: Any) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WORLD_SIZE):
        raise WorkloadError(f"world-size must be an integer from 1 to {MAX_WORLD_SIZE}, got {v!r}")
    return v


def project_pins(cwd: Path | None = None) -> Pins:
    """The pins ``[tool.remat]`` gives (NOTE [gate pins]); a bad value is a WorkloadError naming the key."""
    table = tool_remat(cwd)
    try:
        return Pins.parse({k: table[k] for k in PIN_KEYS if k in table})
    except WorkloadError as exc:
        raise WorkloadError(f"{PYPROJECT} [tool.remat]: {exc.message}", tip=exc.tip) from None


def merge_pins(flags: Pins | None, project: Pins) -> Pins:
    """Each pin from the command line when it gives one, else from ``[tool.remat]``."""
    if flags is None:
        return project
    return Pins(shape=flags.shape if flags.shape is not None else project.shape,
                dtype=flags.dtype or project.dtype, autocast=flags.autocast or project.autocast,
                world_size=flags.world_size or project.world_size,
                source=Source.FLAG if any(getattr(flags, f) is not None for f in ("shape", "dtype", "autocast",
                                                                                 "world_size")) else project.source)


def pin_mismatches(pins: Pins, *, resolved_shape: dict[str, Any], dtype: str, autocast: str | None,
                   world_size: int) -> list[str]:
    """What a receipt made at these conditions does not match, one line each ([]: within every pin)."""
    out = []
    for k, want in (pins.shape or {}).items():
        have = resolved_shape.get(k, "<absent>")
        if type(have) is not type(want) or have != want:
            out.append(f"shape keyword {k} is {have!r} in the receipt; the repository pins {want!r}")
    if pins.dtype is not None and _DTYPE_NAMES.get(str(dtype).lower(), dtype) != pins.dtype:
        out.append(f"dtype is {dtype} in the receipt; the repository pins {pins.dtype}")
    if pins.autocast is not None and (autocast or NO_AUTOCAST) != pins.autocast:
        out.append(f"autocast is {autocast or NO_AUTOCAST} in the receipt; the repository pins {pins.autocast}")
    if pins.world_size is not None and world_size != pins.world_size:
        out.append(f"world size is {world_size} in the receipt; the repository pins {pins.world_size}")
    return out
