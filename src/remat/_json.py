"""The one loader for every JSON file remat reads, and the small schema language that checks it.

NOTE [hostile JSON]
Receipts, plans, distributed configs and reports, and the files ranks leave behind are
all read as untrusted data, through :func:`read_json_file` / :func:`parse_json`:
- the file must be a regular file; it is read as bytes with a size cap (never read whole:
  at most ``max_bytes + 1`` bytes), and decoded as UTF-8;
- before parsing, one linear scan rejects nesting deeper than ``max_depth``, so no
  recursion (ours or ``json``'s) ever depends on the input;
- ``json`` parses with duplicate keys refused (``{"a": 1, "a": 2}`` could show a reviewer
  one value and the checker another), ``NaN``/``Infinity`` refused, float literals that
  overflow (``1e400`` would silently become ``inf``) refused, and integer literals longer
  than :data:`MAX_INT_DIGITS` refused before ``int()`` ever sees them (a 5000-digit integer
  costs quadratic time to convert, and ``10**400`` breaks every float formatting later);
- the caller then checks the value against a schema (``Int``, ``Num``, ``Str``, ``Bool``,
  ``List``, ``Obj``...): exact types (``"false"`` is not ``false``, ``1`` is not ``true``),
  bounded numbers, counts and lengths, and unknown keys rejected, before any dataclass is
  built from it.
Nothing read this way is imported, opened, unpickled or evaluated by remat. Each failure is
raised as the caller's typed error (``ReceiptError`` for receipts, ``PlanError`` for plans,
``DistributedError`` for run files), naming the JSON path and what was expected
(``$.plan.boundaries[2].revision: expected a string of 16 hex digits, got int 7``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from .errors import RematError
from .types import MODULE_PATH_RE, CheckpointMode, MemorySource

MAX_BYTES = 16 * 2 ** 20     # a receipt with three 2000-point timelines is well under 1 MiB
MAX_DEPTH = 32               # the deepest a real receipt goes is about 8
MAX_LIST = 100_000
MAX_STR = 100_000
MAX_INT_DIGITS = 20          # every integer remat writes fits in 64 bits (19 digits and a sign)

# Bounds that every figure remat writes lies well inside; a value outside them is not a
# measurement, and would overflow float formatting or run a loop for ever downstream.
MAX_BYTES_FIGURE = 2 ** 53   # 8 PiB, and exact as a float
MAX_ABS_INT = 2 ** 53
MAX_MS = 1e9                 # 11.6 days, for one step
MAX_ABS_NUM = 1e15


class SchemaViolation(Exception):
    """Raised by a :class:`Spec`; :func:`validate` turns it into the caller's typed error."""


# -- bounded JSON ----------------------------------------------------------------------------------

def nesting_depth(text: str, limit: int = MAX_DEPTH) -> int:
    """Deepest ``[``/``{`` nesting of JSON ``text`` (strings skipped); stops early past ``limit``."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


class _Refused(Exception):
    """Raised by the parse hooks; carries the message for the caller's error type."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"duplicate key {k[:60]!r} in one JSON object: the file must mean one thing")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON: remat writes non-finite numbers as the strings 'inf'/'nan'")


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text)} characters ({text[:12]}...): no figure remat writes is that large")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} overflows a float")
    return value


