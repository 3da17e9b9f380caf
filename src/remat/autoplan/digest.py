"""Stable digests of Python values: the parts of the plan cache key that are not tensors' shapes.

NOTE [stable value digest]
A cached plan is only right while nothing that moves the step's peak has changed, and what moves
it is often not a tensor: a module attribute that sets an intermediate's size, ``nn.Dropout``'s
``p`` (0 saves no mask), Hugging Face's ``config._attn_implementation`` ("eager" saves the
attention matrix, "sdpa" does not), a ``functools.partial`` loss's arguments, a closure's values,
a function's default arguments. ``StableDigest.value`` turns such a value into plain JSON that is
the same for the same build in any process (no ``id()``, no ``hash()`` order, no address) and
differs when a value differs:

- ``None``, bools, ints, floats, strings as they are; bytes by sha256;
- tuples and lists by length and element by element (the first ``MAX_ITEMS``); dicts by items
  and sets by elements, sorted by their JSON (a set's order changes with ``PYTHONHASHSEED``);
- an enum member by its class and name; ``torch.dtype``, ``torch.device``, a layout by ``str``;
- a tensor by shape, dtype, device and ``requires_grad``, never its values (a buffer's
  running statistics change every step; its size does not); NumPy arrays likewise, NumPy
  scalars by value;
- a module by its class (its source hash) and, for it and each submodule, its non-tensor
  attributes (everything in ``__dict__`` a bare ``nn.Module`` does not have: hooks are not
  keyed), its parameters' and buffers' shapes and dtypes; a hook's ``RemovableHandle`` (FSDP2
  keeps its own in module state) by its class alone: its id is a process-wide counter;
- an object with ``to_dict`` (a Hugging Face ``PretrainedConfig``) by ``to_dict()`` plus its
  ``_attn_implementation``, which ``to_dict`` leaves out;
- a function by its qualified name, its bytecode (nested code objects too), its defaults,
  keyword defaults and closure cells' values; a ``functools.partial`` by its function,
  arguments and keywords; a bound method by its function and ``self``; a class by its
  qualified name and source hash; a Python module by its name;
- any other object by its class and its ``__dict__`` and ``__slots__`` values (a structural
  digest); one with neither by its ``repr`` when that holds no address (``0x...``), else by its
  class alone: nothing else about it is stable across processes.

An object met twice is converted once (the same model in a loss closure costs nothing more);
one met again inside itself is ``"<cycle>"``, and nesting is cut at ``MAX_DEPTH``. Not covered:
module-level globals a function reads, and what a C extension object hides (its class is keyed).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import re
import types
from typing import Any, Callable

import torch
import torch.utils.hooks
from torch import nn

from ..profile.fingerprint import class_source_hash

MAX_DEPTH = 12
MAX_ITEMS = 4096        # of a list or tuple, the first ones are keyed (with its length): a captured dataset stays cheap
_MODULE_BASE = frozenset(vars(nn.Module())) - {"training"}   # torch's bookkeeping: hooks, _parameters, ...
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_PLAIN = (type(None), bool, int, float, str)
_STR_TYPES = (torch.dtype, torch.device, torch.memory_format, torch.layout)


def sha256_json(value: Any) -> str:
    """sha256 hex of ``value`` as sorted JSON (``value`` holds only JSON types)."""
    return hashlib.sha256(_json(value).encode()).hexdigest()


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


class StableDigest:
    """Converts values to stable JSON (NOTE [stable value digest]); one instance per cache key."""

    def __init__(self) -> None:
        self._done: dict[int, Any] = {}       # id -> converted, for objects converted once
        self._active: set[int] = set()        # ids being converted now: met again, a cycle
        self._keep: list[Any] = []            # keeps memoised objects alive, so their ids stay theirs

    def value(self, v: Any, depth: int = 0) -> Any:
        if isinstance(v, _PLAIN) and not isinstance(v, enum.Enum):
            return v
        if depth > MAX_DEPTH:
            return "<deep>"
        if id(v) in self._done:
            return self._done[id(v)]
        if id(v) in self._active:
            return "<cycle>"
        self._active.add(id(v))
        try:
            out = self._convert(v, depth + 1)
        finally:
            self._active.discard(id(v))
        self._done[id(v)] = out
        self._keep.append(v)
        return out

    def _convert(self, v: Any, depth: int) -> Any:
        for kinds, rule in _RULES:
            if isinstance(v, kinds):
                return rule(self, v, depth)
        return self._other(v, depth)

    def _many(self, values: Any, depth: int) -> list[Any]:
        return [self.value(x, depth) for x in values]

    def _sorted(self, values: Any, depth: int) -> list[Any]:
        return sorted(self._many(values, depth), key=_json)

    def _sequence(self, v: Any, depth: int) -> Any:
        return [type(v).__name__, len(v), self._many(v[:MAX_ITEMS], depth)]

    def _set(self, v: Any, depth: int) -> Any:
        return [type(v).__name__, self._sorted(v, depth)]

    def _dict(self, v: Any, depth: int) -> Any:
        return [type(v).__name__, self._sorted(([k, x] for k, x in v.items()), depth)]

    def _enum(self, v: enum.Enum, depth: int) -> Any:
        return ["enum", qualified_name(type(v)), v.name]

    def _bytes(self, v: bytes, depth: int) -> Any:
        return ["bytes", hashlib.sha256(bytes(v)).hexdigest()]

    def _str_like(self, v: Any, depth: int) -> Any:
        return [type(v).__name__, str(v)]

    def _hook_handle(self, v: Any, depth: int) -> Any:
        return ["hook handle"]

    def _tensor(self, t: torch.Tensor, depth: int) -> Any:
        return ["tensor", list(t.shape), str(t.dtype), t.device.type, t.requires_grad]

    def _module(self, m: nn.Module, depth: int) -> Any:
        return ["module", qualified_name(type(m)), class_source_hash(type(m)),
                [[name, self._module_own(sub, depth)] for name, sub in m.named_modules()]]

    def _module_own(self, m: nn.Module, depth: int) -> Any:
        """One module's own state: its non-tensor attributes, its parameters' and buffers' shapes."""
        attrs = {k: self.value(x, depth) for k, x in vars(m).items() if k not in _MODULE_BASE}
        tensors = [[n, self._tensor(t, depth)] for n, t in (*m.named_parameters(recurse=False),
                                                             *m.named_buffers(recurse=False))]
        return [type(m).__qualname__, attrs, tensors]

    def _code(self, code: types.CodeType, depth: int) -> Any:
        return ["code", getattr(code, "co_qualname", code.co_name),
                hashlib.sha256(code.co_code).hexdigest(), list(code.co_names), self._many(code.co_consts, depth)]

    def _function(self, fn: types.FunctionType, depth: int) -> Any:
        cells = [self.value(c.cell_contents, depth) if _filled(c) else "<empty>" for c in fn.__closure__ or ()]
        return ["function", qualified_name(fn), self._code(fn.__code__, depth), self.value(fn.__defaults__, depth),
                self.value(fn.__kwdefaults__, depth), cells]

    def _partial(self, p: functools.partial, depth: int) -> Any:
        return ["partial", self.value(p.func, depth), self._many(p.args, depth), self.value(p.keywords, depth)]

    def _method(self, m: types.MethodType, depth: int) -> Any:
        return ["method", self.value(m.__func__, depth), self.value(m.__self__, depth)]

    def _named(self, v: Any, depth: int) -> Any:
        """A builtin function, a class, a Python module: by name (a class also by its source hash)."""
        if isinstance(v, type):
            return ["class", qualified_name(v), class_source_hash(v)]
        return [type(v).__name__, getattr(v, "__name__", None) if isinstance(v, types.ModuleType) else qualified_name(v)]

    def _other(self, v: Any, depth: int) -> Any:
        converted = self._config(v, depth) or self._array(v) or self._structure(v, depth)
        if converted is not None:
            return converted
        return ["object", qualified_name(type(v)), *_stable_repr(v)]

    def _config(self, v: Any, depth: int) -> Any:
        """A Hugging Face config (anything whose class has ``to_dict``): ``to_dict()`` and ``_attn_implementation``."""
        to_dict = getattr(type(v), "to_dict", None)
        if not callable(to_dict):
            return None
        try:
            d = to_dict(v)
        except Exception:     # not a config after all: keyed by its structure instead
            return None
        return ["config", qualified_name(type(v)), self.value(d, depth), self.value(_attn_implementation(v), depth)]

    def _array(self, v: Any) -> Any:
        """A NumPy array (shape and dtype) or NumPy scalar (its value), found without importing NumPy."""
        if type(v).__module__ != "numpy" or not hasattr(v, "dtype"):
            return None
        if getattr(v, "shape", None) == () and hasattr(v, "item"):
            return ["numpy", str(v.dtype), v.item()]
        return ["ndarray", list(getattr(v, "shape", ())), str(v.dtype)]

    def _structure(self, v: Any, depth: int) -> Any:
        """An object's class, class source hash, and ``__dict__`` / ``__slots__`` values; None with neither."""
        state = dict(vars(v)) if hasattr(v, "__dict__") and isinstance(vars(v), dict) else {}
        for name in _slots(type(v)):
            if hasattr(v, name):
                state[name] = getattr(v, name)
        if not state and not hasattr(v, "__dict__"):
            return None
        return ["object", qualified_name(type(v)), class_source_hash(type(v)), self.value(state, depth)]


