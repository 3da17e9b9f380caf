"""Finding checkpoint candidates: automatically, or from names / class names / regexes."""

from __future__ import annotations

import re
from collections import Counter

from torch import nn

from ..errors import CandidateError
from .segments import is_segment, parse_segment


def auto_candidates(model: nn.Module) -> list[str]:
    """Every module subtree whose checkpoint could free bytes, in forward-definition order.

    NOTE [natural blocks]
    Architectures name their blocks in many ways: ``nn.ModuleList`` of layers (GPT), a
    ``Sequential`` of residual blocks (ResNet), or distinct classes side by side (a U-Net's
    ``Down``/``Up`` stages, a T5 layer's self-attention and feed-forward halves). So:
    - *blocks*: children that share their class with a sibling: any child of a
      ``ModuleList``/``Sequential`` container, a non-leaf child of any other module (but
      not a generic ``Sequential``: a stem and a body both being ``Sequential`` says nothing);
    - the direct children of blocks (attention vs MLP, a single norm), as before;
    - every other non-leaf module (it has a forward with a subtree that saves tensors),
      except the root and the *ancestors* of blocks: an ancestor of the blocks wraps the
      whole chain (HF's ``transformer``, ResNet's ``layer1``), so its checkpoint would
      replay everything at once and keep nothing it frees;
    - never a module without a forward of its own (``ModuleList``/``ModuleDict``).
    Shared modules appear once, under their first path. Whether a candidate frees anything
    is for the profile to measure (one that frees nothing is excluded there, with its bytes).
    """
    modules = dict(model.named_modules())        # deduplicated: shared modules under their first path
    path_of = {id(m): p for p, m in modules.items()}
    blocks, ancestors = _blocks(model)
    chosen = set(blocks)
    for b in blocks:
        chosen.update(path_of[id(c)] for c in modules[b].children() if id(c) in path_of)
    chosen.update(p for p, m in modules.items() if p and not _leaf(m) and p not in ancestors)
    return [p for p in modules if p in chosen and p not in ancestors and not _no_forward(modules[p])]


def _no_forward(m: nn.Module) -> bool:   # ModuleList/ModuleDict, unless a subclass gives one (DenseNet's blocks)
    return type(m).forward is nn.Module.forward


def _leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


def _blocks(model: nn.Module) -> tuple[list[str], set[str]]:
    """(the natural blocks, their ancestors with the root ``""``): NOTE [natural blocks]."""
    modules = dict(model.named_modules())
    path_of = {id(m): p for p, m in modules.items()}
    no_forward, leaf = _no_forward, _leaf
    blocks: list[str] = []
    for mod in modules.values():
        container = isinstance(mod, (nn.ModuleList, nn.Sequential))
        counts = Counter(type(c) for c in mod.children())
        for child in mod.children():
            path = path_of.get(id(child), "")
            generic = type(child) in (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # two Sequentials are not two blocks
            if path and counts[type(child)] >= 2 and (container or not (leaf(child) or generic)) \
                    and not no_forward(child):
                blocks.append(path)
    ancestors = {".".join(b.split(".")[:i]) for b in blocks for i in range(1, b.count(".") + 1)}
    ancestors.add("")
    return blocks, ancestors


def segment_search(model: nn.Module) -> tuple[list[str], set[str]]:
    """Where to look for segments (NOTE [segment count] in segments.py): (containers, children that end a run).

    Containers: the parents of the natural blocks, and the root. A run ends at a block ancestor
    (a stage: checkpointing it with its neighbours replays everything at once) and at a
    module without a forward of its own.
    """
    blocks, ancestors = _blocks(model)
    parents = {b.rpartition(".")[0] for b in blocks}
    containers = [p for p, _ in model.named_modules() if p in parents or p == ""]
    ends = {p for p, m in model.named_modules() if p and (p in ancestors or _no_forward(m))}
    return containers, ends


def _auto_found(model: nn.Module) -> list[str]:
    found = auto_candidates(model)
    if not found:
        raise CandidateError("no repeated blocks found to checkpoint automatically",
                             tip="name candidates with --candidates (module paths, class names or a regex)")
    return found


def _regex_matches(spec: str, paths: list[str]) -> list[str]:
    """The module paths (root excluded) that regex ``spec`` matches whole; CandidateError when none or not a regex."""
    try:
        rx = re.compile(spec)
    except re.error as exc:
        raise CandidateError(f"candidate {spec!r} is not a module path, a class name or a valid regex ({exc})") from exc
    hits = [p for p in paths if p and rx.fullmatch(p)]
    if not hits:
        sample = ", ".join(list(p for p in paths if p)[:8])
        raise CandidateError(f"candidate {spec!r} matches no module (paths look like: {sample}, ...)")
    return hits


def _resolve_spec(spec: str, modules: dict[str, nn.Module], by_class: dict[str, list[str]]) -> list[str]:
    """One spec's module paths: a segment name, an exact path, a class name, else a regex over paths."""
    if is_segment(spec):
        parse_segment(spec)       # CandidateError for a malformed name; the profile checks the chain
        return [spec]
    if spec in modules and spec:
        return [spec]
    if spec in by_class:
        return [p for p in by_class[spec] if p]
    return _regex_matches(spec, list(modules))


def resolve_candidates(model: nn.Module, specs: list[str] | None) -> list[str]:
    """Module paths for ``specs`` (exact path, class name, or a regex over paths); auto when None."""
    if not specs:
        return _auto_found(model)
    modules = dict(model.named_modules())
    by_class: dict[str, list[str]] = {}
    for path, m in modules.items():
        by_class.setdefault(type(m).__name__, []).append(path)
    out = [p for spec in specs for p in _resolve_spec(spec, modules, by_class)]
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