def parse_json(data: bytes | str, *, error: type[RematError], source: str, max_bytes: int = MAX_BYTES,
               max_depth: int = MAX_DEPTH) -> Any:
    """Parse untrusted JSON (NOTE [hostile JSON]); ``error`` (a RematError class) on anything off."""
    if isinstance(data, bytes):
        if len(data) > max_bytes:
            raise error(f"{source} is over {max_bytes} bytes: not a file remat wrote")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{source} is not UTF-8 text: {exc}") from exc
    else:
        text = data
        if len(text) > max_bytes:
            raise error(f"{source} is over {max_bytes} characters: not a file remat wrote")
    if nesting_depth(text, max_depth) > max_depth:
        raise error(f"{source} nests JSON deeper than {max_depth} levels: not a file remat wrote")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_int=_bounded_int, parse_float=_finite_float)
    except _Refused as exc:
        raise error(f"{source}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{source} is not valid JSON (truncated or corrupt?): {exc.msg} at line {exc.lineno} "
                    f"column {exc.colno}") from None
    except (RecursionError, ValueError, OverflowError) as exc:  # belt and braces: the hooks bound both
        raise error(f"{source} could not be parsed: {type(exc).__name__}: {str(exc)[:200]}") from None


def read_bounded_bytes(path: Path | str, *, error: type[RematError], what: str, max_bytes: int = MAX_BYTES,
                       tip: str | None = None) -> bytes:
    """A regular file's bytes, at most ``max_bytes`` (``error`` past that): never reads more than ``max_bytes + 1``."""
    path = Path(path)
    try:
        if not path.is_file():   # also refuses FIFOs and devices (/dev/zero would never end)
            raise error(f"{what} not found (or not a regular file): {path}", tip=tip)
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise error(f"{what} {path} is over {max_bytes} bytes: not a file remat wrote")
    return data


def read_json_file(path: Path | str, *, error: type[RematError], what: str, max_bytes: int = MAX_BYTES,
                   max_depth: int = MAX_DEPTH, tip: str | None = None) -> Any:
    """Read and parse a JSON file (NOTE [hostile JSON]); never reads more than ``max_bytes + 1`` bytes."""
    data = read_bounded_bytes(path, error=error, what=what, max_bytes=max_bytes, tip=tip)
    return parse_json(data, error=error, source=str(path), max_bytes=max_bytes, max_depth=max_depth)


# -- the schema language ---------------------------------------------------------------------------

def show(v: Any) -> str:
    """A short, safe rendering of an offending value for error messages."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10 ** 30:
        return f"int of {len(str(abs(v)))} digits"
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


class Spec:
    """One JSON value's contract. Override :meth:`check`."""

    what = "a value"

    def check(self, v: Any, path: str) -> None:
        raise NotImplementedError

    def fail(self, v: Any, path: str, what: str | None = None) -> SchemaViolation:
        return SchemaViolation(f"{path}: expected {what or self.what}, got {show(v)}")


class Int(Spec):
    """An integer (never a bool) in ``[lo, hi]``; both bounds default to +-2**53."""

    def __init__(self, lo: int = -MAX_ABS_INT, hi: int = MAX_ABS_INT) -> None:
        self.lo, self.hi = lo, hi
        self.what = f"an integer in [{lo}, {hi}]"

    def check(self, v: Any, path: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
            raise self.fail(v, path)


class Num(Spec):
    """A finite number in ``[lo, hi]``; ``nonfinite=True`` also admits the strings ``inf``, ``-inf``,
    ``nan`` (verify's encoding of non-finite differences)."""

    def __init__(self, lo: float = -MAX_ABS_NUM, hi: float = MAX_ABS_NUM, *, nonfinite: bool = False) -> None:
        self.lo, self.hi, self.nonfinite = lo, hi, nonfinite
        self.what = f"a number in [{lo:g}, {hi:g}]"

    def check(self, v: Any, path: str) -> None:
        if self.nonfinite and isinstance(v, str) and v in ("inf", "-inf", "nan"):
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(v, path)
        # compare before any float conversion: a huge int must fail the range, not overflow
        if isinstance(v, float) and not math.isfinite(v):
            raise self.fail(v, path)
        if not self.lo <= v <= self.hi:
            raise self.fail(v, path)


class Str(Spec):
    def __init__(self, pattern: str | None = None, *, max_len: int = MAX_STR, what: str | None = None) -> None:
        self.re = re.compile(pattern) if pattern else None
        self.max_len = max_len
        self.what = what or ("a string" + (f" matching {pattern}" if pattern else f" of at most {max_len} characters"))

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, str) or len(v) > self.max_len:
            raise self.fail(v, path)
        if self.re is not None and not self.re.fullmatch(v):
            raise self.fail(v, path)