def _attn_implementation(config: Any) -> Any:
    """``config._attn_implementation`` (a property in Hugging Face); None where it is missing or raises."""
    try:
        return getattr(config, "_attn_implementation", None)
    except Exception:
        return None


def _stable_repr(v: Any) -> list[str]:
    """``[repr(v)]``, or ``[]`` when it holds an address (``0x...``) or raises: then the class alone is keyed."""
    try:
        text = repr(v)
    except Exception:
        return []
    return [] if _ADDRESS.search(text) else [text]


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:        # a cell not yet assigned
        return False
    return True


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return names


_Rule = Callable[[StableDigest, Any, int], Any]
# First match wins: enums before the ints and strings they may be, modules and tensors before objects.
_RULES: tuple[tuple[type | tuple[type, ...], _Rule], ...] = (
    (enum.Enum, StableDigest._enum),
    (torch.utils.hooks.RemovableHandle, StableDigest._hook_handle),
    ((tuple, list), StableDigest._sequence),
    ((set, frozenset), StableDigest._set),
    (dict, StableDigest._dict),
    ((bytes, bytearray), StableDigest._bytes),
    (_STR_TYPES, StableDigest._str_like),
    (torch.Tensor, StableDigest._tensor),
    (nn.Module, StableDigest._module),
    (types.CodeType, StableDigest._code),
    (types.FunctionType, StableDigest._function),
    (functools.partial, StableDigest._partial),
    (types.MethodType, StableDigest._method),
    ((type, types.ModuleType, types.BuiltinFunctionType, types.BuiltinMethodType), StableDigest._named),
)
