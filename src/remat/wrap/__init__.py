"""Wrap exactly the planned modules, reversibly (docs/DESIGN.md: the *apply* stage).

The stage is named ``remat.wrap`` so that ``remat.apply`` is only ever the plain function
``remat.apply(model, plan)`` (:func:`remat.wrap.handle.apply`), whatever was imported first.
"""

from __future__ import annotations

from .arm import PlanArm, apply_at_shape
from .export import PlanCheckFn, export_check_fn
from .handle import (ApplyHandle, apply, boundary_members, boundary_module, check_applies, check_plan_fingerprint, load_plan, recover_handle,
                     resolve_modules)
from .policy import DEFAULT_SAVE_OPS, OpLevelPolicy, SaveMatmulPolicy, selective_context_fn
from .wrapper import CheckpointWrapper, RegionObserver, SegmentPassthrough, SegmentWrapper, restore_buffers

__all__ = ["ApplyHandle", "CheckpointWrapper", "DEFAULT_SAVE_OPS", "PlanArm", "PlanCheckFn", "RegionObserver", "SaveMatmulPolicy",
           "apply", "apply_at_shape", "check_applies", "check_plan_fingerprint", "export_check_fn", "load_plan", "recover_handle", "resolve_modules", "restore_buffers",
           "selective_context_fn", "OpLevelPolicy", "SegmentWrapper", "SegmentPassthrough", "boundary_members", "boundary_module"]