class Bool(Spec):
    what = "true or false"

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, bool):
            raise self.fail(v, path)


class Enum(Spec):
    def __init__(self, *values: Any) -> None:
        self.values = values
        self.what = "one of " + ", ".join(repr(x) for x in values)

    def check(self, v: Any, path: str) -> None:
        # exact types: 1 == True and 1.0 == 1 in Python, but not in a schema
        if not any(type(v) is type(x) and v == x for x in self.values):
            raise self.fail(v, path)


class Opt(Spec):
    """``null`` or ``inner``."""

    def __init__(self, inner: Spec) -> None:
        self.inner = inner
        self.what = f"null or {inner.what}"

    def check(self, v: Any, path: str) -> None:
        if v is not None:
            self.inner.check(v, path)


class AnyOf(Spec):
    def __init__(self, *options: Spec) -> None:
        self.options = options
        self.what = " or ".join(o.what for o in options)

    def check(self, v: Any, path: str) -> None:
        for o in self.options:
            try:
                o.check(v, path)
                return
            except SchemaViolation:
                continue
        raise self.fail(v, path)


class List(Spec):
    def __init__(self, item: Spec, *, max_len: int = MAX_LIST, min_len: int = 0) -> None:
        self.item, self.max_len, self.min_len = item, max_len, min_len
        self.what = f"a list of {item.what}"

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, list) or not self.min_len <= len(v) <= self.max_len:
            raise self.fail(v, path, f"a list of {self.min_len}..{self.max_len} items")
        for i, x in enumerate(v):
            self.item.check(x, f"{path}[{i}]")


class Tuple(Spec):
    """A fixed-length list with one spec per position (timeline points: ``[t_ms, bytes, phase]``)."""

    def __init__(self, *items: Spec) -> None:
        self.items = items
        self.what = f"a list of {len(items)} items"

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, list) or len(v) != len(self.items):
            raise self.fail(v, path)
        for i, (x, s) in enumerate(zip(v, self.items)):
            s.check(x, f"{path}[{i}]")


class Map(Spec):
    """An object used as a mapping: any keys matching ``key`` (a pattern), values ``value``."""

    def __init__(self, value: Spec, *, key: str = r".{1,200}", max_len: int = 10_000) -> None:
        self.value, self.key, self.max_len = value, re.compile(key, re.S), max_len
        self.what = f"an object of at most {max_len} entries of {value.what}"

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, dict) or len(v) > self.max_len:
            raise self.fail(v, path)
        for k, x in v.items():
            if not self.key.fullmatch(k):
                raise SchemaViolation(f"{path}: key {k[:60]!r} does not match {self.key.pattern}")
            self.value.check(x, f"{path}.{k}")


class Obj(Spec):
    """An object with named fields: every ``required`` one present, ``optional`` ones allowed,
    any other field refused (a field remat does not read is a field a reviewer cannot trust)."""

    def __init__(self, required: dict[str, Spec], optional: dict[str, Spec] | None = None) -> None:
        self.required, self.optional = required, optional or {}
        self.what = "an object"

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, dict):
            raise self.fail(v, path)
        missing = [k for k in self.required if k not in v]
        if missing:
            raise SchemaViolation(f"{path}: missing field(s) {', '.join(missing)}")
        unknown = sorted(k for k in v if k not in self.required and k not in self.optional)
        if unknown:
            shown = ", ".join(repr(k[:40]) for k in unknown[:5])
            raise SchemaViolation(f"{path}: unknown field(s) {shown}")
        for k, s in self.required.items():
            s.check(v[k], f"{path}.{k}")
        for k, s in self.optional.items():
            if k in v:
                s.check(v[k], f"{path}.{k}")


