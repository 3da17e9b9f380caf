"""Finding checkpoint candidates: automatically, or from names / class names / regexes."""

from __future__ import annotations

import enum
import re
from collections import Counter

from torch import nn

from ..errors import CandidateError, Option, spell
from .segments import is_segment, parse_segment


def auto_candidates(model: nn.Module) -> list[str]:
    """Every module subtree whose checkpoint could free bytes, in forward-definition order.

    NOTE [natural blocks]
    Architectures name their blocks in many ways: ``nn.ModuleList`` of layers (GPT), a
    ``Sequential`` of residual blocks (ResNet), distinct classes side by side (a U-Net's
    ``Down``/``Up`` stages), a ModuleList of distinct stages (a diffusers UNet's
    ``down_blocks``). The *blocks* are children that their siblings mark as such (``_Kind``):
    - STACK: one of several same-class children of a ``ModuleList``/``Sequential`` (GPT's
      ``h.N``, ResNet's ``layer1.N``, a UNet stage's ``resnets.N``);
    - LISTED: a non-leaf child of a ``ModuleList``, the only one of its class there (the
      ``CrossAttnDownBlock2D`` beside a ``DownBlock2D``, the one ``BasicTransformerBlock`` of
      ``transformer_blocks``): a ModuleList holds layers by construction;
    - TWIN: non-leaf siblings of the same class in any other module (``attn1``/``attn2``,
      ``ff``/``ff_context``, BART's ``self_attn``/``encoder_attn``, ``down1``..``down4``), but
      not generic ``Sequential`` ones: a stem and a body both being ``Sequential`` says nothing.
    A *leaf* (``Linear``, ``GELU``, ``Conv2d``, ``BatchNorm2d``) is a block only in a model
    with no non-leaf block at all (a plain ``Sequential`` stack of layers). Elsewhere the
    leaves of a Sequential MLP or of a U-Net stage's ``Sequential(Conv2d, BatchNorm2d, ReLU,
    ...)`` are not blocks: that Sequential is the unit, and one layer alone frees 0-512 B.
    The candidates are then:
    - the blocks; the direct children of STACK and TWIN blocks (attention vs MLP, a norm);
    - every other non-leaf module (it has a forward with a subtree that saves tensors),
      except the root and the *wrappers* of stacks: an ancestor of a STACK block that is not
      a block itself (HF's ``transformer``, ResNet's ``layer1``) wraps the whole chain, so its
      checkpoint would replay everything at once and keep nothing it frees. A block is never
      demoted by the blocks inside it, and twins demote nothing: an SD3
      ``JointTransformerBlock``, a BART decoder layer and a UNet stage stay candidates next
      to their parts, and the planner chooses between them (nested candidates exclude each
      other: NOTE [valid choice] in plan/cost.py; NOTE [small boundaries] in plan/planners.py);
    - never a module without a forward of its own (``ModuleList``/``ModuleDict``).
    Shared modules appear once, under their first path (a module called several times per
    step is costed over all its calls: NOTE [shared modules] in profile/step.py). Whether
    a candidate frees anything is for the profile to measure (one that frees nothing is
    excluded there, with its bytes).
    """
    modules = dict(model.named_modules())        # deduplicated: shared modules under their first path
    path_of = {id(m): p for p, m in modules.items()}
    blocks, wrappers = _blocks(model)
    chosen = set(blocks)
    for b in _blocks(model, listed=False)[0]:
        chosen.update(path_of[id(c)] for c in modules[b].children() if id(c) in path_of)
    chosen.update(p for p, m in modules.items() if p and not _leaf(m) and p not in wrappers)
    return [p for p in modules if p in chosen and p not in wrappers and not _no_forward(modules[p])]


def _no_forward(m: nn.Module) -> bool:   # ModuleList/ModuleDict, unless a subclass gives one (DenseNet's blocks)
    return type(m).forward is nn.Module.forward


def _leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


class _Kind(enum.Enum):
    """How a child became a natural block (NOTE [natural blocks])."""

    STACK = "stack"       # one of several same-class children of a ModuleList/Sequential
    LISTED = "listed"     # the only one of its class in a ModuleList (a diffusers UNet's stages)
    TWIN = "twin"         # same-class non-leaf siblings in any other module (attn1/attn2, Down x4)


def _kind(mod: nn.Module, child: nn.Module, count: int) -> _Kind | None:
    """Whether ``child`` of ``mod`` (``count`` children of its class there) is a block, and how."""
    if _no_forward(child):
        return None
    if isinstance(mod, (nn.ModuleList, nn.Sequential)):
        if count >= 2:
            return _Kind.STACK
        return _Kind.LISTED if isinstance(mod, nn.ModuleList) and not _leaf(child) else None
    generic = type(child) in (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # two Sequentials are not two blocks
    return _Kind.TWIN if count >= 2 and not (_leaf(child) or generic) else None


def _found_blocks(modules: dict[str, nn.Module]) -> list[tuple[str, _Kind, bool]]:
    """(path, kind, is a leaf) of every child that is a block by its siblings, in module order."""
    path_of = {id(m): p for p, m in modules.items()}
    out = []
    for mod in modules.values():
        counts = Counter(type(c) for c in mod.children())
        for child in mod.children():
            path, kind = path_of.get(id(child), ""), _kind(mod, child, counts[type(child)])
            if path and kind is not None:
                out.append((path, kind, _leaf(child)))
    return out


def _blocks(model: nn.Module, *, listed: bool = True) -> tuple[list[str], set[str]]:
    """(the natural blocks, the wrappers of stacks with the root ``""``): NOTE [natural blocks].
    ``listed=False`` leaves out the blocks that are the only one of their class in a ModuleList."""
    found = _found_blocks(dict(model.named_modules()))
    if any(not leaf for _, _, leaf in found):
        found = [f for f in found if not f[2]]        # leaves are blocks only in a plain stack of layers
    blocks = [p for p, kind, _ in found if listed or kind is not _Kind.LISTED]
    kept = set(blocks)
    wrappers = {a for p, kind, _ in found if kind is _Kind.STACK
                for a in (".".join(p.split(".")[:i]) for i in range(1, p.count(".") + 1)) if a not in kept}
    wrappers.add("")
    return blocks, wrappers


def segment_search(model: nn.Module) -> tuple[list[str], set[str]]:
    """Where to look for segments (NOTE [segment count] in segments.py): (containers, children that end a run).

    Containers: the parents of the natural blocks, and the root. A run ends at a wrapper of
    blocks (a stage such as ResNet's ``layer1``: checkpointing it with its neighbours replays
    everything at once) and at a module without a forward of its own.
    """
    blocks, wrappers = _blocks(model)
    parents = {b.rpartition(".")[0] for b in blocks}
    containers = [p for p, _ in model.named_modules() if p in parents or p == ""]
    ends = {p for p, m in model.named_modules() if p and (p in wrappers or _no_forward(m))}
    return containers, ends


def _auto_found(model: nn.Module) -> list[str]:
    found = auto_candidates(model)
    if not found:
        raise CandidateError("no repeated blocks found to checkpoint automatically",
                             tip=f"give remat modules to plan: {spell(Option.CANDIDATES)}")
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
