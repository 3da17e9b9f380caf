"""``apply(model, plan)``: wrap exactly the planned modules, reversibly."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from torch import nn

from ..errors import CandidateError, FingerprintMismatch, HandleError, PlanError
from ..plan.model import Boundary, Plan
from ..types import CheckpointMode
from ..profile.fingerprint import fingerprint
from .policy import SaveMatmulPolicy
from ..profile.segments import is_segment, segment_members
from .offload import HostInputSegmentWrapper, HostPool, OffloadWrapper
from .wrapper import CheckpointWrapper, SegmentPassthrough, SegmentWrapper

if TYPE_CHECKING:
    from ..plan.pipeline import PipelinePlan


def load_plan(plan: "Plan | PipelinePlan | str | Path", stage: int | None = None) -> Plan:
    """A Plan; from a per-stage pipeline plan (remat/plan/pipeline.py), the plan of ``stage``."""
    from ..plan.pipeline import PipelinePlan, load_any_plan
    if isinstance(plan, (str, Path)):
        plan = load_any_plan(plan)
    if isinstance(plan, PipelinePlan):
        if stage is None:
            raise PlanError(f"this is a pipeline plan with {len(plan.stages)} stages: pass the stage this rank owns",
                            tip="remat.apply(model, plan, stage=RANK_STAGE)")
        return plan.for_stage(stage)
    if isinstance(plan, Plan):
        if stage is not None:
            raise PlanError(f"stage={stage} was given, but the plan is a whole-model plan, not a pipeline plan")
        return plan
    raise PlanError(f"expected a remat Plan or a path to plan.json, got {type(plan).__name__}")


def check_plan_fingerprint(model: nn.Module, plan: Plan) -> None:
    """Raise :class:`FingerprintMismatch` listing what differs when ``plan`` was made for another model."""
    actual = fingerprint(model)
    diffs = plan.fingerprint.differences(actual)
    if diffs:
        shown = "".join(f"\n  - {d}" for d in diffs[:40]) + (f"\n  ... ({len(diffs) - 40} more)" if len(diffs) > 40 else "")
        exc = FingerprintMismatch(
            f"the plan was made for another model ({len(diffs)} difference(s), plan -> this model):{shown}",
            tip="re-run `remat plan` on this model, or pass check_fingerprint=False if you know the plan still fits",
        )
        exc.differences = [str(d) for d in diffs]  # type: ignore[attr-defined]  # the full list, for callers
        raise exc


def resolve_modules(model: nn.Module, paths: list[str]) -> dict[str, nn.Module]:
    """Module path -> module; :class:`CandidateError` naming the closest paths for an unknown one."""
    named = dict(model.named_modules(remove_duplicate=False))
    out: dict[str, nn.Module] = {}
    for path in paths:
        if path not in named:
            close = difflib.get_close_matches(path, list(named), n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise CandidateError(f"the plan names module {path!r}, which this model does not have{hint}",
                                 tip="list the model's modules with [n for n, _ in model.named_modules()]")
        out[path] = named[path]
    return out


def _check_not_nested(paths: list[str], covers: dict[str, list[str]] | None = None) -> None:
    """PlanError when two boundaries nest or overlap (a segment covers its members' subtrees)."""
    covers = covers or {}
    for outer in paths:
        for inner in paths:
            if inner == outer:
                continue
            if any(o == "" or i == o or i.startswith(o + ".")
                   for o in covers.get(outer, [outer]) for i in covers.get(inner, [inner])):
                raise PlanError(f"boundaries {outer!r} and {inner!r} are nested or overlap; a plan checkpoints "
                                "a module or its children, never both")


def boundary_module(model: nn.Module, name: str) -> nn.Module:
    """The module a boundary checkpoints; for a segment a transient ``nn.Sequential`` of its members (the
    same module objects, not re-parented): its revision covers every member's class and parameters."""
    members = boundary_members(model, name)
    return nn.Sequential(*(m for _, m in members)) if is_segment(name) else members[0][1]


def boundary_members(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """(path, module) a boundary checkpoints: the module itself, or a segment's members (NOTE [segments]).
    CandidateError for a module or segment the model does not have."""
    if is_segment(name):
        return segment_members(model, name)
    return list(resolve_modules(model, [name]).items())


class ApplyHandle:
    """What ``apply`` returns: the installed wrappers, and ``remove()`` to undo them exactly.

    Usable as a context manager (removes on exit). ``plan`` is None for a handle recovered
    from a copy of a planned model (:func:`recover_handle`).
    """

    def __init__(self, model: nn.Module, plan: Plan | None, wrappers: tuple[CheckpointWrapper, ...], *,
                 host_pool: HostPool | None = None) -> None:
        self.model = model
        self.plan = plan
        self.wrappers = wrappers
        # host bytes held by the offload boundaries (NOTE [activation offload]); a recovered handle's
        # wrappers keep their own pools
        self.host_pool = host_pool if host_pool is not None else HostPool()
        self._active = True

    @property
    def active(self) -> bool:
        return self._active

    def wrapper(self, path: str) -> CheckpointWrapper:
        for w in self.wrappers:
            if w.path == path:
                return w
        raise KeyError(path)

    def reset_counts(self) -> None:
        for w in self.wrappers:
            w.reset_counts()

    def remove(self, *, force: bool = False) -> None:
        """Restore every wrapped module's ``forward`` exactly (NOTE [instance forward]), all or nothing.

        Every wrapper is checked first: if any module's ``forward`` was replaced after
        ``apply`` (by hand, or by another library), :class:`HandleError` names them and
        *nothing* is changed: the handle stays active, every other module stays checkpointed.
        ``force=True`` restores every module still wrapped and leaves the replaced ones as they
        are now (the handle is then removed).
        """
        if not self._active:
            raise HandleError("this remat.apply handle was already removed")
        replaced = [w.path for w in self.wrappers if not w.installed]
        if replaced and not force:
            raise HandleError(
                f"cannot remove the plan exactly: the forward of {', '.join(repr(p) for p in replaced)} was replaced "
                "after remat.apply; nothing was changed and the handle is still active",
                tip="put the wrapper back (module.forward = handle.wrapper(path)) and remove again, or "
                    "handle.remove(force=True) to restore the other modules and leave those as they are")
        for w in reversed(self.wrappers):   # checked above: each uninstall is a plain attribute restore
            if w.installed:
                w.uninstall()
        self.host_pool.clear()   # the free host buffers go (NOTE [host buffer pool] in wrap/offload.py)
        self._active = False

    def __iter__(self) -> Iterator[CheckpointWrapper]:
        return iter(self.wrappers)

    def __enter__(self) -> "ApplyHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            self.remove()

    def __repr__(self) -> str:
        state = "active" if self._active else "removed"
        return f"ApplyHandle({len(self.wrappers)} wrappers, {state}: {', '.join(w.path for w in self.wrappers)})"


def recover_handle(model: nn.Module) -> ApplyHandle:
    """A handle for the remat wrappers found in ``model``, e.g. a ``copy.deepcopy`` or a ``torch.load``
    of a planned model (NOTE [copies of a planned model]); ``.remove()`` restores it exactly.
    An unplanned model gives a handle with no wrappers."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"recover_handle needs a torch.nn.Module, got {type(model).__name__}")
    found = []
    for path, module in model.named_modules(remove_duplicate=False):
        w = module.__dict__.get("forward")
        if isinstance(w, CheckpointWrapper) and w.module is module and w not in found:
            # the path in this model (a copy of a submodule has shorter paths)
            w.path = w.renamed(path) if isinstance(w, SegmentWrapper) else path
            found.append(w)
    return ApplyHandle(model, None, tuple(found))


def apply(model: nn.Module, plan: Plan | str | Path, *, check_fingerprint: bool = True,
          policy: SaveMatmulPolicy | None = None, stage: int | None = None) -> ApplyHandle:
    """Checkpoint exactly the modules ``plan`` lists; returns a handle whose ``remove()`` undoes it.

    ``plan`` is a :class:`~remat.plan.Plan` or a path to ``plan.json``. FULL boundaries use
    non-reentrant ``torch.utils.checkpoint``; SELECTIVE ones add the op policy ``policy``
    (default :class:`SaveMatmulPolicy`, NOTE [selective policy]); ``preserve_rng_state`` is the
    plan's. Raises :class:`FingerprintMismatch` if the plan was made for another model,
    :class:`CandidateError` for a module the model lacks, :class:`PlanError` if a planned
    module is already wrapped.
    """
    plan, members = _members_to_wrap(model, plan, check_fingerprint=check_fingerprint, stage=stage)
    pool = HostPool()   # host bytes of every offload boundary (NOTE [activation offload])
    wrappers = tuple(_wrapper(plan, b, members[b.module], policy, pool) for b in plan.boundaries)
    for w in wrappers:
        w.install()
    return ApplyHandle(model, plan, wrappers, host_pool=pool)


def _wrapper(plan: Plan, b: Boundary, members: list[tuple[str, nn.Module]], policy: SaveMatmulPolicy | None,
             pool: HostPool) -> CheckpointWrapper:
    """The one wrapper a boundary gets: a segment, an offload region, or a checkpointed module."""
    if is_segment(b.module) and b.mode is CheckpointMode.FULL_HOST_INPUT:   # NOTE [segment input on the host]
        return HostInputSegmentWrapper(members, b.module, pool, guarded=b.guarded,
                                       preserve_rng_state=plan.preserve_rng_state)
    if is_segment(b.module):
        return SegmentWrapper(members, b.module, b.mode, guarded=b.guarded, preserve_rng_state=plan.preserve_rng_state)
    if b.mode is CheckpointMode.OFFLOAD:
        return OffloadWrapper(members[0][1], b.module, pool)
    return CheckpointWrapper(members[0][1], b.module, b.mode, guarded=b.guarded,
                             preserve_rng_state=plan.preserve_rng_state, policy=policy)


def check_applies(model: nn.Module, plan: Plan) -> None:
    """Raise what :func:`apply` would raise for ``plan`` on ``model``, wrapping nothing."""
    _members_to_wrap(model, plan, check_fingerprint=True, stage=None)


def _members_to_wrap(model: nn.Module, plan: Plan | str | Path, *, check_fingerprint: bool,
                     stage: int | None) -> tuple[Plan, dict[str, list[tuple[str, nn.Module]]]]:
    """Every check :func:`apply` makes before it wraps anything: (the plan, each boundary's members)."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"remat.apply needs a torch.nn.Module, got {type(model).__name__}")
    plan = load_plan(plan, stage)   # a pipeline plan: the plan of the stage this rank owns
    if check_fingerprint:
        check_plan_fingerprint(model, plan)
    if plan.compile is not None and any(b.mode.holds_host for b in plan.boundaries):
        raise PlanError("this plan offloads activations and runs compiled: offload boundaries run eagerly only "
                        "(NOTE [activation offload])", tip="plan the compiled run without offload")
    single = [b.module for b in plan.boundaries if b.mode is CheckpointMode.FULL_HOST_INPUT and not is_segment(b.module)]
    if single:
        raise PlanError(f"boundary {single[0]!r} is a module in mode 'full-host-input', a segment mode "
                        "(NOTE [segment input on the host])",
                        tip="a module's input is offloaded by mode 'offload'; re-plan with remat plan --offload")
    paths = [b.module for b in plan.boundaries]
    members = {p: boundary_members(model, p) for p in paths}   # CandidateError for a missing module/segment
    _check_not_nested(paths, {p: [q for q, _ in ms] for p, ms in members.items() if is_segment(p)})
    seen: dict[int, str] = {}
    for path, ms in members.items():
        for mpath, module in ms:
            if id(module) in seen:
                raise PlanError(f"boundaries {seen[id(module)]!r} and {path!r} are the same module object")
            seen[id(module)] = path
            if isinstance(module.__dict__.get("forward"), (CheckpointWrapper, SegmentPassthrough)):
                raise PlanError(f"module {mpath!r} is already checkpointed by remat.apply; remove the first handle first")
    return plan, members

