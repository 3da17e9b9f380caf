"""Model fingerprints: the identity a plan and a receipt are bound to."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import linecache
import types
from typing import TYPE_CHECKING

from .model import ModelFingerprint, ParamSignature

if TYPE_CHECKING:   # annotations only: remat.profile imports this module without torch (NOTE [import cost] in remat._lazy)
    from torch import nn

# NOTE [class identity without source]
# A class's revision is the sha256 of its source (``inspect.getsource``). That fails for classes
# whose module is not in ``sys.modules`` (a file loaded with ``spec_from_file_location`` and not
# registered) and for classes defined in a notebook cell or a REPL, and the old fallback (the
# module and qualified name) differed from the source hash the CLI computed for the same class
# ("source of class ... changed"). So, in order:
# 1. ``inspect.getsource``;
# 2. the same text found from the class's own functions: their ``co_filename`` through
#    ``linecache`` (which holds notebook cells and reads files from disk), the ``class`` block
#    that contains the first function's first line, from its first decorator to its last line,
#    as ``inspect.getsource`` cuts it: the same hash as 1 wherever both work;
# 3. no text anywhere (``exec`` of a string, a class built by ``type()``): a *structural* hash of
#    the qualified name, the bases' names, and every function's bytecode, constants and names
#    (recursively), which is stable for the same class within and across processes of one Python
#    version. The fingerprint lists such classes in ``structural_classes`` (it says so).
# C-implemented classes have no Python functions and hash their qualified name and bases (3).


@functools.lru_cache(maxsize=4096)
def _class_identity(cls: type) -> tuple[str, bool]:
    """(16-hex hash, structural?) of ``cls`` (NOTE [class identity without source])."""
    src = _class_source(cls)
    if src is not None:
        return hashlib.sha256(src.encode()).hexdigest()[:16], False
    return _structural_hash(cls), True


def class_source_hash(cls: type) -> str:
    return _class_identity(cls)[0]


def is_structural(cls: type) -> bool:
    """Whether ``cls``'s hash is structural: no source text could be found (NOTE [class identity without source])."""
    return _class_identity(cls)[1]


def _class_source(cls: type) -> str | None:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # built in C, defined in a REPL, or its module is not in sys.modules
        pass
    return _source_from_functions(cls)


def _own_functions(cls: type) -> list[types.FunctionType]:
    out = []
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if isinstance(value, types.FunctionType) and value.__qualname__.startswith(cls.__qualname__ + "."):
            out.append(value)
    return out


def _source_from_functions(cls: type) -> str | None:
    """The ``class`` block's text, found through the class's functions (step 2 of the NOTE)."""
    funcs = _own_functions(cls)
    if not funcs:
        return None
    fn = min(funcs, key=lambda f: f.__code__.co_firstlineno)
    lines = linecache.getlines(fn.__code__.co_filename, fn.__globals__)
    if not lines:
        return None
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    line = fn.__code__.co_firstlineno
    best: ast.ClassDef | None = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.ClassDef) and node.name == cls.__name__ and node.end_lineno is not None
                and node.lineno <= line <= node.end_lineno):
            if best is None or node.lineno > best.lineno:   # the innermost class holding it
                best = node
    if best is None or best.end_lineno is None:
        return None
    start = best.decorator_list[0].lineno if best.decorator_list else best.lineno
    return "".join(lines[start - 1:best.end_lineno])


def _code_digest(code: types.CodeType, h: "hashlib._Hash") -> None:
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_digest(const, h)
        else:
            h.update(repr(const).encode())


def _structural_hash(cls: type) -> str:
    h = hashlib.sha256(b"structural:")
    h.update(cls.__qualname__.encode())
    h.update(repr([b.__qualname__ for b in cls.__bases__]).encode())
    for fn in sorted(_own_functions(cls), key=lambda f: f.__qualname__):
        h.update(fn.__qualname__.encode())
        _code_digest(fn.__code__, h)
    return h.hexdigest()[:16]


def module_revision(module: nn.Module) -> str:
    """Revision hash of one boundary: its class source + its parameter shapes (receipt per boundary)."""
    h = hashlib.sha256()
    for sub in module.modules():
        h.update(f"{type(sub).__qualname__}:{class_source_hash(type(sub))}".encode())
    for name, p in module.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


def fingerprint(model: nn.Module) -> ModelFingerprint:
    modules = tuple((name, type(m).__qualname__) for name, m in model.named_modules())
    params = tuple(ParamSignature(name=n, shape=tuple(p.shape), dtype=str(p.dtype).replace("torch.", ""))
                   for n, p in model.named_parameters(remove_duplicate=False))
    # keyed by qualname, not module: a file workload's module name depends on where the
    # checkout lives, and a receipt must re-check from any clone
    classes = {type(m) for m in model.modules()}
    hashes = tuple(sorted({(c.__qualname__, class_source_hash(c)) for c in classes}))
    structural = tuple(sorted({c.__qualname__ for c in classes if is_structural(c)}))
    parts: list = [modules, [(p.name, p.shape, p.dtype) for p in params], hashes]
    if structural:   # only then: fingerprints of classes with source keep their digests
        parts.append(["structural", list(structural)])
    payload = json.dumps(parts)
    return ModelFingerprint(modules=modules, params=params, class_source_hashes=hashes,
                            digest=hashlib.sha256(payload.encode()).hexdigest(), structural_classes=structural)
