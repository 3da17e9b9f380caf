"""Segment candidates: one checkpoint around a run of consecutive sibling modules.

NOTE [segments]
``torch.utils.checkpoint.checkpoint_sequential`` checkpoints a *run* of blocks as one unit:
only the run's input is kept, the inputs of the blocks inside it are recomputed. A wrapper
per module cannot express that (each checkpointed block keeps its own input), which is why
``checkpoint_sequential:4`` reached a lower peak than any per-module plan on ``mlp``.

A segment is named ``container[a:b]``: the children of module ``container`` (``""`` for the
root, written ``[a:b]``) at positions ``a .. b-1`` of ``list(container.named_children())``.
It is offered only with evidence from the profiled step (NOTE [single tensor passed along]),
never from the model's class alone.

NOTE [single tensor passed along]
Children ``i`` and ``i + 1`` of a container are *linked* when, in the recorded forward,
- each was called exactly once, with one positional tensor argument and no keyword arguments,
  and returned one tensor;
- child ``i + 1``'s argument is the very tensor object child ``i`` returned;
- no forward op read child ``i``'s output except ops run inside child ``i`` itself or child
  ``i + 1`` (an in-place ``relu_`` or a skip connection in the parent reads it elsewhere).
Then the parent's code between the two calls is "pass it along", and running the run's
modules back to back from its input is what the parent would have computed. ``remat.apply``
runs the whole run when its first module is called and makes the later ones return their
argument, which it checks is the object the run returned (a typed error otherwise).

NOTE [segment count]
A run of n linked children gets, for every distinct length L = n // K (K = 2..n, L >= 2),
the tiling [0:L], [L:2L], ... aligned at the run's start: exactly the segments
``checkpoint_sequential`` uses for any K (its last segment is never checkpointed), about
n log n candidates, n per length. A run that is only part of its container's children (the
stem conv1 -> bn1 -> relu -> maxpool among a ResNet's root children) also gets itself as
one segment; a run of all of them would be the container itself. Runs longer than ``MAX_RUN_LENGTHS`` distinct lengths
keep a geometric subset of lengths (about x1.5 apart). Containers searched: the parents of
the natural blocks (NOTE [natural blocks]) and the root; children that are ancestors of
the blocks (a stage, HF's ``transformer``) or have no forward end a run.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from typing import Any

import torch
from torch import nn

from ..errors import CandidateError
from ..types import MODULE_PATH_RE

MAX_RUN_LENGTHS = 8          # distinct segment lengths per run (NOTE [segment count])

_SEGMENT_RE = re.compile(f"^(?P<container>{MODULE_PATH_RE})?\\[(?P<a>[0-9]+):(?P<b>[0-9]+)\\]$")


@dataclasses.dataclass(frozen=True)
class SegmentName:
    """``container[start:stop]`` (NOTE [segments]); ``container`` is ``""`` for the root."""

    container: str
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop - 1:
            raise CandidateError(f"segment {self}: needs at least two modules (start < stop - 1), "
                                 f"got start {self.start}, stop {self.stop}")

    def __str__(self) -> str:
        return f"{self.container}[{self.start}:{self.stop}]"

    def member_paths(self, model: nn.Module) -> list[str]:
        """Paths of the member modules in ``model``; CandidateError when the segment does not fit it."""
        return [p for p, _ in segment_members(model, str(self))]


def is_segment(name: str) -> bool:
    return name.endswith("]") and "[" in name


def parse_segment(name: str) -> SegmentName:
    """``"blocks[2:5]"`` -> SegmentName; CandidateError naming the expected form otherwise."""
    m = _SEGMENT_RE.match(str(name))
    if m is None:
        raise CandidateError(f"{str(name)[:80]!r} is not a segment name; segments read container[start:stop], "
                             "e.g. blocks[2:5] (children 2, 3, 4 of blocks) or [0:4] (the root's first four children)")
    return SegmentName(m.group("container") or "", int(m.group("a")), int(m.group("b")))


def segment_members(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """(path, module) of each member of segment ``name`` in ``model``, in order; CandidateError if it does not fit."""
    seg = parse_segment(name)
    try:
        container = model.get_submodule(seg.container) if seg.container else model
    except AttributeError:
        raise CandidateError(f"segment {name}: the model has no module {seg.container!r}") from None
    children = list(container.named_children())
    if seg.stop > len(children):
        raise CandidateError(f"segment {name}: {seg.container or 'the root'} has {len(children)} children, "
                             f"so positions {seg.start}..{seg.stop - 1} do not exist")
    prefix = f"{seg.container}." if seg.container else ""
    return [(prefix + n, m) for n, m in children[seg.start:seg.stop]]


def segment_lengths(n: int) -> list[int]:
    """Segment lengths for a run of ``n`` linked children (NOTE [segment count]), ascending."""
    lengths = sorted({n // k for k in range(2, n + 1) if n // k >= 2})
    if len(lengths) <= MAX_RUN_LENGTHS:
        return lengths
    kept: list[int] = []
    for length in lengths:
        if not kept or length >= kept[-1] * 1.5:
            kept.append(length)
    return kept


def run_segments(container: str, first: int, n: int, *, children: int | None = None) -> list[SegmentName]:
    """The segments of one run of ``n`` linked children starting at position ``first``; when the run is
    a proper part of the container's ``children`` (a ResNet's stem among the root's children), the
    whole run is one more segment (NOTE [segment count])."""
    out = []
    lengths = segment_lengths(n)
    if children is not None and n < children and n not in lengths:
        lengths.append(n)
    for length in lengths:
        for i in range(n // length):
            out.append(SegmentName(container, first + i * length, first + (i + 1) * length))
    return out


# -- evidence from the recorded step (NOTE [single tensor passed along]) --------------------------

@dataclasses.dataclass
class _Call:
    calls: int = 0
    simple: bool = True                 # one positional tensor in, no kwargs, one tensor out
    arg: weakref.ReferenceType | None = None
    arg_id: int = 0
    out_id: int = 0
    out_key: int = 0
    foreign_reads: int = 0              # forward ops outside this child and the next that read its output


class ChainProbe:
    """Hooks on the children of the searched containers for one recorded step.

    ``watch`` maps a child output's storage key to (its tracker record, the child path); the
    profiler's op observer calls :meth:`read` for every forward op's tensor arguments.
    """

    def __init__(self, model: nn.Module, containers: list[str], ends_run: set[str]) -> None:
        self.children: dict[str, list[str]] = {}
        self.calls: dict[str, _Call] = {}
        self.next_of: dict[str, str] = {}
        self.watch: dict[int, tuple[Any, str]] = {}
        self._hooks: list[Any] = []
        self._model = model
        self._ends = ends_run
        modules = dict(model.named_modules())
        for c in containers:
            mod = modules.get(c) if c else model
            if mod is None:
                continue
            prefix = f"{c}." if c else ""
            kids = [prefix + n for n, _ in mod.named_children()]
            self.children[c] = kids
            for a, b in zip(kids, kids[1:]):
                self.next_of[a] = b
        self._modules = {p: modules[p] for kids in self.children.values() for p in kids if p in modules}

    def install(self, records: Any) -> None:
        """``records``: the tracker's live storage records (key -> record), to tie outputs to storages."""
        self._records = records
        for path, m in self._modules.items():
            self.calls[path] = _Call()
            self._hooks.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, p=path: self._pre(p, args, kwargs), with_kwargs=True))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, p=path: self._post(p, out)))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _pre(self, path: str, args: tuple, kwargs: dict) -> None:
        if torch._C._current_graph_task_id() != -1:
            return   # a replay in backward is not a call
        c = self.calls[path]
        c.calls += 1
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            c.simple = False
        else:
            c.arg_id = id(args[0])

    def _post(self, path: str, out: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        c = self.calls[path]
        if not isinstance(out, torch.Tensor):
            c.simple = False
            return
        c.out_id = id(out)
        c.out_key = out.untyped_storage()._cdata
        rec = self._records.get(c.out_key)
        if rec is not None:
            self.watch[c.out_key] = (rec, path)

    def read(self, args: tuple, module: str) -> None:
        """One forward op ran in ``module`` (innermost) with ``args``: note reads of watched outputs."""
        if not self.watch or torch._C._current_graph_task_id() != -1:
            return
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if not isinstance(t, torch.Tensor):
                    continue
                hit = self.watch.get(t.untyped_storage()._cdata)
                if hit is None or self._records.get(t.untyped_storage()._cdata) is not hit[0]:
                    continue
                owner = hit[1]
                nxt = self.next_of.get(owner, "\0")
                inside = any(module == p or module.startswith(p + ".") for p in (owner, nxt))
                if not inside:
                    self.calls[owner].foreign_reads += 1

    def linked(self, a: str, b: str) -> bool:
        ca, cb = self.calls.get(a), self.calls.get(b)
        return (ca is not None and cb is not None and ca.calls == 1 and cb.calls == 1 and ca.simple and cb.simple
                and ca.out_id != 0 and ca.out_id == cb.arg_id and ca.foreign_reads == 0)

    def runs(self) -> list[tuple[str, int, int]]:
        """Maximal runs of linked children: (container, first position, length >= 2)."""
        out = []
        for container, kids in self.children.items():
            i = 0
            while i < len(kids):
                j = i
                while j + 1 < len(kids) and kids[j] not in self._ends and kids[j + 1] not in self._ends \
                        and self.linked(kids[j], kids[j + 1]):
                    j += 1
                if j > i:
                    out.append((container, i, j - i + 1))
                i = j + 1
        return out
