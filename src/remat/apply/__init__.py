"""Wrap exactly the planned modules, reversibly (DESIGN.md: ``remat.apply``).

NOTE [callable package]
``remat.apply`` is both this subpackage and the function users call,
``remat.apply(model, plan)``. Once the subpackage is imported, Python binds the
attribute ``remat.apply`` to this *module object*, whatever ``remat.__getattr__`` would
have returned, so the module object itself must be callable: its class is swapped for
a ``ModuleType`` subclass whose ``__call__`` delegates to :func:`apply`. Either import
order then gives the same behaviour (tests/test_apply.py checks both).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .arm import PlanArm, apply_at_shape
from .export import PlanCheckFn, export_check_fn
from .handle import (ApplyHandle, apply, boundary_members, boundary_module, check_plan_fingerprint, load_plan, recover_handle,
                     resolve_modules)
from .policy import DEFAULT_SAVE_OPS, OpLevelPolicy, SaveMatmulPolicy, selective_context_fn
from .wrapper import CheckpointWrapper, RegionObserver, SegmentPassthrough, SegmentWrapper, restore_buffers

__all__ = ["ApplyHandle", "CheckpointWrapper", "DEFAULT_SAVE_OPS", "PlanArm", "PlanCheckFn", "RegionObserver", "SaveMatmulPolicy",
           "apply", "apply_at_shape", "check_plan_fingerprint", "export_check_fn", "load_plan", "recover_handle", "resolve_modules", "restore_buffers",
           "selective_context_fn", "OpLevelPolicy", "SegmentWrapper", "SegmentPassthrough", "boundary_members", "boundary_module"]


class _CallableModule(types.ModuleType):
    """``remat.apply(model, plan)`` on the package calls :func:`apply` (NOTE [callable package])."""

    def __call__(self, *args: Any, **kwargs: Any) -> ApplyHandle:
        return apply(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
