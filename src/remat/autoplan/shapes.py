"""The runtime shape guard on ``remat.auto``'s handle: a batch larger than any planned one is never silent.

NOTE [shape guard]
A plan holds at the shapes it was profiled and measured at; activations grow with the batch
and the sequence (planned on seq 64, a padded batch at seq 128 peaked at 1.69x the budget).
The handle records the *planned envelope*: for each tensor rank (ndim) among the example
batch's tensor leaves (several example batches: all of theirs), the largest size in each
dimension. A forward pre-hook on the root module compares the tensor arguments of every call
with it: a tensor of rank n larger in some dimension than every planned tensor of rank n is a
*new shape*. Every dimension is taken to move the peak (batch, sequence and image sizes all
scale the activations; remat cannot tell a dimension that does not without measuring it, and
REPLAN measures). Not compared: a tensor of a rank the example batch has none of (one built
inside ``loss_fn``), 0-d tensors and non-tensors (no size to grow). The hook walks the call's
arguments and looks the shapes up in a set: it allocates no tensor, and a call at shapes
judged before is not compared again. A call with autograd off (``torch.no_grad``, inference
mode: evaluation) saves nothing for backward, so it is not checked.

What then happens is ``on_new_shape`` (:class:`ShapePolicy`):
- WARN (the default): a :class:`NewShapeWarning` naming the planned and the seen shapes, once
  per new shape: a shape inside one warned of already (every dimension at most the largest
  warned) does not warn again, so padded batches of many lengths warn only as the longest grows;
  the step runs with the plan as it is (it may miss the budget there).
- RAISE: :class:`~remat.errors.NewShapeError` at every call at a new shape, before the forward.
- REPLAN: plan again for the envelope grown to the seen shapes (max per dimension), on the
  example batch with each tensor leaf tiled (its values repeated) along the dimensions that
  grew (:func:`grow_batch`), exactly as ``remat.auto`` plans (profile copies, closed loop, the
  plan cache: its key holds the batch shapes, so each envelope is its own cache bucket and a
  later ``remat.auto`` at that envelope is a cache hit); the old wrappers are removed and the
  new plan applied before this forward runs. Calls inside the grown envelope are covered by it
  (a plan that fits at a larger shape fits at a smaller one), so they neither warn nor re-plan.
  The handle keeps a reference to the example batch for this (its bytes stay allocated).

WARN is the default, and each alternative costs more: RAISE ends a long run at its first longer
batch; REPLAN plans inside the training step with the user's state live (on CPU nothing can be
parked: the step that re-planned after an unfreeze peaked at 2.11x the budget, NOTE [trainable
guard]) and pays a whole planning at each growth.
The cheap path is to declare the largest shapes up front: ``remat.ExampleBatches(...)``, whose
planned envelope is the largest of the example batches, so no step inside it warns.

NOTE [trainable guard]
A plan also holds only for the parameters that train: a frozen parameter gets no gradient and
a frozen prefix of the model saves nothing for backward, so a fine-tune that planned with its
lower half frozen and unfroze it after 10 steps ran 1.76x over budget on each of the next 20
steps, silently (the plan cache keys on ``requires_grad``, the running handle did not look).
So the same pre-hook records which parameters trained when the plan was made
(``requires_grad`` of every parameter, in ``model.parameters()`` order) and compares at every
forward with autograd on (one pass over the parameters' flags; no tensor is touched). A
difference is handled by the same ``on_new_shape`` policy: WARN a :class:`TrainableChangedWarning`
naming how many parameters (and bytes of them) started and stopped training, once per
trainable set; RAISE :class:`~remat.errors.TrainableChangedError` before the forward; REPLAN
plan again at the current envelope with the current trainable set (its cache key differs, so
it is planned anew; the next switch back is a cache hit). Any re-plan records the set it was
made for. Measured (tests/test_dynamic_depth.py, an 8-block encoder planned with its input
layer and lower 4 blocks frozen under 4,000,000 bytes, then all unfrozen; torch.profiler's
step peaks): WARN warns once and the steps run at 1.64x the budget; REPLAN re-plans at the
first forward and the next steps run at 0.81x. The step that re-plans holds the planning's
own copies in its peak (2.11x there), as a REPLAN at a new shape does.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import AutoError, NewShapeError, TrainableChangedError
from ..units import fmt_bytes

Shape = tuple[int, ...]


class ShapePolicy(enum.Enum):
    """What the handle does at a call larger than any planned shape (NOTE [shape guard]), or after the
    trainable parameters changed (NOTE [trainable guard])."""

    WARN = "warn"
    RAISE = "raise"
    REPLAN = "replan"

    @classmethod
    def parse(cls, value: "ShapePolicy | str") -> "ShapePolicy":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise AutoError(f"on_new_shape={value!r}: expected one of {', '.join(p.value for p in cls)}",
                            tip="remat.ShapePolicy.WARN (the default), RAISE or REPLAN; or the strings") from None


class NewShapeWarning(UserWarning):
    """The model was called at a shape larger than any ``remat.auto`` planned for: the plan may miss its budget."""


class TrainableChangedWarning(UserWarning):
    """Parameters started or stopped training after ``remat.auto`` planned: the plan may miss its budget
    (NOTE [trainable guard])."""


Trainable = tuple[bool, ...]    # requires_grad of every parameter, in model.parameters() order


def trainable_flags(model: nn.Module) -> Trainable:
    return tuple(p.requires_grad for p in model.parameters())


def describe_trainable_change(model: nn.Module, planned: Trainable, now: Trainable) -> str:
    """How many parameters (and bytes) started and stopped training since ``planned``."""
    params = list(model.parameters())
    started = [p for p, a, b in zip(params, planned, now) if b and not a]
    stopped = [p for p, a, b in zip(params, planned, now) if a and not b]
    size = sum(p.numel() * p.element_size() for p in started)
    out = f"{len(started)} parameter(s) ({fmt_bytes(size)}) started training and {len(stopped)} stopped"
    if len(planned) != len(now):
        out += f"; the model has {len(now)} parameters, {len(planned)} when planned"
    return out


def tensor_shapes(tree: Any) -> tuple[Shape, ...]:
    """The shapes of the tensor leaves of ``tree`` with at least one dimension, in leaf order."""
    return tuple(tuple(t.shape) for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0)


@dataclasses.dataclass(frozen=True)
class ShapeEnvelope:
    """Per tensor rank, the largest size planned in each dimension (NOTE [shape guard])."""

    dims: dict[int, Shape]     # rank -> per-dimension max, e.g. {2: (4, 64)} for (4, 64) token ids

    @classmethod
    def of(cls, shapes: Iterable[Shape]) -> "ShapeEnvelope":
        dims: dict[int, Shape] = {}
        for s in shapes:
            old = dims.get(len(s))
            dims[len(s)] = s if old is None else tuple(max(a, b) for a, b in zip(old, s))
        return cls(dims)

    @classmethod
    def of_batches(cls, batches: Iterable[Any]) -> "ShapeEnvelope":
        """The envelope of several example batches: max per dimension over all their tensor leaves."""
        return cls.of(s for b in batches for s in tensor_shapes(b))

    def beyond(self, shapes: Iterable[Shape]) -> list[Shape]:
        """The shapes larger in some dimension than every planned tensor of their rank (unknown ranks: none)."""
        out = []
        for s in shapes:
            planned = self.dims.get(len(s))
            if planned is not None and any(a > b for a, b in zip(s, planned)):
                out.append(s)
        return out

    def grown(self, shapes: Iterable[Shape]) -> "ShapeEnvelope":
        """This envelope grown to hold ``shapes`` of the ranks it has."""
        return ShapeEnvelope.of([*self.dims.values(), *(s for s in shapes if len(s) in self.dims)])

    def describe(self) -> str:
        return ", ".join(f"{tuple(v)}" for _, v in sorted(self.dims.items()))


def grow_batch(batch: Any, planned: ShapeEnvelope, grown: ShapeEnvelope) -> Any:
    """``batch`` with each tensor leaf tiled (values repeated, then cut) to the ``grown`` envelope.

    A leaf of a rank that grew grows in dimension d when its size there is the planned max and the
    grown envelope is larger there. A leaf of a rank that did not grow (the model never saw one:
    labels ``(B,)`` beside tokens ``(B, T)``) grows in each dimension whose size is a planned size
    that grew to exactly one new size. Where two dimensions share a size (B = T) that may tile more
    than the model saw: the plan is then made for a larger step, never a smaller one."""
    grew = {(n, d): (p, g) for n, ps in planned.dims.items() for d, (p, g) in enumerate(zip(ps, grown.dims[n]))
            if g > p}
    by_size: dict[int, set[int]] = {}
    for p, g in grew.values():
        by_size.setdefault(p, set()).add(g)
    sizes = {p: next(iter(gs)) for p, gs in by_size.items() if len(gs) == 1}
    ranks = {n for n, _ in grew}

    def target(t: torch.Tensor) -> Shape:
        n = t.dim()
        if n in ranks:
            return tuple(grew[(n, d)][1] if (n, d) in grew and s == grew[(n, d)][0] else s
                         for d, s in enumerate(t.shape))
        return tuple(sizes.get(s, s) for s in t.shape)

    return tree_map(lambda t: _tile(t, target(t)) if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)


def _tile(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    """``t`` repeated along each dimension to at least ``shape``, then cut to it (a new tensor)."""
    reps = [-(-want // have) for want, have in zip(shape, t.shape)]
    return t.detach().repeat(*reps)[tuple(slice(0, n) for n in shape)].clone()


Replan = Callable[[ShapeEnvelope], None]


class ShapeGuard:
    """The forward pre-hook on the planned root module (NOTE [shape guard]); ``remove()`` takes it off."""

    def __init__(self, model: nn.Module, envelope: ShapeEnvelope, policy: ShapePolicy,
                 replan: Replan | None = None) -> None:
        if policy is ShapePolicy.REPLAN and replan is None:
            raise AutoError("on_new_shape=REPLAN needs a way to re-plan (a remat.auto handle)")
        self.model, self.envelope, self.policy, self._replan = model, envelope, policy, replan
        self._settled: set[tuple[Shape, ...]] = set()    # call shapes that need nothing (more) done
        self._busy = False                              # re-planning: remat's own calls pass unchecked
        self.seen_new: list[tuple[Shape, ...]] = []      # each new call shape met, in order
        self._warned = envelope                         # WARN: the largest shapes warned of so far
        self.trainable = trainable_flags(model)         # what the plan was made for (NOTE [trainable guard])
        self._trainable_warned: set[Trainable] = {self.trainable}
        self._hook = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module is not self.model or self._busy or not torch.is_grad_enabled():
            return None     # a copy of the model (deepcopy keeps this guard), remat's own call, or evaluation
        trainable = trainable_flags(self.model)
        if trainable != self.trainable:
            self._trainable_changed(trainable)
        shapes = tensor_shapes((args, kwargs))
        if shapes in self._settled:
            return None
        beyond = self.envelope.beyond(shapes)
        if beyond:
            self._act(shapes, beyond)
        self._settled.add(shapes)
        return None

    def _act(self, shapes: tuple[Shape, ...], beyond: list[Shape]) -> None:
        self.seen_new.append(shapes)
        what = (f"{type(self.model).__name__} was called with a tensor of shape "
                f"{', '.join(str(s) for s in beyond)}, larger than any remat.auto planned for "
                f"(planned, largest per dimension: {self.envelope.describe()})")
        if self.policy is ShapePolicy.RAISE:
            raise NewShapeError(f"{what}: the plan was measured at the planned shapes and may miss its budget here",
                                tip="pass remat.auto the largest batch the run will see (or several batches), or "
                                    "on_new_shape='replan' to plan again at the new shape, or 'warn'")
        if self.policy is ShapePolicy.WARN:
            if not self._warned.beyond(shapes):
                return      # inside a shape warned of already
            self._warned = self._warned.grown(shapes)
            warnings.warn(NewShapeWarning(
                f"{what}; the plan may miss its budget at this shape (warned once per shape): pass the largest "
                "batch to remat.auto, or on_new_shape='replan'"), stacklevel=4)
            return
        self._replan_at(self.envelope.grown(shapes))

    def _trainable_changed(self, now: Trainable) -> None:
        what = (f"the trainable parameters of {type(self.model).__name__} changed since remat.auto planned: "
                f"{describe_trainable_change(self.model, self.trainable, now)}")
        if self.policy is ShapePolicy.RAISE:
            raise TrainableChangedError(f"{what}; the plan was measured with the parameters that trained then",
                                        tip="call remat.auto again after (un)freezing (handle.remove() first), or "
                                            "on_new_shape='replan' to plan again at the next forward, or 'warn'")
        if self.policy is ShapePolicy.WARN:
            if now not in self._trainable_warned:
                self._trainable_warned.add(now)
                warnings.warn(TrainableChangedWarning(
                    f"{what}; the plan may miss its budget (warned once per trainable set): call "
                    "handle.remove() and remat.auto again after (un)freezing, or pass on_new_shape='replan'"),
                    stacklevel=4)
            return
        self._replan_at(self.envelope)

    def _replan_at(self, envelope: ShapeEnvelope) -> None:
        """REPLAN: plan for ``envelope`` with the parameters that train now, and apply it."""
        assert self._replan is not None
        self._busy = True
        try:
            self._replan(envelope)
        finally:
            self._busy = False
        self.envelope, self.trainable = envelope, trainable_flags(self.model)

    def remove(self) -> None:
        self._hook.remove()

    def __deepcopy__(self, memo: dict[int, Any]) -> "ShapeGuard":
        # a copy of the planned model (remat's own profiling copies, or the user's) keeps this hook;
        # it checks only calls of the model it guards, so the copy's calls pass through
        return self
