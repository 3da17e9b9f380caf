"""The receipt's schema, and loading a receipt safely.

A receipt is a file someone hands to CI, so it is read through remat's one hardened JSON
loader (NOTE [hostile JSON] in remat/_json.py: size and depth caps, duplicate keys, NaN,
overflowing numbers and huge integers refused) and then checked field by field against
:data:`remat.receipt.model.RECEIPT_SCHEMA` (exact types, bounded numbers and counts, unknown fields
refused) before any dataclass is built from it; every failure is a :class:`ReceiptError` naming the
JSON path. The receipt's own types carry their bounds in their annotations (receipt/model.py,
NOTE [codecs from the types] in remat/_codec.py); this module holds the loader, the limits and the
receipt's specs of the other stages' reports it embeds (a trace, a verification, a frontier).
Nothing in a receipt is imported, opened, unpickled or evaluated: ``remat
check`` runs the workload the *user* names and only compares the receipt's (NOTE
[workload spec policy] in remat/workflow/check.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import _json
from .._json import (BYTES, MS, SIGNED_BYTES, SIGNED_MS, Bool, Enum, Int, JsonValue, List, Map, Num, Obj, Opt,
                     Spec, Str, Tuple)
from ..errors import ReceiptError
from ..plan.schema import AUTOCAST, COMPILE, DEVICE, DTYPE, MEMORY_SOURCE, MODE, PLAN, SHAPE
from ..types import HazardKind

MAX_BYTES = _json.MAX_BYTES
RECEIPT_SCHEMA_VERSION = 1
RECEIPT_KIND = "remat-receipt"

# Repetition counts a receipt may ask `remat check` to run (RunSettings enforces the same bounds,
# so every receipt remat writes lies inside them): a count past these is not a setting, it is a hang.
MAX_STEPS = 1000
MAX_WARMUP = 100
MAX_SEEDS = 100
MAX_TRIES = 64


def parse_json_bounded(data: bytes | str, *, source: str = "receipt") -> Any:
    """Parse an untrusted receipt (NOTE [hostile JSON]); :class:`ReceiptError` on anything off."""
    return _json.parse_json(data, error=ReceiptError, source=source)


def read_json_file(path: Path | str) -> Any:
    return _json.read_json_file(path, error=ReceiptError, what="receipt file",
                                tip="remat receipt ... --out DIR writes DIR/receipt.json")


# -- the receipt's specs of what it embeds ---------------------------------------------------------

FRACTION = Num(0, 1)
HEX16 = Str(r"[0-9a-f]{16}", what="a string of 16 hex digits")
PHASE = Enum("batch", "forward", "backward", "optimizer")
RUN_MODE = Enum("train", "eval")   # verify.model.RunMode
# verify.model.Site: where a divergence showed first
SITE = Enum("forward call order", "forward output", "gradient", "buffer", "python attribute",
            "parameter after optimizer step", "generator state", "loss or outputs")
TEXT = Str(max_len=20_000)
SHORT = Str(max_len=2_000)
TOLERANCE = Obj({"rtol": Num(0), "atol": Num(0)})
HAZARD_KIND = Enum(*(k.value for k in HazardKind))
COUNT = Int(0, 2 ** 31)

TRACE_CONTEXT = Obj({"workload": SHORT, "shape": SHAPE, "dtype": DTYPE, "device": DEVICE, "torch_version": SHORT,
                     "python_version": SHORT, "threads": Int(0, 4096), "hostname": SHORT,
                     "warmup": Int(0, MAX_WARMUP), "steps": Int(0, MAX_STEPS)})
STEP_TRACE = Obj({
    "schema_version": Enum(1), "context": TRACE_CONTEXT, "memory_source": MEMORY_SOURCE, "peak_bytes": BYTES,
    "peak_phase": Opt(PHASE),
    "phases": List(Obj({"name": PHASE, "start_bytes": BYTES, "end_bytes": BYTES, "peak_bytes": BYTES,
                        "duration_ms": MS}), max_len=4),
    "categories_at_peak": Map(BYTES, key=r"[a-z_]{1,40}", max_len=20),
    "top_modules_at_peak": List(Obj({"module": SHORT, "bytes": BYTES}), max_len=1000),
    "step_peaks": List(BYTES, max_len=10_000), "step_ms": List(MS, max_len=10_000),
    "num_alloc_retries": COUNT, "reference_peak_bytes": Opt(BYTES),
    "timeline": List(Tuple(SIGNED_MS, BYTES, Opt(PHASE)), max_len=20_000),
    "boundary": Enum(None),   # the receipt keeps target and boundary traces side by side, not nested
})

ATTEMPT = Obj({"predicted_peak_bytes": SIGNED_BYTES, "measured_peak_bytes": BYTES, "margin_bytes": SIGNED_BYTES,
               "fits": Bool()})

VERIFY_STEP = Obj({
    "seed": COUNT, "step": COUNT, "mode": RUN_MODE,
    "loss": Tuple(Num(nonfinite=True), Num(nonfinite=True)), "outputs_max_abs": Opt(Num(nonfinite=True)),
    "grad_max_abs": Num(nonfinite=True), "grad_max_rel": Num(nonfinite=True), "grads_bitwise": Bool(),
    "grad_norm": Tuple(Num(nonfinite=True), Num(nonfinite=True)), "params_max_abs": Opt(Num(nonfinite=True)),
    "buffers_max_abs": Num(nonfinite=True), "bitwise": Bool(), "divergent": List(SHORT),
    "first_divergent_module": Opt(SHORT), "first_divergence": Opt(SITE), "passed": Bool(),
})
VERIFICATION = Obj({
    "schema_version": Enum(1), "passed": Bool(), "workload": SHORT, "shape": SHAPE, "device": DEVICE,
    "dtype": DTYPE, "planner": SHORT, "plan_digest": Str(r"[0-9a-f]{64}"), "steps": Int(1, MAX_STEPS), "seeds": List(COUNT, max_len=MAX_SEEDS),
    "tolerances": Map(TOLERANCE, key=r"[a-z0-9]{1,20}", max_len=20), "perturbation": Num(0),
    "per_step": List(VERIFY_STEP), "first_divergent_module": Opt(SHORT),
    "rng_policy": Obj({"preserve_rng_state": Bool(), "policy": Enum("preserve", "off"), "justification": TEXT,
                       "boundaries_drawing_rng": List(SHORT)}),
    "rng_overhead_ms": Opt(SIGNED_MS),
    "rng_timing": Opt(Obj({"with_ms": MS, "without_ms": MS, "overhead_ms": SIGNED_MS, "with_p95_ms": MS,
                           "without_p95_ms": MS, "steps": Int(0, MAX_STEPS)})),
    "hazards": List(Obj({"module": SHORT, "kind": HAZARD_KIND, "detail": TEXT, "mode": RUN_MODE, "seed": COUNT,
                         "step": COUNT})),
    "negative_controls": List(Obj({"name": SHORT, "applicable": Bool(), "rejected": Opt(Bool()), "detail": TEXT})),
    "boundaries": List(Obj({"module": SHORT, "mode": MODE, "guarded": Bool(),
                            "forward_calls": Map(COUNT, max_len=4), "replay_calls": Map(COUNT, max_len=4),
                            "draws_rng": Bool(), "replay_mutations": List(TEXT), "device_moves": List(TEXT)})),
    "repeatable": Bool(), "failures": List(TEXT), "warnings": List(TEXT),
}, {"compile": Opt(COMPILE), "autocast": Opt(AUTOCAST)})

OVERHEAD_INTERVAL = Obj({"pct": Num(), "low_pct": Opt(Num()), "high_pct": Opt(Num()), "resolved": Bool(),
                         "samples": COUNT})
FRONTIER_POINT = Obj({
    "plan": SHORT, "planner": SHORT, "decision": Enum("ship", "reject", "infeasible", "failed"), "reason": TEXT,
    "peak_bytes": Opt(BYTES), "p50_ms": Opt(MS), "p95_ms": Opt(MS), "boundaries": List(SHORT),
    "overhead_pct": Opt(Num()), "capacity": Opt(COUNT), "samples_per_s": Opt(Num(0)), "fits": Bool(),
    "pareto": Bool(), "step_ms": List(MS),
}, {
    "plan_budget_bytes": Opt(SIGNED_BYTES), "predicted_peak_bytes": Opt(SIGNED_BYTES),
    "memory_source": Opt(MEMORY_SOURCE),
    "predicted_overhead_ms": Opt(SIGNED_MS), "predicted_step_ms": Opt(SIGNED_MS),
    "num_alloc_retries": Opt(COUNT), "capacity_p50_ms": Opt(MS), "compile": Opt(COMPILE), "compile_s": Opt(Num(0, 1e7)),
    "overhead_interval": Opt(OVERHEAD_INTERVAL),
    "capacity_search": Opt(Obj({
        "key": SHORT, "capacity": COUNT, "resolved": Bool(), "capped": Bool(), "limit_bytes": SIGNED_BYTES,
        "tries": List(Obj({"value": Int(-2 ** 31, 2 ** 31), "peak_bytes": Opt(BYTES), "oom": Bool(), "error": Opt(TEXT)}),
                      max_len=1000),
        "note": TEXT})),
})
FRONTIER = Obj({
    "schema_version": Enum(1), "context": Map(JsonValue(), max_len=200), "budget_bytes": Int(1, 2 ** 53),
    "reserve": Num(0, 0.999999), "effective_budget_bytes": SIGNED_BYTES, "capacity_key": SHORT, "control": SHORT,
    "shipped": Opt(SHORT), "points": List(FRONTIER_POINT, max_len=200), "shipped_plan": Opt(PLAN),
}, {
    "budget_search": List(Obj({"ratio": Num(0, 1), "peak_bytes": Opt(BYTES), "fits": Bool(),
                               "compile_s": Opt(Num(0, 1e7)), "error": Opt(TEXT)}), max_len=100),
})

def validate(data: Any, spec: Spec, *, root: str = "$") -> None:
    """Raise :class:`ReceiptError` at the first place ``data`` breaks ``spec``."""
    _json.validate(data, spec, error=ReceiptError, what="receipt", root=root)


