"""Finding checkpoint candidates: automatically, or from names / class names / regexes."""

from __future__ import annotations

import re
from collections import Counter

from torch import nn

from ..errors import CandidateError


def auto_candidates(model: nn.Module) -> list[str]:
    """Repeated children of ModuleList/Sequential containers, plus their direct children.

    "Repeated" means a container holding at least two children of the same class: the
    transformer layers of ``h``, the residual ``blocks``. Their direct children give finer
    boundaries (attention vs MLP). Containers themselves are never candidates: they have
    no forward of their own (ModuleList) or are the whole chain (Sequential).
    """
    out: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        counts = Counter(type(c) for c in mod.children())
        for child_name, child in mod.named_children():
            if counts[type(child)] < 2:
                continue
            path = f"{name}.{child_name}" if name else child_name
            out.append(path)
            out += [f"{path}.{g}" for g, _ in child.named_children()]
    seen: set[str] = set()
    return [n for n in out if not (n in seen or seen.add(n))]


def resolve_candidates(model: nn.Module, specs: list[str] | None) -> list[str]:
    """Module paths for ``specs`` (exact path, class name, or a regex over paths); auto when None."""
    if not specs:
        found = auto_candidates(model)
        if not found:
            raise CandidateError("no repeated blocks found to checkpoint automatically",
                                 tip="name candidates with --candidates (module paths, class names or a regex)")
        return found
    modules = dict(model.named_modules())
    by_class: dict[str, list[str]] = {}
    for path, m in modules.items():
        by_class.setdefault(type(m).__name__, []).append(path)
    out: list[str] = []
    for spec in specs:
        if spec in modules and spec:
            out.append(spec)
        elif spec in by_class:
            out += [p for p in by_class[spec] if p]
        else:
            try:
                rx = re.compile(spec)
            except re.error as exc:
                raise CandidateError(f"candidate {spec!r} is not a module path, a class name or a valid regex ({exc})") from exc
            hits = [p for p in modules if p and rx.fullmatch(p)]
            if not hits:
                sample = ", ".join(list(p for p in modules if p)[:8])
                raise CandidateError(f"candidate {spec!r} matches no module (paths look like: {sample}, ...)")
            out += hits
    seen: set[str] = set()
    return [n for n in out if not (n in seen or seen.add(n))]


def parent_of(name: str, names: set[str]) -> str | None:
    """The nearest enclosing candidate of ``name``, if any."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        cand = ".".join(parts[:i])
        if cand in names:
            return cand
    return None
