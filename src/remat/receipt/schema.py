"""Loading a receipt safely: bounded plain JSON, then a small strict schema check.

NOTE [hostile receipts]
A receipt is a file someone hands to CI, so ``load`` treats it as untrusted data:
- it is read as bytes with a size cap (:data:`MAX_BYTES`) and decoded as UTF-8;
- before parsing, one linear scan rejects nesting deeper than :data:`MAX_DEPTH` (the
  deepest a real receipt goes is about 8), so no recursion ever depends on the input;
- ``json`` parses it with duplicate keys refused (``{"a": 1, "a": 2}`` could show a
  reviewer one value and the checker another) and ``NaN``/``Infinity`` refused;
- every field is then checked against :data:`RECEIPT_SCHEMA` (types, ranges, string
  patterns, list lengths) before any dataclass is built from it.
Nothing is unpickled or evaluated. The one thing ``remat check`` *does* import is the
workload spec the receipt names (the user's own training code, by design); see NOTE
[workload spec policy] in check.py for what a receipt may name.

The schema language is a handful of small classes (``Int``, ``Num``, ``Str``, ``List``,
``Obj``...), each with one ``check(value, path)`` that raises :class:`ReceiptError` naming
the JSON path and what was expected (``$.plan.boundaries[2].revision: expected a string of
16 hex digits, got int 7``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

from ..errors import ReceiptError
from ..types import HazardKind

MAX_BYTES = 16 * 2 ** 20     # a receipt with three 2000-point timelines is well under 1 MiB
MAX_DEPTH = 32
MAX_LIST = 100_000
MAX_STR = 100_000

RECEIPT_SCHEMA_VERSION = 1
RECEIPT_KIND = "remat-receipt"


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


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ReceiptError(f"duplicate key {k!r} in one JSON object: a receipt must mean one thing")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ReceiptError(f"{name} is not JSON: a receipt writes non-finite numbers as the strings 'inf'/'nan'")


def parse_json_bounded(data: bytes | str, *, source: str = "receipt") -> Any:
    """Parse untrusted JSON (NOTE [hostile receipts]); :class:`ReceiptError` on anything off."""
    if isinstance(data, bytes):
        if len(data) > MAX_BYTES:
            raise ReceiptError(f"{source} is {len(data)} bytes; a receipt is at most {MAX_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ReceiptError(f"{source} is not UTF-8 text: {exc}") from exc
    else:
        text = data
        if len(text) > MAX_BYTES:
            raise ReceiptError(f"{source} is {len(text)} characters; a receipt is at most {MAX_BYTES}")
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise ReceiptError(f"{source} nests JSON deeper than {MAX_DEPTH} levels: not a remat receipt")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except ReceiptError:
        raise
    except json.JSONDecodeError as exc:
        raise ReceiptError(f"{source} is not valid JSON (truncated or corrupt?): {exc.msg} at line {exc.lineno} "
                           f"column {exc.colno}") from exc
    except (RecursionError, ValueError) as exc:  # belt and braces: the scan above bounds depth
        raise ReceiptError(f"{source} could not be parsed: {type(exc).__name__}: {exc}") from exc


def read_json_file(path: Path | str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ReceiptError(f"receipt file not found: {path}", tip="remat receipt ... --out DIR writes DIR/receipt.json")
    with path.open("rb") as f:
        data = f.read(MAX_BYTES + 1)
    return parse_json_bounded(data, source=str(path))


# -- the schema language ---------------------------------------------------------------------------

def _show(v: Any) -> str:
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 60 else r[:57] + '...'}"


class Spec:
    """One JSON value's contract. Override :meth:`check`."""

    what = "a value"

    def check(self, v: Any, path: str) -> None:
        raise NotImplementedError

    def fail(self, v: Any, path: str, what: str | None = None) -> ReceiptError:
        return ReceiptError(f"malformed receipt: {path}: expected {what or self.what}, got {_show(v)}")


class Int(Spec):
    def __init__(self, lo: int | None = None, hi: int | None = None) -> None:
        self.lo, self.hi = lo, hi
        self.what = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")

    def check(self, v: Any, path: str) -> None:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(v, path)
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise self.fail(v, path)


