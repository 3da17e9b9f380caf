"""``PlanArm``: a remat plan as a measurement arm (remat.measure), applied to each fresh build."""

from __future__ import annotations

import torch

from ..errors import PlanError
from ..measure import Arm, CompileSpec, Undo
from ..plan.model import Plan
from ..workload.loader import LoadedWorkload
from .handle import ApplyHandle, apply


class PlanArm(Arm):
    """A remat plan applied to the fresh build (NOTE [plans at other shapes]); no boundaries: the control."""

    def __init__(self, label: str, plan: Plan | None, *, compile: CompileSpec | None = None) -> None:
        # a plan made with --compile runs compiled wherever it is measured
        super().__init__(label, compile=compile if compile is not None else (plan.compile if plan else None))
        self.plan = plan
        self._checked = False   # the full fingerprint (with class sources) was checked once

    def prepare(self, fresh: LoadedWorkload) -> Undo | None:
        if self.plan is None or not self.plan.boundaries:
            return None
        handle = apply_at_shape(fresh.workload.model, self.plan, full_check=not self._checked)
        self._checked = True
        return handle.remove


# NOTE [plans at other shapes]
# The capacity search rebuilds the workload at other values of a shape keyword and
# applies the *same* plan (same boundaries, same modes) to each build: the question is
# "which batch does this plan unlock", not "what would a re-plan at that batch choose".
# A plan's fingerprint covers module paths and classes, parameter names, shapes and
# dtypes, and class sources, so it does not change with batch size. A keyword that
# changes parameter shapes (gpt's ``seq_len`` sizes the position embedding ``wpe``)
# changes the digest; then the plan is re-applied *by module path* with the digest check
# off, but only after checking that the module tree (every path and its class) is the
# plan's, so every boundary names the same kind of module. A keyword that changes the
# module tree (e.g. ``n_layer``) raises PlanError, which the capacity search records as a
# stopping note. The first application of a plan (``full_check``) compares the whole
# fingerprint, class sources included; later rebuilds of the same workload in the same
# process reuse the same classes, so they compare only the module tree (hashing every
# class's source costs a fraction of a second a build). The first application is the solo
# peak at the base shape, so a plan made for another model is still refused there, with
# ``FingerprintMismatch``.

def apply_at_shape(model: torch.nn.Module, plan: Plan, *, full_check: bool = True) -> ApplyHandle:
    """Apply ``plan`` to a build of its workload (NOTE [plans at other shapes]).

    ``full_check=True``: the whole fingerprint must match (use it at the plan's own shape);
    otherwise only the module tree must, and parameter shapes may differ.
    """
    if full_check:
        return apply(model, plan)  # FingerprintMismatch lists what differs
    modules = tuple((name, type(m).__qualname__) for name, m in model.named_modules())
    if modules != tuple(plan.fingerprint.modules):
        diffs = [f"{n} ({c})" for n, c in sorted(set(modules) ^ set(plan.fingerprint.modules))][:6]
        raise PlanError(f"the module tree differs from the one the plan was made for: {', '.join(diffs)}")
    return apply(model, plan, check_fingerprint=False)
