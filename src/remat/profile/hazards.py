"""Hazard inventory: what a candidate does in forward that a replay would do again.

NOTE [replayed hooks]
A checkpointed region's replay re-runs the forward of every module *inside* it, and
``nn.Module.__call__`` fires those modules' forward and pre-forward hooks (per module and
global) again: activation statistics, calibration counters and logging hooks count twice,
and a hook that returns a new output changes what the replay computes. The region's own
hooks are not inside: the wrapper replaces the module's ``forward`` (NOTE [instance
forward]), so ``__call__`` fires them once around the checkpoint. A segment's members are
inside the segment, their own hooks included. Hooks defined in ``torch`` or ``remat`` are
not the user's: FSDP2's pre-forward hook must unshard parameters for the recompute, remat's
probes count replays; nor are transformers' output-capturing hooks (installed on every
layer, inactive unless attentions or hidden states are asked for, and replayed the same way
by transformers' own gradient checkpointing). They are neither reported nor touched. A user's hook inside a
candidate is a blocking hazard named with the hook and the module it is on (remat cannot
tell an observer from a hook whose effect must be replayed), so the planner excludes the
candidate and a safe placement (the hook on the region itself) stays plannable.
Making the replay run such hooks "once, as the unplanned step does" is not exact, so it is
not done: skipping them on replay breaks a hook that returns a new output (the replay would
recompute other activations than the forward saved), and running them while undoing their
side effects needs to know every side effect (a counter in a closure, a list appended to, a
file written), which is exactly what cannot be inventoried. Excluding the candidate is the
only choice that is right for every hook.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from ..host_rng import HostRng
from ..types import HazardKind
from .model import HazardRecord

_SIMPLE = (int, float, str, bool, type(None))
_LIBRARY_CODE = ("torch.", "remat.")   # forwards and hooks defined here are not the user's
# NOTE [replayed hooks]: transformers installs an output-capturing hook on every layer, inactive
# unless the caller asks for attentions / hidden states
_NOT_USERS_HOOKS = (*_LIBRARY_CODE, "transformers.utils.output_capturing")


@dataclasses.dataclass(frozen=True, eq=False)
class TensorValue:
    """A tensor-valued attribute (``self.ema = 0.9 * self.ema + ...``) in a Python-state snapshot:
    the same tensor object at the same version, or another one with equal values, is unchanged."""

    tensor: torch.Tensor
    version: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorValue":
        return cls(tensor=t, version=t._version)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorValue):
            return False
        a, b = self.tensor, other.tensor
        if a is b:
            return self.version == other.version
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        try:
            return bool(torch.equal(a.detach(), b.detach()))
        except (RuntimeError, NotImplementedError):   # fake or meta tensors have no values: another object differs
            return False

    def __hash__(self) -> int:
        return id(self.tensor)

    def __repr__(self) -> str:
        t = self.tensor
        head = f", first {float(t.detach().flatten()[0]):.4g}" if t.numel() and t.device.type != "meta" and \
            not isinstance(t, torch._subclasses.FakeTensor) else ""
        return f"tensor{tuple(t.shape)}{head}"


def python_state(module: nn.Module) -> dict[str, Any]:
    """A cheap, comparable snapshot of the Python attributes a forward might change
    (simple values, container lengths, plain tensor attributes as :class:`TensorValue`)."""
    out: dict[str, Any] = {}
    for sub_name, sub in module.named_modules():
        for k, v in vars(sub).items():
            if k.startswith("_") or k == "training":
                continue
            key = f"{sub_name}.{k}" if sub_name else k
            if isinstance(v, _SIMPLE):
                out[key] = v
            elif isinstance(v, torch.Tensor):
                out[key] = TensorValue.of(v)
            elif isinstance(v, (list, dict, set, tuple)):
                out[key] = ("len", len(v))
    return out


# NOTE [code state]
# A forward can keep state outside its module: a module global (``_CALLS[0] += 1``,
# ``global STEP``) or a closure cell of the function it is. ``code_state`` snapshots, for
# every user-defined ``forward`` inside a candidate (torch's and remat's own are skipped),
# the globals its code names and its closure cells, when they hold a simple value or a
# short list / tuple / dict of simple values; anything else is not looked at. A change
# across the forward is only a suspicion (a cache set to the same value again is none);
# the confirming replay (NOTE [confirmed hazards]) keeps it when a replay changes the
# value again, and ``restore_code_state`` puts the values back after it. Reading them
# changes nothing: instrumentation never changes which path the model's code takes.
_SHORT = 64   # the longest container (items) code_state compares by value


def _simple(v: Any) -> bool:
    return isinstance(v, _SIMPLE)


def _short_and_simple(items: tuple) -> bool:
    return len(items) <= _SHORT and all(_simple(x) for x in items)


def _snapshot(v: Any) -> Any:
    """A comparable copy of ``v`` (NOTE [code state]), or None when it is not looked at."""
    if _simple(v):
        return ("value", v)
    if isinstance(v, (list, tuple)) and _short_and_simple(tuple(v)):
        return (type(v).__name__, tuple(v))
    if isinstance(v, dict) and _short_and_simple((*v.keys(), *v.values())):
        return ("dict", tuple(v.items()))
    return None


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output: tuples, lists, dicts, dataclass-like mappings."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def _user_forwards(module: nn.Module) -> list[types.FunctionType]:
    """The distinct user-defined ``forward`` functions of ``module`` and its submodules."""
    out: dict[int, types.FunctionType] = {}
    for sub in module.modules():
        outer = type(sub).forward
        for fn in (outer, inspect.unwrap(outer)):   # a decorated forward: the wrapper's cells and the code's globals
            if isinstance(fn, types.FunctionType) and not (fn.__module__ or "").startswith(_LIBRARY_CODE):
                out.setdefault(id(fn), fn)
    return list(out.values())


def _code_slots(module: nn.Module) -> Iterator[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """(key, read, write) for every global and closure cell a user forward inside ``module`` names."""
    for fn in _user_forwards(module):
        g = fn.__globals__
        for name in fn.__code__.co_names:
            if name in g and not isinstance(g[name], (types.ModuleType, type, types.FunctionType)):
                yield (f"global {name} of {fn.__qualname__} ({Path(fn.__code__.co_filename).name})",
                       functools.partial(g.__getitem__, name),
                       functools.partial(g.__setitem__, name))
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            yield (f"closure cell {fn.__qualname__}.{var}", functools.partial(getattr, cell, "cell_contents"),
                   functools.partial(setattr, cell, "cell_contents"))


def code_state(module: nn.Module) -> dict[str, Any]:
    """The globals and closure cells of ``module``'s user forwards, as comparable snapshots (NOTE [code state])."""
    out: dict[str, Any] = {}
    for key, read, _ in _code_slots(module):
        snap = _read_snapshot(read)
        if snap is not None:
            out[key] = snap
    return out


