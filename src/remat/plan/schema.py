"""The JSON schema of ``plan.json`` (NOTE [hostile JSON] in remat/_json.py).

A plan file may come from anywhere (a colleague, a pull request, an old run), so
:meth:`remat.plan.Plan.load` reads it through the hardened loader and checks it here before
building a :class:`~remat.plan.Plan`: exact types (``"guarded": "no"`` is refused, never read
as true), bounded figures, unknown fields refused. Receipts embed the same schema.
Nothing in a plan names code: module paths are looked up in ``model.named_modules()``.
"""

from __future__ import annotations

from ..types import MODULE_PATH_RE, CheckpointMode, MemorySource, Phase
from .._json import BYTES, MS, SIGNED_BYTES, SIGNED_MS, AnyOf, Bool, Enum, Int, List, Map, Num, Obj, Opt, Str, Tuple

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

# remat.profile.ModelFingerprint.to_json
FINGERPRINT = Obj({
    "digest": HEX64,
    "modules": List(Tuple(Str(f"(?:{MODULE_PATH_RE})?", max_len=500), SHORT), max_len=MAX_MODULES),
    "params": List(Obj({"name": Str(max_len=500), "shape": List(Int(0, 2 ** 40), max_len=16), "dtype": SHORT}),
                   max_len=MAX_MODULES),
    "class_source_hashes": List(Tuple(SHORT, Str(r"[0-9a-f]{16}")), max_len=MAX_MODULES),
}, {"structural_classes": List(SHORT, max_len=MAX_MODULES)})

BOUNDARY = Obj({"module": MODULE_PATH, "mode": MODE, "saved_bytes": SIGNED_BYTES, "replay_ms": SIGNED_MS},
               {"guarded": Bool()})

# remat.measure.CompileSpec.to_json: how a plan runs compiled (NOTE [compiled arms])
COMPILE = Obj({"backend": Enum("inductor", "aot_eager", "eager"), "memory_budget": Opt(Num(0, 1))})

# remat.plan.offload.OffloadPricing.to_json (NOTE [offload cost model]); bandwidths in bytes per ms
OFFLOAD = Obj({"d2h_bytes_per_ms": Num(1e-9, 1e15), "h2d_bytes_per_ms": Num(1e-9, 1e15),
               "overlaps_compute": Bool(), "host_budget_bytes": Opt(BYTES), "source": SHORT})
# Shape keywords: JSON scalars; an integer shape past 2**31 is no training step, and
# remat check validates each value against the factory's annotation before calling it.
SHAPE = Map(AnyOf(Bool(), Int(-2 ** 31, 2 ** 31), Num(-2 ** 31, 2 ** 31), Str(max_len=200)),
            key=r"[A-Za-z_][A-Za-z0-9_]{0,99}", max_len=100)
DTYPE = Enum("float32", "bfloat16", "float16")
DEVICE = Str(r"cpu|cuda(:[0-9]{1,3})?", what="cpu or cuda[:N]")
AUTOCAST = Enum("bfloat16", "float16")   # the forward ran under torch.autocast (NOTE [autocast steps])
# remat.plan.PlanWorkload.to_json: the workload a plan was made for (NOTE [plan workload])
WORKLOAD = Obj({"spec": Str(max_len=4096), "shape": SHAPE, "device": DEVICE, "dtype": DTYPE, "autocast": Opt(AUTOCAST)})
# remat.profile.model.SampleRecord.to_json: the steps a plan was made and measured on (NOTE [step sample])
SAMPLE = Obj({
    "steps": Int(1, 64), "boundary_shapes": List(SHAPE, max_len=16),
    "points": List(Obj({"shape": SHAPE, "offset": Int(0, 2 ** 40), "seed": Opt(Int(0, 2 ** 40))}), max_len=64 * 17),
    "point_peaks": List(BYTES, max_len=64 * 17),
    "peak_spread": Opt(Obj({"min": BYTES, "median": BYTES, "max": BYTES})),
})

# remat.profile.model.BlockedStep.to_json: a blocked step's evidence (NOTE [blocked step])
BLOCKED = Obj({
    "refusal": Opt(Obj({
        "capacity_bytes": BYTES, "requested_bytes": BYTES, "live_bytes": BYTES,
        "phase": Opt(Enum(*(p.value for p in Phase))),
        "by_kind": Opt(Obj({k: BYTES for k in ("parameters", "gradients", "optimizer_state", "saved_activations",
                                               "other")})),
    })),
    "target_batch": Int(2, 2 ** 40), "profiled_batches": List(Int(1, 2 ** 40), max_len=2, min_len=1),
    "verified_batch": Int(1, 2 ** 40), "rule": Enum("affine", "proportional"),
})

# Plan.to_json; the optional fields are those older plan files may lack (Plan.from_json's defaults).
PLAN = Obj({
    "schema_version": Enum(1),
    "planner": SHORT, "budget_bytes": Opt(Int(1, 2 ** 53)), "reserve": Num(0, 0.999999),
    "boundaries": List(BOUNDARY, max_len=10_000),
    "excluded": List(Obj({"module": Str(max_len=500), "reason": TEXT}), max_len=MAX_MODULES),
    "predicted_peak_bytes": SIGNED_BYTES, "predicted_overhead_ms": SIGNED_MS, "baseline_peak_bytes": BYTES,
    "baseline_step_ms": MS, "fingerprint": FINGERPRINT,
}, {
    "preserve_rng_state": Bool(), "measured_peak_bytes": Opt(BYTES), "measured_step_ms": Opt(MS),
    "memory_source": MEMORY_SOURCE, "simulated": Bool(), "device_model": Opt(SHORT),
    "compile": Opt(COMPILE), "offload": Opt(OFFLOAD), "workload": Opt(WORKLOAD), "sample": Opt(SAMPLE),
    "blocked": Opt(BLOCKED),
})