class Num(Spec):
    """A number; ``nonfinite=True`` also admits the strings ``inf``, ``-inf``, ``nan`` (verify's encoding)."""

    def __init__(self, lo: float | None = None, hi: float | None = None, *, nonfinite: bool = False) -> None:
        self.lo, self.hi, self.nonfinite = lo, hi, nonfinite
        self.what = "a number" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")

    def check(self, v: Any, path: str) -> None:
        if self.nonfinite and v in ("inf", "-inf", "nan"):
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(v, path)
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise self.fail(v, path)


class Str(Spec):
    def __init__(self, pattern: str | None = None, *, max_len: int = MAX_STR, what: str | None = None) -> None:
        self.re = re.compile(pattern) if pattern else None
        self.max_len = max_len
        self.what = what or ("a string" + (f" matching {pattern}" if pattern else ""))

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
        if isinstance(v, bool) and not any(isinstance(x, bool) for x in self.values):
            raise self.fail(v, path)
        if v not in self.values:
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
            except ReceiptError:
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
        self.what = f"an object of {value.what}"

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, dict) or len(v) > self.max_len:
            raise self.fail(v, path)
        for k, x in v.items():
            if not self.key.fullmatch(k):
                raise ReceiptError(f"malformed receipt: {path}: key {k[:60]!r} does not match {self.key.pattern}")
            self.value.check(x, f"{path}.{k}")


class Obj(Spec):
    """An object with named fields. ``extra=True`` admits fields the schema does not name:
    the stage reports a receipt embeds (trace, plan, verify, frontier) may grow fields, which
    their ``from_json`` ignores; the receipt's own objects admit none."""

    def __init__(self, required: dict[str, Spec], optional: dict[str, Spec] | None = None, *,
                 extra: bool = False) -> None:
        self.required, self.optional, self.extra = required, optional or {}, extra
        self.what = "an object"

    def check(self, v: Any, path: str) -> None:
        if not isinstance(v, dict):
            raise self.fail(v, path)
        missing = [k for k in self.required if k not in v]
        if missing:
            raise ReceiptError(f"malformed receipt: {path}: missing field(s) {', '.join(missing)}")
        if not self.extra:
            unknown = sorted(k for k in v if k not in self.required and k not in self.optional)
            if unknown:
                shown = ", ".join(repr(k[:40]) for k in unknown[:5])
                raise ReceiptError(f"malformed receipt: {path}: unknown field(s) {shown}")
        for k, s in self.required.items():
            s.check(v[k], f"{path}.{k}")
        for k, s in self.optional.items():
            if k in v:
                s.check(v[k], f"{path}.{k}")


class JsonValue(Spec):
    """Any JSON value (free-form context). Depth is already bounded by the loader."""

    what = "a JSON value"

    def check(self, v: Any, path: str) -> None:
        if v is None or isinstance(v, (bool, str)):
            if isinstance(v, str) and len(v) > MAX_STR:
                raise self.fail(v, path, f"a string of at most {MAX_STR} characters")
            return
        if isinstance(v, (int, float)):
            if isinstance(v, float) and not math.isfinite(v):
                raise self.fail(v, path, "a finite number")
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


# -- the receipt's schema --------------------------------------------------------------------------