def restore_code_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Put every global and closure cell of ``state`` back to its value; containers keep their identity."""
    for key, read, write in _code_slots(module):
        if key not in state or _read_snapshot(read) == state[key]:
            continue
        kind, value = state[key]
        current = read()
        if kind == "list" and isinstance(current, list):
            current[:] = list(value)
        elif kind == "dict" and isinstance(current, dict):
            current.clear()
            current.update(value)
        else:
            write(value if kind == "value" else tuple(value))


def _read_snapshot(read: Callable[[], Any]) -> Any:
    try:
        return _snapshot(read())
    except ValueError:   # an empty closure cell
        return None


def changed_code_state(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for each global / closure cell that differs between two snapshots."""
    return [f"{k}: {before.get(k, (None, None))[1]!r} -> {after.get(k, (None, None))[1]!r}"
            for k in sorted(before.keys() | after.keys()) if before.get(k) != after.get(k)]


# NOTE [read at replay]
# A forward that only *reads* a module global or closure cell (``if _CALLS[0] > 100:``) is
# safe to replay only if the value is the same when backward replays it. Something else in
# the step may change it in between: a later module's forward, the loss, a hook, a tensor
# hook in backward. Then the replay takes the other branch (or scales by another number)
# and, with the same tensor shapes, non-reentrant checkpoint's checks pass while the
# gradients are silently wrong, and only at the step where the value crosses the
# threshold: a few paired steps in ``verify`` can miss it. So the hazard probe snapshots
# the forward's globals and closure cells (NOTE [code state]) when the forward returns,
# and again when backward reaches the region: a pre-hook on the autograd nodes of the
# region's outputs, which run just before checkpoint would unpack the region's saved
# tensors and replay it. A value that differs between the two snapshots is the hazard,
# observed, not suspected (there is nothing to confirm by replaying: the replay would read
# exactly the changed value). Compared with the forward's *end*, not its start, so a
# forward that sets a cache and reads it back is not flagged here; one that writes is
# judged by the confirming replay (NOTE [confirmed hazards]). A value that never changes
# (a config constant) is never flagged.
class ReplayTimeReads:
    """Compares a forward's globals and closure cells with their values when backward reaches it."""

    def __init__(self, module: nn.Module, on_change: Callable[[list[str]], None]) -> None:
        self.module = module
        self.on_change = on_change
        self.fired = False

    def watch(self, output: Any) -> None:
        """Hook the autograd nodes of ``output``'s tensors (NOTE [read at replay]); no grad: no replay."""
        self.at_forward = code_state(self.module)
        if not self.at_forward:
            return
        nodes = {id(t.grad_fn): t.grad_fn for t in tensors_in(output) if t.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(self._at_replay)   # freed with the graph after backward

    def _at_replay(self, grad_outputs: Any) -> None:
        if self.fired:   # the first of the output nodes is when the replay would run
            return None
        self.fired = True
        changed = changed_code_state(self.at_forward, code_state(self.module))
        if changed:
            self.on_change(changed)
        return None


def _hook_owner(fn: Any) -> str:
    """The Python module that defines hook ``fn`` (through ``functools.partial``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__module__", None) or ""


def _user_hooks(hooks: dict[int, Any]) -> list[str]:
    """Qualified names of the hooks in ``hooks`` that are the user's (NOTE [replayed hooks])."""
    return [getattr(fn, "__qualname__", repr(fn)) for fn in hooks.values()
            if not _hook_owner(fn).startswith(_NOT_USERS_HOOKS)]


def module_hooks(module: nn.Module, where: str) -> list[str]:
    """The user's forward and pre-forward hooks registered on ``module`` (called ``where``)."""
    return [f"{kind} {name} on {where}" for kind, hooks in (("forward pre-hook", module._forward_pre_hooks),
                                                          ("forward hook", module._forward_hooks))
            for name in _user_hooks(hooks)]


def global_hooks() -> list[str]:
    """The user's global forward / pre-forward hooks (``register_module_forward_hook``): they fire on every module."""
    return [f"global {kind} {name}" for kind, hooks in (("forward pre-hook", _global_forward_pre_hooks),
                                                       ("forward hook", _global_forward_hooks))
            for name in _user_hooks(hooks)]


def hooks_inside(module: nn.Module) -> list[str]:
    """The user's hooks a replay of ``module`` would fire again: on its submodules, and global ones."""
    subs = [(n, m) for n, m in module.named_modules() if n]
    found = [h for n, m in subs for h in module_hooks(m, f"its submodule {n}")]
    return found + (global_hooks() if subs else [])


def hook_detail(found: list[str]) -> str:
    """A HOOK hazard's detail: the first hooks found, named (NOTE [replayed hooks])."""
    return f"{'; '.join(found[:3])}: fires again on replay (NOTE [replayed hooks])"


def buffer_versions(module: nn.Module) -> dict[str, int]:
    return {n: b._version for n, b in module.named_buffers()}


@dataclasses.dataclass
class HazardProbe:
    """Before/after snapshots around one candidate's forward."""

    module: nn.Module
    compare_rng_state: bool = True   # off under FakeTensorMode: fake dropout leaves the real RNG alone
    buffers: dict[str, int] = dataclasses.field(default_factory=dict)
    python: dict[str, Any] = dataclasses.field(default_factory=dict)
    rng: torch.Tensor | None = None
    host: HostRng | None = None      # Python's and numpy's generators (NOTE [host RNG]): real draws even under fake mode
    code: dict[str, Any] = dataclasses.field(default_factory=dict)   # NOTE [code state]
    found: list[HazardRecord] = dataclasses.field(default_factory=list)

    def before(self) -> None:
        self.buffers = buffer_versions(self.module)
        self.python = python_state(self.module)
        self.rng = torch.random.get_rng_state() if self.compare_rng_state else None
        self.host = HostRng.capture()
        self.code = code_state(self.module)

    def after(self, output: Any = None) -> None:
        """The forward returned ``output``: compare snapshots, and watch its reads until backward."""
        ReplayTimeReads(self.module, self._read_hazard).watch(output)
        self._buffer_hazard()
        self._state_hazards()
        hooks = hooks_inside(self.module)
        if hooks:
            self._add(HazardKind.HOOK, hook_detail(hooks))
        drawn = self._generators_drawn()
        if drawn:
            self._add(HazardKind.RNG, f"draws from the {' and '.join(drawn)} RNG in forward (e.g. dropout, drop-path): "
                                      "safe while RNG state is preserved (NOTE [host RNG])")

    def _buffer_hazard(self) -> None:
        mutated = [n for n, v in buffer_versions(self.module).items() if self.buffers.get(n) != v]
        if mutated:
            owners = [self.module.get_submodule(n.rpartition(".")[0]) if "." in n else self.module for n in mutated]
            guardable = all(isinstance(o, _BatchNorm) for o in owners)
            self._add(HazardKind.BUFFER_MUTATION, f"{', '.join(mutated)} mutated in forward", guardable)

    def _state_hazards(self) -> None:
        """Python attributes, module globals and closure cells this forward changed (suspicions to confirm)."""
        now = python_state(self.module)
        changed = [f"{k}: {self.python.get(k)!r} -> {now.get(k)!r}" for k in sorted(now.keys() | self.python.keys())
                   if now.get(k) != self.python.get(k)]
        if changed:
            self._add(HazardKind.PYTHON_STATE, "; ".join(changed[:5]))
        code = changed_code_state(self.code, code_state(self.module))
        if code:
            self._add(HazardKind.GLOBAL_STATE, f"{'; '.join(code[:3])} in forward (NOTE [code state])")

    def _read_hazard(self, changed: list[str]) -> None:
        self._add(HazardKind.GLOBAL_READ, f"{'; '.join(changed[:3])} (when the forward returned -> when backward "
                                          "replays it): the replay reads another value (NOTE [read at replay])")

    def _generators_drawn(self) -> list[str]:
        """The global generators this forward drew from: torch's CPU one, Python's ``random``, numpy's."""
        torch_cpu = self.rng is not None and not torch.equal(self.rng, torch.random.get_rng_state())
        host = self.host.differences(HostRng.capture()) if self.host is not None else []
        return (["CPU"] if torch_cpu else []) + host

    def _add(self, kind: HazardKind, detail: str, guardable: bool = False) -> None:
        if not any(h.kind is kind for h in self.found):
            self.found.append(HazardRecord(kind=kind, detail=detail, guardable=guardable))