class JsonValue(Spec):
    """Any JSON value (free-form context): strings, lists and numbers bounded; depth is bounded by the loader."""

    what = "a JSON value"

    def check(self, v: Any, path: str) -> None:
        if v is None or isinstance(v, bool):
            return
        if isinstance(v, str):
            if len(v) > MAX_STR:
                raise self.fail(v, path, f"a string of at most {MAX_STR} characters")
            return
        if isinstance(v, int):
            if abs(v) > MAX_ABS_INT:
                raise self.fail(v, path, f"an integer of magnitude at most {MAX_ABS_INT}")
            return
        if isinstance(v, float):
            if not math.isfinite(v) or abs(v) > MAX_ABS_NUM:
                raise self.fail(v, path, f"a finite number of magnitude at most {MAX_ABS_NUM:g}")
            return
        if isinstance(v, list):
            if len(v) > MAX_LIST:
                raise self.fail(v, path, f"a list of at most {MAX_LIST} items")
            for i, x in enumerate(v):
                self.check(x, f"{path}[{i}]")
            return
        if isinstance(v, dict):
            for k, x in v.items():
                self.check(x, f"{path}.{k}")
            return
        raise self.fail(v, path)


def validate(data: Any, spec: Spec, *, error: type[RematError], what: str, root: str = "$") -> None:
    """Raise ``error("malformed <what>: <path>: expected ...")`` at the first place ``data`` breaks ``spec``."""
    try:
        spec.check(data, root)
    except SchemaViolation as exc:
        raise error(f"malformed {what}: {exc}") from None


# Shared field specs: every stage's schema uses the same bounds for the same kind of figure.
BYTES = Int(0, MAX_BYTES_FIGURE)
SIGNED_BYTES = Int(-MAX_BYTES_FIGURE, MAX_BYTES_FIGURE)
MS = Num(0, MAX_MS)
SIGNED_MS = Num(-MAX_MS, MAX_MS)
SHORT = Str(max_len=2_000)
TEXT = Str(max_len=20_000)
HEX64 = Str(r"[0-9a-f]{64}", what="a sha256 hex digest")
# a module path, or a segment of a container's children (NOTE [segments] in remat/profile/segments.py)
# (NOTE [module names] in remat/types.py: any name torch accepts but ".", "[", "]" and controls)
MODULE_PATH = Str(f"{MODULE_PATH_RE}(\\[[0-9]{{1,6}}:[0-9]{{1,6}}\\])?|\\[[0-9]{{1,6}}:[0-9]{{1,6}}\\]",
                  max_len=500, what="a module path (names joined by '.') or a segment (container[start:stop])")
MODE = Enum(*(m.value for m in CheckpointMode if m is not CheckpointMode.KEEP))   # one list: CheckpointMode less keep
MEMORY_SOURCE = Enum(*(s.value for s in MemorySource))   # one list: remat.types.MemorySource
MAX_MODULES = 100_000
# Shape keywords: JSON scalars; an integer shape past 2**31 is no training step, and
# remat check validates each value against the factory's annotation before calling it.
SHAPE = Map(AnyOf(Bool(), Int(-2 ** 31, 2 ** 31), Num(-2 ** 31, 2 ** 31), Str(max_len=200)),
            key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100)
DTYPE = Enum("float32", "bfloat16", "float16")
DEVICE = Str(r"cpu|cuda(:[0-9]{1,3})?", what="cpu or cuda[:N]")
AUTOCAST = Enum("bfloat16", "float16")   # the forward ran under torch.autocast (NOTE [autocast steps])


def json_kind(data: Any) -> Any:
    """The ``"kind"`` field of a parsed JSON object (None for anything else): what a reader that accepts
    several document types (a plan or a pipeline plan) dispatches on."""
    return data.get("kind") if isinstance(data, dict) else None
