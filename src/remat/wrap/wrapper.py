"""``CheckpointWrapper``: the one object that replaces a planned module's ``forward``.

NOTE [instance forward]
A wrapper is installed as the *instance attribute* ``module.forward``. ``nn.Module.__call__``
looks ``forward`` up on the instance first, so the module's own hooks still run, while its
name, class, ``state_dict`` keys and parameter objects stay exactly as they were (an
optimizer built before ``apply`` keeps working, and ``remove`` is a ``del`` away).
The wrapper calls the original (bound) forward through non-reentrant
``torch.utils.checkpoint.checkpoint``.

NOTE [copies of a planned model]
``copy.deepcopy(model)`` and ``torch.save(model)``/``torch.load`` copy the instance attribute
``forward`` with the rest of the module, so a copy of a planned model is *checkpointed too*,
by its own wrappers bound to the copied modules (``__getstate__`` drops what belongs to this
run: observers, call counts). Copies are therefore *removable*, not clean:
``remat.wrap.recover_handle(copy)`` finds the wrappers in any model and returns a handle
whose ``remove()`` restores the copy exactly. (Clean copies are not possible from here: the
module's ``__dict__`` is copied wholesale, and a wrapper cannot make itself absent from it.)

NOTE [replay detection]
Non-reentrant checkpoint calls the function it was given twice: once from our
``__call__`` in the forward, and again from the unpack hook during backward (the
*replay*, possibly cut short by ``early_stop``). ``_run`` tells the two apart by
(a) whether our ``__call__`` is on the stack (``_depth``) and (b) whether the autograd
engine is running a graph task on this thread (``_current_graph_task_id() != -1``).
(b) also makes a forward that runs *inside* another region's replay count as a replay.

NOTE [buffer guard]
BatchNorm in train mode updates ``running_mean``/``running_var``/``num_batches_tracked``
in its forward; inside a checkpoint that forward runs twice, so the statistics get two
momentum updates and ``num_batches_tracked`` goes +2 per step (pytorch issue 96136),
silently: gradients stay bitwise equal. A *guarded* wrapper snapshots every buffer of
its module (floating and integer, whole subtree) when a replay starts and copies the
snapshot back when the replay ends, also when ``early_stop`` aborts it with an
exception. The replay's normalisation uses batch statistics, so its outputs do not
depend on the running buffers; restoring them leaves exactly the forward's update.
The restore writes only buffers that changed (in eval mode none do) and does so under
``_unsafe_preserve_version_counter``, so autograd does not report an in-place change of
a tensor the replay may have saved; in train mode BatchNorm's backward reads the saved
batch statistics, never the running ones, so no gradient depends on the restored values.

NOTE [wrapper under compile]
When Dynamo traces a wrapper (``torch.compiler.is_compiling()``), the region is
``checkpoint(module.forward)`` and nothing else: no forward/replay counters, no
saved-tensor hook juggling, no observers, and the SAC policy handed over as a ``partial`` of
a plain function (Dynamo takes ``context_fn`` only as a Python constant; a policy *object*
is not one). Dynamo then turns the region into one checkpoint higher-order op inside the
compiled graph, which AOTAutograd partitions like torch's own (the eager path's
``with instrumentation_hooks_off()`` would break the graph at every planned region: Dynamo cannot
resume inside a user context manager). Guarded wrappers trace the same way: in a compiled graph
the replay is AOTAutograd's recompute of the saved values, and BatchNorm's running-stat writes
are functionalized outputs of the forward written back once, never replayed, so there is nothing
for the buffer guard to restore. A segment (NOTE [segment wrapper]) checks its chain while traced too, holding its
output by a strong reference that the last member drops (Dynamo cannot trace ``weakref``).
Wrappers with observers keep the eager path. Under compile nobody counts replays:
verify observes boundary activity on an eager pair (NOTE [verify under compile]).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from ..host_rng import HostRng, rewound
from ..sac_hooks import sac_checkpoint_kwargs
from ..trace.recorder import instrumentation_hooks_off
from ..types import OP_POLICY_MODES, CheckpointMode
from .policy import OpLevelPolicy, SaveMatmulPolicy, selective_context_fn, traceable_context_fn


class RegionObserver(Protocol):
    """Something that wants to run around every execution of a wrapped forward (verify's probes)."""

    def region(self, wrapper: "CheckpointWrapper", *, replay: bool) -> ContextManager[Any]: ...


def _tracing() -> bool:
    """Dynamo is tracing this call (NOTE [wrapper under compile])."""
    return torch.compiler.is_compiling()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def restore_buffers(module: nn.Module) -> Iterator[None]:
    """Snapshot every buffer of ``module`` (recursively) and write it back on exit (NOTE [buffer guard]).

    Restores values in place, and also the buffer *objects* if the forward rebound one
    (``self.steps = self.steps + 1``), so the module ends exactly as the replay found it.
    """
    # The snapshot and the write-back run with every dispatch mode popped: inside a SELECTIVE
    # replay, SAC's recompute mode would otherwise see our clone/copy_ as ops of the region
    # and fail ("aten.clone.default encountered during backward but not found in storage").
    with _disable_current_modes():
        saved = [(owner, name, buf, buf.detach().clone())
                 for owner in module.modules() for name, buf in owner._buffers.items() if buf is not None]
    try:
        yield
    finally:
        with torch.no_grad(), _disable_current_modes():
            for owner, name, buf, value in saved:
                if owner._buffers.get(name) is not buf:
                    owner._buffers[name] = buf
                if not torch.equal(buf, value):  # eval mode: nothing changed, nothing written
                    with torch.autograd._unsafe_preserve_version_counter(buf):
                        buf.copy_(value)


def snapshot_containers(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh lists/dicts/tuples around the same leaves (NOTE [argument containers]).

    NOTE [argument containers]
    Checkpoint replays a region from the argument *objects* it was called with. A caller may
    keep mutating a container it passed: torchvision's DenseNet hands every dense layer the
    block's growing ``features`` list and appends to it after the call, so a replay would see
    all later features (``running_mean should contain 256 elements not 64``). The forward saw
    the container as it was at the call, so the replay must too: the wrapper passes new
    containers holding the same tensors and objects (a shallow copy at every level; nothing
    is cloned, no bytes are added).
    """
    return tree_map(lambda leaf: leaf, (args, kwargs))


class CheckpointWrapper:
    """Runs one planned module's forward under non-reentrant checkpointing.

    ``path`` is the module path from ``model.named_modules()``; ``mode`` FULL or SELECTIVE;
    ``guarded`` restores the module's buffers around the replay (NOTE [buffer guard]).
    ``forward_calls``/``replay_calls`` count the forwards and replays since the last
    :meth:`reset_counts` (units: calls).
    """

    def __init__(self, module: nn.Module, path: str, mode: CheckpointMode, *, guarded: bool = False,
                 preserve_rng_state: bool = True, policy: SaveMatmulPolicy | None = None) -> None:
        if mode is CheckpointMode.KEEP:
            raise ValueError(f"CheckpointWrapper mode must be full or an op-level mode, got {mode}")
        self.path = path
        self.mode = mode
        self.guarded = guarded
        self.preserve_rng_state = preserve_rng_state
        self.policy: SaveMatmulPolicy | OpLevelPolicy | None = (
            policy if mode is CheckpointMode.SELECTIVE else OpLevelPolicy(mode) if mode in OP_POLICY_MODES else None)
        # made once, outside any compiled region: NOTE [wrapper under compile]
        self.traceable_context_fn = traceable_context_fn(self.policy) if mode in OP_POLICY_MODES else None
        self.module = module
        # What ``module.forward`` resolved to before us: a bound method, or an instance attribute
        # somebody else installed (``had_instance_forward`` says which, so ``uninstall`` is exact).
        self.had_instance_forward = "forward" in module.__dict__
        self.original_forward: Callable[..., Any] = module.forward
        self.observers: list[RegionObserver] = []
        self.forward_calls = 0
        self.replay_calls = 0
        self._depth = 0  # > 0 while our __call__ (the real forward) is on the stack

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        self.module.forward = self  # type: ignore[method-assign]  # NOTE [instance forward]

    @property
    def installed(self) -> bool:
        """Whether ``module.forward`` is still this wrapper (somebody may have replaced it by hand)."""
        return self.module.__dict__.get("forward") is self

    def uninstall(self) -> None:
        if not self.installed:
            from ..errors import HandleError
            raise HandleError(f"{self.path}: its forward was replaced after remat.apply; cannot restore it exactly")
        if self.had_instance_forward:
            self.module.forward = self.original_forward  # type: ignore[method-assign]
        else:
            del self.module.__dict__["forward"]

    # -- running ------------------------------------------------------------------------------
    def reset_counts(self) -> None:
        self.forward_calls = 0
        self.replay_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = snapshot_containers(args, kwargs)   # NOTE [argument containers]
        if _tracing() and not self.observers:
            return self._traced_checkpoint(args, kwargs)
        self.forward_calls += 1
        self._depth += 1
        try:
            extra: dict[str, Any] = {}
            if self.mode in OP_POLICY_MODES:   # NOTE [op-level policies] in remat.types
                extra["context_fn"] = selective_context_fn(self.policy)
                extra.update(sac_checkpoint_kwargs(checkpoint))   # NOTE [SAC under saved-tensor hooks]
            # Keyword arguments ride in a partial: a forward keyword named like one of
            # checkpoint's own (``debug``, ``context_fn``...) must not be taken by checkpoint.
            # NOTE [host RNG]: Python's and numpy's generators as this forward finds them, for its replay
            host = HostRng.capture() if self.preserve_rng_state else None
            fn = functools.partial(self._run, host, **kwargs)
            with instrumentation_hooks_off():   # NOTE [saved-tensor hooks and identity] in trace/recorder.py
                return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **extra)
        finally:
            self._depth -= 1

    def _traced_checkpoint(self, args: tuple, kwargs: dict) -> Any:
        """The region as Dynamo traces it (NOTE [wrapper under compile]): checkpoint straight
        around the module's forward, no counters, no hook juggling, so the whole region becomes
        one checkpoint higher-order op inside the compiled graph instead of a graph break."""
        extra: dict[str, Any] = {}
        if self.mode in OP_POLICY_MODES:
            extra["context_fn"] = self.traceable_context_fn
        fn = functools.partial(self._region_forward, **kwargs) if kwargs else self._region_forward
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **extra)

    def _run(self, host: HostRng | None, /, *args: Any, **kwargs: Any) -> Any:
        replay = self._depth == 0 or _in_backward()  # NOTE [replay detection]
        if replay:
            self.replay_calls += 1
        with contextlib.ExitStack() as stack:
            if replay and host is not None:
                stack.enter_context(rewound(host))   # NOTE [host RNG]
            for obs in list(self.observers):
                stack.enter_context(obs.region(self, replay=replay))
            if replay and self.guarded:
                for m in self.guarded_modules():
                    stack.enter_context(restore_buffers(m))
            return self._region_forward(*args, **kwargs)

    def _region_forward(self, *args: Any, **kwargs: Any) -> Any:
        """What the checkpoint runs (and replays): the module's own forward. One override point."""
        return self.original_forward(*args, **kwargs)

    def guarded_modules(self) -> list[nn.Module]:
        """The modules whose buffers a guarded replay restores (NOTE [buffer guard])."""
        return [self.module]

    # -- copies (NOTE [copies of a planned model]) --------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(observers=[], forward_calls=0, replay_calls=0, _depth=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        guard = ", guarded" if self.guarded else ""
        rng = "" if self.preserve_rng_state else ", rng not preserved"
        return f"CheckpointWrapper({self.path!r}, {self.mode.value}{guard}{rng})"


class SegmentWrapper(CheckpointWrapper):
    """One checkpoint around a run of sibling modules that pass one tensor along (NOTE [segments]
    in remat/profile/segments.py; NOTE [segment wrapper]).

    NOTE [segment wrapper]
    Installed as the first member's ``forward`` (so the parent's own call starts it), it runs
    every member's original forward back to back under one non-reentrant checkpoint, which
    keeps only the first member's input. Each later member's ``forward`` becomes a
    :class:`SegmentPassthrough` that returns its argument, which is the segment's output
    when the parent passes one tensor along. The passthrough checks that: the argument must
    be the very tensor the segment returned, and the members must be called in order;
    otherwise it raises :class:`~remat.errors.PlanError` (the parent does something between
    the members, so the segment is not a chain here). ``path`` is the segment's name
    (``blocks[2:5]``).

    NOTE [segment members through their module call]
    Inside the region every later member runs through its *module call* (``member(x)``), never
    its bare ``forward``: its own hooks run where its forward runs, with its real input and
    output, as without the segment. FSDP2's pre-forward hook is one of them: it all-gathers the
    member's parameters (and its post-forward hook reshards them), so a member that is an FSDP2
    unit computes with plain tensors; run as a bare ``forward`` it met sharded DTensor
    parameters ("aten.native_layer_norm got mixed torch.Tensor and DTensor"). The passthrough
    tells the two calls apart: while the region runs member ``k`` (``_running == k``) it is the
    member's forward, otherwise it is the parent's call. Those hooks must not run a second time
    on the parent's call (FSDP2 would all-gather again and wrap the argument in a new tensor), so
    once the region has run, each later member's own hook tables are set aside (*muted*) until
    the parent calls it: ``nn.Module.__call__`` finds them empty and calls the passthrough alone,
    which puts them back. A parent that raises before calling them all leaves some muted; the
    segment's next call, and ``uninstall``, put them back. Global module hooks
    (``register_module_forward_hook``) fire on both calls. Under Dynamo the region calls the bare
    forwards as before (NOTE [wrapper under compile]).
    """

    MODE = CheckpointMode.FULL   # the one mode this class runs (FULL_HOST_INPUT: remat/wrap/offload.py)

    def __init__(self, members: list[tuple[str, nn.Module]], name: str, mode: CheckpointMode, *,
                 guarded: bool = False, preserve_rng_state: bool = True) -> None:
        if mode is not self.MODE:
            from ..errors import PlanError
            raise PlanError(f"segment {name}: a {type(self).__name__} runs mode {self.MODE.value!r}, got {mode.value!r}",
                            tip="segments are planned in mode 'full', or 'full-host-input' with offload")
        super().__init__(members[0][1], name, mode, guarded=guarded, preserve_rng_state=preserve_rng_state)
        self.member_paths = tuple(p for p, _ in members)
        self.members = tuple(m for _, m in members)
        self.rest_had_instance = tuple("forward" in m.__dict__ for m in self.members[1:])
        self.rest_forwards = tuple(m.forward for m in self.members[1:])
        self.passthroughs = tuple(SegmentPassthrough(self, k) for k in range(1, len(self.members)))
        self._last: Any = None            # weakref to the tensor the segment last returned
        self._traced_last: Any = None     # the same, while Dynamo traces (NOTE [wrapper under compile])
        self._next = 0                    # position of the member the parent should call next
        self._running = 0                 # position of the member the region is running now (0: none)
        self._muted: dict[int, tuple[dict, ...]] = {}   # position -> that member's own hook tables, set aside

    def install(self) -> None:
        super().install()
        for m, pt in zip(self.members[1:], self.passthroughs):
            m.forward = pt  # type: ignore[method-assign]

    @property
    def installed(self) -> bool:
        return super().installed and all(m.__dict__.get("forward") is pt
                                         for m, pt in zip(self.members[1:], self.passthroughs))

    def uninstall(self) -> None:
        if not self.installed:
            from ..errors import HandleError
            raise HandleError(f"{self.path}: a member's forward was replaced after remat.apply; cannot restore it exactly")
        self._unmute_all()
        super().uninstall()
        for m, had, f in zip(self.members[1:], self.rest_had_instance, self.rest_forwards):
            if had:
                m.forward = f  # type: ignore[method-assign]
            else:
                del m.__dict__["forward"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._unmute_all()   # a parent that raised last time left some muted
        out = super().__call__(*args, **kwargs)
        if _tracing():   # Dynamo cannot trace a weakref; a strong one, dropped by the last member
            self._traced_last = out
        else:
            self._last = weakref.ref(out) if isinstance(out, torch.Tensor) else None
            for k in range(1, len(self.members)):
                self._mute(k)
        self._next = 1
        return out

    def _region_forward(self, *args: Any, **kwargs: Any) -> Any:
        x = self.original_forward(*args, **kwargs)
        if _tracing():
            for f in self.rest_forwards:
                x = f(x)
            return x
        for k, member in enumerate(self.members[1:], start=1):
            x = self._run_member(k, member, x)
        return x

    def _run_member(self, position: int, member: nn.Module, x: Any) -> Any:
        """``member(x)``, its hooks included (NOTE [segment members through their module call])."""
        outer, self._running = self._running, position
        try:
            return member(x)
        finally:
            self._running = outer

    _HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

    def _mute(self, position: int) -> None:
        member = self.members[position]
        if position not in self._muted:
            self._muted[position] = tuple(getattr(member, t) for t in self._HOOK_TABLES)
            for t in self._HOOK_TABLES:
                setattr(member, t, type(getattr(member, t))())

    def _unmute(self, position: int) -> None:
        tables = self._muted.pop(position, None)
        if tables is None:
            return
        member = self.members[position]
        for t, saved in zip(self._HOOK_TABLES, tables):
            saved.update(getattr(member, t))   # a hook registered meanwhile is kept
            setattr(member, t, saved)

    def _unmute_all(self) -> None:
        for k in list(self._muted):
            self._unmute(k)

    def member_forward(self, position: int, x: Any) -> Any:
        """Member ``position``'s own forward (the region is running it)."""
        return self.rest_forwards[position - 1](x)

    def guarded_modules(self) -> list[nn.Module]:
        return list(self.members)

    def passed(self, position: int, x: Any) -> Any:
        """A later member was called by the parent with ``x`` (NOTE [segment wrapper])."""
        self._unmute(position)
        tracing = _tracing()
        if tracing:
            last = self._traced_last
        else:
            last = self._last() if self._last is not None else None
        if position != self._next or last is None or x is not last:
            from ..errors import PlanError
            what = ("was called out of order" if position != self._next else
                    "received a tensor that is not the segment's output")
            raise PlanError(f"segment {self.path}: member {self.member_paths[position]} {what}; its parent does not "
                            "pass one tensor along these modules, so the segment cannot be checkpointed as one",
                            tip="re-plan: remat plan offers a segment only where the profiled step shows a chain")
        self._next = position + 1 if position + 1 < len(self.members) else 0
        if tracing and self._next == 0:
            self._traced_last = None   # the chain is done: hold no activation past it
        return x

    def renamed(self, head_path: str) -> str:
        """This segment's name when its first member sits at ``head_path`` (a copy of a submodule)."""
        container, _, _ = head_path.rpartition(".")
        start = int(self.path[self.path.rindex("[") + 1:self.path.rindex(":")])
        stop = int(self.path[self.path.rindex(":") + 1:-1])
        return f"{container}[{start}:{stop}]"

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_last=None, _traced_last=None, _next=0, _running=0, _muted={})
        return state

    def __repr__(self) -> str:
        guard = ", guarded" if self.guarded else ""
        return f"SegmentWrapper({self.path!r}, {len(self.members)} modules{guard})"


class SegmentPassthrough:
    """A later member's ``forward`` under a :class:`SegmentWrapper`: hands back the segment's output."""

    def __init__(self, segment: SegmentWrapper, position: int) -> None:
        self.segment = segment
        self.position = position

    def __call__(self, x: Any) -> Any:
        # NOTE [segment members through their module call]: the region's call, or the parent's
        if self.segment._running == self.position:
            return self.segment.member_forward(self.position, x)
        return self.segment.passed(self.position, x)

    def __repr__(self) -> str:
        return f"SegmentPassthrough({self.segment.path!r}, member {self.position})"
