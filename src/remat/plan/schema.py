"""The JSON schema of ``plan.json`` (NOTE [hostile JSON] in remat/_json.py).

A plan file may come from anywhere (a colleague, a pull request, an old run), so
:meth:`remat.plan.Plan.load` reads it through the hardened loader and checks it here before
building a :class:`~remat.plan.Plan`: exact types (``"guarded": "no"`` is refused, never read
as true), bounded figures, unknown fields refused. Receipts embed the same schema.
Nothing in a plan names code: module paths are looked up in ``model.named_modules()``.

Each object's schema is derived from its type's annotated fields (NOTE [codecs from the types] in
remat/_codec.py): the bounds live beside the fields they bound.
"""

from __future__ import annotations

from .._codec import schema
from .._json import AUTOCAST, DEVICE, DTYPE, MEMORY_SOURCE, MODE, MODULE_PATH, SHAPE
from ..measure.compile_spec import CompileSpec
from ..profile.model import SAMPLE, BlockedStep, ModelFingerprint
from .model import Boundary, Plan, PlanWorkload
from .offload import OffloadPricing

# the shared specs a receipt's schema uses too, and SampleRecord's own (its JSON is computed)
__all__ = ["AUTOCAST", "BLOCKED", "BOUNDARY", "COMPILE", "DEVICE", "DTYPE", "FINGERPRINT", "MEMORY_SOURCE", "MODE",
           "MODULE_PATH", "OFFLOAD", "PLAN", "SAMPLE", "SHAPE", "WORKLOAD"]

FINGERPRINT = schema(ModelFingerprint)
BOUNDARY = schema(Boundary)
COMPILE = schema(CompileSpec)   # how a plan runs compiled (NOTE [compiled arms])
OFFLOAD = schema(OffloadPricing)   # NOTE [offload cost model]; bandwidths in bytes per ms
WORKLOAD = schema(PlanWorkload)   # the workload a plan was made for (NOTE [plan workload])
BLOCKED = schema(BlockedStep)   # a blocked step's evidence (NOTE [blocked step])
# the optional fields are those older plan files may lack (their defaults in Plan)
PLAN = schema(Plan)