BYTES = Int(0)
MS = Num(0)
FRACTION = Num(0, 1)
HEX16 = Str(r"[0-9a-f]{16}", what="a string of 16 hex digits")
MODULE_PATH = Str(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", max_len=500, what="a module path (dotted identifiers)")
SHAPE = Map(AnyOf(Bool(), Int(), Num(), Str(max_len=200)), key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100)
DTYPE = Enum("float32", "bfloat16", "float16")
DEVICE = Str(r"cpu|cuda(:[0-9]{1,3})?", what="cpu or cuda[:N]")
PHASE = Enum("batch", "forward", "backward", "optimizer")
MEMORY_SOURCE = Enum("cuda-allocator", "cpu-live-tensors", "simulated")
MODE = Enum("full", "selective")
TEXT = Str(max_len=20_000)
SHORT = Str(max_len=2_000)
TOLERANCE = Obj({"rtol": Num(0), "atol": Num(0)})
HAZARD_KIND = Enum(*(k.value for k in HazardKind))

TRACE_CONTEXT = Obj({"workload": SHORT, "shape": SHAPE, "dtype": DTYPE, "device": DEVICE, "torch_version": SHORT,
                     "python_version": SHORT, "threads": Int(0), "hostname": SHORT, "warmup": Int(0),
                     "steps": Int(0)})
STEP_TRACE = Obj({
    "schema_version": Enum(1), "context": TRACE_CONTEXT, "memory_source": MEMORY_SOURCE, "peak_bytes": BYTES,
    "peak_phase": Opt(PHASE),
    "phases": List(Obj({"name": PHASE, "start_bytes": BYTES, "end_bytes": BYTES, "peak_bytes": BYTES,
                        "duration_ms": MS}), max_len=4),
    "categories_at_peak": Map(BYTES, key=r"[a-z_]{1,40}", max_len=20),
    "top_modules_at_peak": List(Obj({"module": SHORT, "bytes": BYTES}), max_len=1000),
    "step_peaks": List(BYTES, max_len=10_000), "step_ms": List(MS, max_len=10_000),
    "num_alloc_retries": Int(0), "reference_peak_bytes": Opt(BYTES),
    "timeline": List(Tuple(Num(), BYTES, Opt(PHASE)), max_len=20_000),
    "boundary": Enum(None),   # the receipt keeps target and boundary traces side by side, not nested
}, extra=True)

FINGERPRINT = Obj({
    "digest": Str(r"[0-9a-f]{64}", what="a sha256 hex digest"),
    "modules": List(Tuple(Str(r"[A-Za-z0-9_.]*", max_len=500), SHORT)),
    "params": List(Obj({"name": Str(max_len=500), "shape": List(Int(0), max_len=16), "dtype": SHORT})),
    "class_source_hashes": List(Tuple(SHORT, Str(r"[0-9a-f]{16}"))),
})
PLAN = Obj({
    "planner": SHORT, "budget_bytes": Opt(BYTES), "reserve": Num(0, 0.999999),
    "boundaries": List(Obj({"module": MODULE_PATH, "mode": MODE, "saved_bytes": Int(), "replay_ms": Num(),
                            "guarded": Bool()}), max_len=10_000),
    "excluded": List(Obj({"module": Str(max_len=500), "reason": TEXT}), max_len=10_000),
    "predicted_peak_bytes": Int(), "predicted_overhead_ms": Num(), "baseline_peak_bytes": BYTES,
    "baseline_step_ms": Num(), "fingerprint": FINGERPRINT, "preserve_rng_state": Bool(),
    "measured_peak_bytes": Opt(BYTES), "measured_step_ms": Opt(Num()), "memory_source": SHORT,
    "simulated": Bool(), "device_model": Opt(SHORT), "schema_version": Enum(1),
}, extra=True)

FIXTURE = Obj({
    "name": SHORT, "seeds": List(Int(0, 10_000), min_len=1, max_len=100), "steps": Int(1, 1000),
    "modes": List(Enum("train", "eval"), max_len=2), "dtype": DTYPE, "tolerance": TOLERANCE,
    "parameters": List(Str(max_len=500), max_len=10_000), "passed": Opt(Bool()),
    "forward_calls_per_step": Opt(Int(0)), "replay_calls_per_step": Opt(Int(0)), "draws_rng": Opt(Bool()),
    "negative_controls": List(SHORT, max_len=20),
})
BOUNDARY = Obj({
    "module": MODULE_PATH, "class_name": SHORT, "mode": MODE, "guarded": Bool(), "revision": HEX16,
    "predicted_saving_bytes": Int(), "measured_saving_bytes": Int(), "saving_tolerance": Num(0, 1),
    "replay_ms": MS, "fixture": FIXTURE,
})
ATTEMPT = Obj({"predicted_peak_bytes": Int(), "measured_peak_bytes": BYTES, "margin_bytes": Int(), "fits": Bool()})

VERIFY_STEP = Obj({
    "seed": Int(0), "step": Int(0), "mode": Enum("train", "eval"),
    "loss": Tuple(Num(nonfinite=True), Num(nonfinite=True)), "outputs_max_abs": Opt(Num(nonfinite=True)),
    "grad_max_abs": Num(nonfinite=True), "grad_max_rel": Num(nonfinite=True), "grads_bitwise": Bool(),
    "grad_norm": Tuple(Num(nonfinite=True), Num(nonfinite=True)), "params_max_abs": Opt(Num(nonfinite=True)),
    "buffers_max_abs": Num(nonfinite=True), "bitwise": Bool(), "divergent": List(SHORT),
    "first_divergent_module": Opt(SHORT), "first_divergence": Opt(SHORT), "passed": Bool(),
})
VERIFICATION = Obj({
    "schema_version": Enum(1), "passed": Bool(), "workload": SHORT, "shape": SHAPE, "device": DEVICE,
    "dtype": DTYPE, "planner": SHORT, "plan_digest": Str(r"[0-9a-f]{64}"), "steps": Int(1), "seeds": List(Int(0)),
    "tolerances": Map(TOLERANCE, key=r"[a-z0-9]{1,20}", max_len=20), "perturbation": Num(0),
    "per_step": List(VERIFY_STEP), "first_divergent_module": Opt(SHORT),
    "rng_policy": Obj({"preserve_rng_state": Bool(), "policy": SHORT, "justification": TEXT,
                       "boundaries_drawing_rng": List(SHORT)}),
    "rng_overhead_ms": Opt(Num()),
    "rng_timing": Opt(Obj({"with_ms": Num(), "without_ms": Num(), "overhead_ms": Num(), "with_p95_ms": Num(),
                           "without_p95_ms": Num(), "steps": Int(0)})),
    "hazards": List(Obj({"module": SHORT, "kind": HAZARD_KIND, "detail": TEXT, "mode": SHORT, "seed": Int(0),
                         "step": Int(0)})),
    "negative_controls": List(Obj({"name": SHORT, "applicable": Bool(), "rejected": Opt(Bool()), "detail": TEXT})),
    "boundaries": List(Obj({"module": SHORT, "mode": SHORT, "guarded": Bool(),
                            "forward_calls": Map(Int(0), max_len=4), "replay_calls": Map(Int(0), max_len=4),
                            "draws_rng": Bool(), "replay_mutations": List(TEXT), "device_moves": List(TEXT)})),
    "repeatable": Bool(), "failures": List(TEXT), "warnings": List(TEXT),
}, extra=True)

FRONTIER_POINT = Obj({
    "plan": SHORT, "planner": SHORT, "decision": Enum("ship", "reject", "infeasible", "failed"), "reason": TEXT,
    "peak_bytes": Opt(BYTES), "p50_ms": Opt(MS), "p95_ms": Opt(MS), "boundaries": List(SHORT),
    "overhead_pct": Opt(Num()), "capacity": Opt(Int(0)), "samples_per_s": Opt(Num(0)), "fits": Bool(),
    "pareto": Bool(), "step_ms": List(MS),
}, {
    "plan_budget_bytes": Opt(Int()), "predicted_peak_bytes": Opt(Int()), "memory_source": Opt(SHORT),
    "num_alloc_retries": Opt(Int(0)), "capacity_p50_ms": Opt(MS),
    "capacity_search": Opt(Obj({
        "key": SHORT, "capacity": Int(0), "resolved": Bool(), "capped": Bool(), "limit_bytes": Int(),
        "tries": List(Obj({"value": Int(), "peak_bytes": Opt(BYTES), "oom": Bool(), "error": Opt(TEXT)}),
                      max_len=1000),
        "note": TEXT})),
}, extra=True)   # the frontier may grow fields; FrontierPoint.from_json ignores those it lacks
FRONTIER = Obj({
    "schema_version": Enum(1), "context": Map(JsonValue(), max_len=200), "budget_bytes": Int(1),
    "reserve": Num(0, 0.999999), "effective_budget_bytes": Int(), "capacity_key": SHORT, "control": SHORT,
    "shipped": Opt(SHORT), "points": List(FRONTIER_POINT, max_len=200), "shipped_plan": Opt(PLAN),
}, extra=True)

REJECTED = Obj({"plan": SHORT, "decision": SHORT, "reason": TEXT, "peak_bytes": Opt(BYTES), "p50_ms": Opt(MS)})
DECISION = Obj({
    "status": Enum("ship", "no-plan"), "shipped": Opt(SHORT), "boundaries": List(SHORT),
    "budget_bytes": Int(1), "reserve": Num(0, 0.999999), "effective_budget_bytes": Int(),
    "control_peak_bytes": Opt(BYTES), "shipped_peak_bytes": Opt(BYTES), "clears": Bool(), "headroom_bytes": Opt(Int()),
    "reserve_left": Opt(Num()), "control_p50_ms": Opt(MS), "shipped_p50_ms": Opt(MS), "overhead_pct": Opt(Num()),
    "verified": Opt(Bool()), "rejected": List(REJECTED, max_len=200), "why": List(TEXT, max_len=50),
})

CONTEXT = Obj({
    "workload": Str(max_len=4096), "shape": SHAPE, "resolved_shape": SHAPE, "boundary_shape": Opt(SHAPE),
    "dtype": DTYPE, "device": DEVICE, "torch_version": SHORT, "python_version": SHORT, "platform": SHORT,
    "hostname": SHORT, "cpu_count": Opt(Int(0)), "threads": Int(0), "remat_version": SHORT,
    "git_revision": Opt(Str(r"[0-9a-f]{7,64}")), "git_dirty": Opt(Bool()), "created": SHORT, "command": TEXT,
    "memory_source": MEMORY_SOURCE,
})
SETTINGS = Obj({
    "trace_warmup": Int(1), "trace_steps": Int(1), "verify_steps": Int(1), "verify_seeds": Int(1),
    "verify_timing_steps": Int(0), "frontier_plans": List(SHORT, max_len=100), "frontier_steps": Int(1),
    "frontier_warmup": Int(1), "capacity_key": Opt(SHORT), "capacity_tries": Int(1), "capacity_steps": Int(1),
    "saving_tolerance": Num(0, 1), "saving_warmup": Int(1), "note": TEXT,
})
UNSUPPORTED = Obj({"mode": SHORT, "status": Enum("not run", "unsupported"), "detail": TEXT})

RECEIPT_SCHEMA = Obj({
    "schema_version": Int(),   # checked first, for a precise message (load_receipt)
    "kind": Enum(RECEIPT_KIND),
    "context": CONTEXT,
    "settings": SETTINGS,
    "traces": Obj({"target": STEP_TRACE, "boundary": Opt(STEP_TRACE), "planned": Opt(STEP_TRACE)}),
    "plan": Obj({"label": Opt(SHORT), "plan": Opt(PLAN), "boundaries": List(BOUNDARY, max_len=10_000),
                 "control_held_bytes": Opt(BYTES), "closed_loop": List(ATTEMPT, max_len=100),
                 "closed_loop_boundaries": List(SHORT), "note": TEXT}),
    "verification": Opt(VERIFICATION),
    "verification_note": TEXT,
    "frontier": Opt(FRONTIER),
    "decision": DECISION,
    "unsupported": List(UNSUPPORTED, max_len=100),
})


def validate(data: Any, spec: Spec = RECEIPT_SCHEMA, *, root: str = "$") -> None:
    """Raise :class:`ReceiptError` at the first place ``data`` breaks ``spec``."""
    spec.check(data, root)


def check_version(data: Any, supported: Iterable[int] = (RECEIPT_SCHEMA_VERSION,)) -> int:
    if not isinstance(data, dict):
        raise ReceiptError(f"malformed receipt: the top level must be a JSON object, got {_show(data)}")
    if data.get("kind", RECEIPT_KIND) != RECEIPT_KIND:
        raise ReceiptError(f"not a remat receipt: kind is {_show(data.get('kind'))}, expected {RECEIPT_KIND!r}")
    v = data.get("schema_version")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ReceiptError(f"malformed receipt: $.schema_version: expected an integer, got {_show(v)}")
    if v not in tuple(supported):
        raise ReceiptError(f"receipt schema_version {v} is not supported (this remat reads "
                           f"{', '.join(str(s) for s in supported)})",
                           tip="re-create the receipt with this remat (`remat receipt ...`), or use the remat "
                               "version that wrote it")
    return v
