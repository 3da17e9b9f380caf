"""Dry runs: does each checkpoint mode actually run on each candidate? (so that nothing crashes later)

NOTE [mode dry runs]
A mode the profiler measured can still fail when it runs: torch's selective policy raises
``aten.slice.Tensor encountered during backward but not found in storage`` on Hugging
Face GPT-2 attention, and a replay that takes another branch raises ``CheckpointError``
(shapes differ). Found at plan, verify or trace time, such a failure is a crash after the
expensive work; found here, it is an exclusion with its reason, never offered to a planner.

So after profiling, each mode runs once (forward + backward, no optimizer step) on the
profiled model with the candidates wrapped in torch's own non-reentrant checkpoint
(``remat.apply`` sits below this stage, so the wrapping is the few lines below, the same
call and the same SAC op set). Identical candidates share their verdicts (NOTE [shared dry
runs]) and candidates that share no module run in the same pass (NOTE [packed dry runs]), so
a model that runs clean costs a pass or two; a pass that fails is narrowed down until each
failure is a (candidate, mode) that fails alone (NOTE [suspect first]), so each exclusion
names the candidate that fails and its error. Gradients are reset and buffers restored
afterwards: the dry run leaves the model as it found it.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections import defaultdict
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..host_rng import rewinding
from ..sac_hooks import sac_checkpoint_kwargs
from ..types import OP_POLICY_MODES, CheckpointMode, RankReduce, is_cheap_op, sac_saves
from ..workload.contract import TrainingStep
from .model import CandidateCost
from .segments import is_segment, parse_segment, segment_members
from .shared import dry_run_leaders, dry_run_signatures


def _sac_policy(mode: CheckpointMode, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """An op-level mode's policy (NOTE [op-level policies]): keep what ``sac_saves`` keeps, recompute the rest."""
    packet = getattr(op, "_overloadpacket", None)
    return CheckpointPolicy.MUST_SAVE if sac_saves(mode, getattr(packet, "__name__", ""), is_cheap_op(op)) \
        else CheckpointPolicy.PREFER_RECOMPUTE


_REGION_ATTR = "_remat_dry_run_region"   # set on an exception by the innermost wrapped region it passed through


def _tagging(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` (a region's forward, which checkpoint also runs as its replay in backward), naming the region
    on any exception that passes through it (the innermost region first): NOTE [suspect first]."""
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            if not hasattr(exc, _REGION_ATTR):
                try:
                    setattr(exc, _REGION_ATTR, name)
                except (AttributeError, TypeError):   # an exception type without attributes: no hint
                    pass
            raise
    return run


def _wrap(module: nn.Module, mode: CheckpointMode, tag: str | None = None) -> Callable[[], None]:
    """Install a checkpointing instance ``forward`` on ``module``; returns its remover. ``tag``: name the
    region on exceptions raised in its forward or replay (NOTE [suspect first])."""
    original = module.forward
    had_instance = "forward" in module.__dict__
    extra: dict[str, Any] = {}
    if mode in OP_POLICY_MODES:
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                functools.partial(_sac_policy, mode))
        extra.update(sac_checkpoint_kwargs(checkpoint))   # NOTE [SAC under saved-tensor hooks]

    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(lambda leaf: leaf, (args, kwargs))   # NOTE [argument containers] (apply)
        fn = functools.partial(original, **kwargs) if kwargs else original
        if tag is not None:
            fn = _tagging(fn, tag)
        return checkpoint(rewinding(fn), *args, use_reentrant=False, **extra)   # NOTE [host RNG]

    module.forward = forward  # type: ignore[method-assign]

    def remove() -> None:
        if had_instance:
            module.forward = original  # type: ignore[method-assign]
        else:
            del module.__dict__["forward"]
    return remove


def region_module(model: nn.Module, modules: dict[str, nn.Module], name: str) -> nn.Module:
    """The module a candidate names; for a segment (NOTE [segments]) a transient ``nn.Sequential`` of its
    members (the same module objects, not re-parented), whose forward runs them back to back."""
    if is_segment(name):
        return nn.Sequential(*(m for _, m in segment_members(model, name)))
    return modules[name]


def _wrap_named(model: nn.Module, modules: dict[str, nn.Module], name: str, mode: CheckpointMode) -> Callable[[], None]:
    """``_wrap`` for a module candidate; for a segment, checkpoint the run when its first member is
    called and let the later members hand back their argument (what remat.apply does)."""
    if not is_segment(name):
        return _wrap(modules[name], mode, tag=name)
    members = [m for _, m in segment_members(model, name)]
    head, rest = members[0], members[1:]
    run_chain = [m.forward for m in members]       # the members' own forwards, before any wrapping

    def whole(x: Any) -> Any:
        for f in run_chain:
            x = f(x)
        return x

    def head_forward(x: Any) -> Any:
        return checkpoint(rewinding(_tagging(whole, name)), x, use_reentrant=False)

    def passthrough(x: Any) -> Any:
        return x

    had = [("forward" in m.__dict__) for m in members]
    head.forward = head_forward   # type: ignore[method-assign]
    for m in rest:
        m.forward = passthrough   # type: ignore[method-assign]

    def remove() -> None:
        for m, h, f in zip(members, had, run_chain):
            if h:
                m.forward = f  # type: ignore[method-assign]
            else:
                del m.__dict__["forward"]
    return remove


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


Held = list[tuple[nn.Parameter, torch.Tensor | None, torch.Tensor | None]]


def held_grads(model: nn.Module) -> Held:
    """Each parameter, its gradient as a measurement pass finds it, and a copy of its value: a pass's backward
    adds into an existing ``p.grad`` in place (an accumulated step keeps them allocated between steps: NOTE
    [accumulated step] in workload/contract.py), so the object alone would not restore it."""
    with torch.no_grad():
        return [(p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]


def put_back(grads: Held, buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Restore the gradients (the same objects, their values) and buffer values a measurement pass found
    (``held_grads``): it leaves the model as it was."""
    with torch.no_grad():
        for p, g, value in grads:
            p.grad = g
            if g is not None and value is not None and not torch.equal(g, value):
                g.copy_(value)
        for b, v in buffers:
            if not torch.equal(b, v):
                b.copy_(v)


class _DryRunner:
    def __init__(self, step: TrainingStep, step_index: int, ranks: RankReduce | None = None) -> None:
        self.step = step
        self.model = step.workload.model
        self.modules = dict(self.model.named_modules())
        self.step_index = step_index
        self.ranks = ranks   # a job's ranks: every pass's outcome agreed over them (NOTE [dry runs in a job])
        self.passes = 0   # forward + backward passes run (units: passes)
        self.suspect: str | None = None   # the region the last failure passed through (NOTE [suspect first])

    def attempt(self, assignment: dict[str, CheckpointMode]) -> str | None:
        """Forward + backward with each named candidate wrapped in its mode; None when it ran, else the error
        (``self.suspect``: the wrapped region the error passed through, if any: NOTE [suspect first]). In a
        job, the pass failed when it failed on any rank: the first such rank's error and suspect, on every
        rank (NOTE [dry runs in a job] in profile/shared.py)."""
        error = self._attempt_here(assignment)
        if self.ranks is None:
            return error
        outcomes = self.ranks.gather((error, self.suspect))
        failed = [(r, e, s) for r, (e, s) in enumerate(outcomes) if e is not None]
        if not failed:
            self.suspect = None
            return None
        rank, error, self.suspect = failed[0]
        return f"rank {rank}: {error}"

    def _attempt_here(self, assignment: dict[str, CheckpointMode]) -> str | None:
        """:meth:`attempt` on this process alone."""
        self.suspect = None
        self.passes += 1
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        grads = held_grads(self.model)
        removers = [_wrap_named(self.model, self.modules, n, mode) for n, mode in assignment.items()]
        try:
            with _no_gradient_sync(self.model):
                batch = self.step.batch(self.step_index)
                loss = self.step.workload.loss(self.model, batch)
                loss.backward()
            return None
        except Exception as exc:  # noqa: BLE001  any failure is the mode's: the plain step ran
            self.suspect = getattr(exc, _REGION_ATTR, None)
            _reshard(self.model)
            cause = exc.__cause__ if exc.__cause__ is not None and type(exc).__name__ == "UserCodeError" else exc
            return _first_line(cause)
        finally:
            for remove in reversed(removers):
                remove()
            put_back(grads, buffers)


def _levels(candidates: list[CandidateCost]) -> dict[tuple, list[CandidateCost]]:
    """Candidates by level: module candidates by nesting depth; segments by (container, length), whose
    tilings are disjoint (NOTE [segment count]). Candidates of one level never nest."""
    names = {c.name for c in candidates}
    levels: dict[tuple, list[CandidateCost]] = defaultdict(list)
    for c in candidates:
        key = ((1, parse_segment(c.name).container, len(c.members)) if c.members else
               (0, sum(1 for i in range(1, c.name.count(".") + 1) if ".".join(c.name.split(".")[:i]) in names)))
        levels[key].append(c)
    return levels


def _modes(c: CandidateCost) -> list[CheckpointMode]:
    return [m for m in CheckpointMode if m is not CheckpointMode.KEEP and m in c.saved_bytes]


def _passes(level: list[CandidateCost], leader: dict[str, str]) -> list[dict[str, CheckpointMode]]:
    """One level's dry-run passes (NOTE [shared dry runs] in profile/shared.py): each group of identical
    candidates tries its modes on different members in the same pass, so a level of N identical
    blocks and M modes takes ceil(M / N) passes, not M."""
    groups: dict[str, list[CandidateCost]] = defaultdict(list)
    for c in level:
        groups[leader[c.name]].append(c)
    passes: list[dict[str, CheckpointMode]] = []
    for members in groups.values():
        for i, mode in enumerate(_modes(members[0])):
            k, member = divmod(i, len(members))
            while len(passes) <= k:
                passes.append({})
            passes[k][members[member].name] = mode
    return passes


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """A dry run under DDP without its gradient all-reduce: a mode that fails in backward would
    otherwise leave DDP's reducer waiting for a reduction, and the job's next step (remat.auto
    profiles a wrapped model in place: NOTE [wrapped models in place]) fails with "Expected to have
    finished reduction in the prior iteration". The dry run checks that a mode runs, never its
    synchronized gradients (they are put back after it anyway)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def _reshard(model: nn.Module) -> None:
    """After a failed dry run under FSDP2: every unit back to its sharded parameters. A backward that
    raised never ran FSDP2's post-backward reshard, and ``model.parameters()`` would then hand out the
    unsharded parameters instead of the shards the job (and its optimizer) holds."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # a torch without distributed: no FSDP2 units to reshard
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _overlap(paths: set[str], used: set[str]) -> bool:
    """Whether a region of module ``paths`` shares a module with, or nests in or around, the regions of ``used``."""
    for p in paths:
        parts = p.split(".")
        if any(".".join(parts[:i]) in used for i in range(1, len(parts) + 1)):
            return True      # the same module, or one that encloses it
        if any(q.startswith(p + ".") for q in used):
            return True      # it encloses one
    return False


def _region_paths(model: nn.Module, name: str) -> set[str]:
    """The module paths a candidate wraps: a segment's members, else the module itself."""
    return {p for p, _ in segment_members(model, name)} if is_segment(name) else {name}


# orderings of the entries tried by ``_pack`` beyond the three fixed ones: seeded shuffles (each first-fit
# over gpt's 29-37 entries at n_layer 32 takes about 1.5 ms; a pass is a training step)
_PACK_SHUFFLES = 48


def _pack(model: nn.Module, entries: list[tuple[str, CheckpointMode]],
          stands_for: dict[str, list[CandidateCost]]) -> list[dict[str, CheckpointMode]]:
    """Every level's (candidate, mode) entries packed into as few passes as fit (NOTE [packed dry runs]).

    Each entry stands for its group (``stands_for``) and any member of the group offered the mode may
    run it. First-fit places each entry's first member that overlaps nothing already wrapped in a pass
    (the same module, or one enclosing or enclosed by it), or opens a new pass; the fewest passes of
    several orders of the entries win (the first on a tie): largest regions first; the most constrained
    first (fewest members that may run it, then largest); largest then most constrained; and
    ``_PACK_SHUFFLES`` seeded shuffles. One order alone can take more passes than needed (a one-member
    group's modes, each overlapping every segment over its block, placed last; measured: benchmarks/RESULTS.md,
    "Figures moved from docstrings")."""
    paths = {c.name: _region_paths(model, c.name) for cs in stands_for.values() for c in cs}   # entries' own too
    members = {(name, mode): [name, *(c.name for c in stands_for[name] if c.name != name and mode in c.saved_bytes)]
               for name, mode in entries}

    def size(entry: tuple[str, CheckpointMode]) -> int:
        return len(paths[entry[0]]) if is_segment(entry[0]) else 1

    orders = [sorted(entries, key=size, reverse=True),     # stable: level order among equals
              sorted(entries, key=lambda e: (len(members[e]), -size(e))),
              sorted(entries, key=lambda e: (-size(e), len(members[e])))]
    rng = random.Random(0)
    for _ in range(_PACK_SHUFFLES):
        shuffled = list(entries)
        rng.shuffle(shuffled)
        orders.append(shuffled)
    return min((_first_fit(order, members, paths) for order in orders), key=len)


def _first_fit(entries: list[tuple[str, CheckpointMode]], members: dict[tuple[str, CheckpointMode], list[str]],
               paths: dict[str, set[str]]) -> list[dict[str, CheckpointMode]]:
    """``entries`` in this order, each on the first pass where one of its members overlaps nothing wrapped."""
    packed: list[tuple[dict[str, CheckpointMode], set[str]]] = []
    for name, mode in entries:
        placed = False
        for assignment, used in packed:
            for cand in members[(name, mode)]:
                if cand in assignment:
                    continue
                if not _overlap(paths[cand], used):
                    assignment[cand] = mode
                    used |= paths[cand]
                    placed = True
                    break
            if placed:
                break
        if not placed:
            packed.append(({name: mode}, set(paths[name])))
    return [a for a, _ in packed]


def _isolate(runner: _DryRunner, assignment: dict[str, CheckpointMode], error: str,
             kin: dict[str, Hashable]) -> list[tuple[str, CheckpointMode, str]]:
    """The (candidate, mode, error) entries of a failed pass (its ``error``) that fail alone; a pass of one
    entry is its own evidence. ``kin``: candidate name -> its ``dry_run_signatures`` entry.

    NOTE [suspect first]
    Retrying every entry of a failed pass alone makes a pass of 5 with one failing mode cost 6 passes
    (what that cost: benchmarks/RESULTS.md, "Figures moved from docstrings"). Each wrapped region
    names itself on an exception that passes through its forward or its replay (``_tagging``), so
    the failed pass points at a suspect; it is retried alone first, and once an entry has failed
    alone (the evidence: nothing is excluded on the hint), the rest of the pass is retried together
    and, if that runs, is cleared in one pass. An entry that
    runs alone is cleared; without a hint, or a hint that ran alone, the entries are retried in
    order. A rest of one entry that fails is its own evidence.

    Two refinements bound the cost where a pass holds several failures. (1) Twins first: an entry of
    the same signature (``kin``) and mode as one that just failed alone is likely to fail too, and
    is retried alone next instead of the rest together. Identical blocks that noisy forward times
    split into groups (NOTE [shared dry runs]) share a pass in one mode, and retrying the rest
    together after each failure costs two passes per block. (2) A rest retried together that fails without naming one of
    its entries tells nothing more: its entries are then retried alone, in order, so a pass of n
    entries without hints takes at most n + 1 retries.
    """
    if len(assignment) == 1:
        (name, mode), = assignment.items()
        return [(name, mode, error)]
    remaining = dict(assignment)
    suspect = runner.suspect
    together = True          # retry the rest together once a failure is confirmed (refinement 2)
    explained = False        # a failure confirmed alone since the rest was last seen to fail
    failed: list[tuple[str, CheckpointMode, str]] = []
    while remaining:
        if explained and together and suspect is None:
            rest_error = runner.attempt(remaining)
            if rest_error is None:
                break
            if len(remaining) == 1:        # a pass of one entry is its own evidence
                (name, mode), = remaining.items()
                failed.append((name, mode, rest_error))
                break
            suspect, explained = runner.suspect, False
            together = suspect in remaining
            continue
        name = suspect if suspect in remaining else next(iter(remaining))
        mode = remaining.pop(name)
        error = runner.attempt({name: mode})
        suspect = None
        if error is not None:
            failed.append((name, mode, error))
            explained = True
            suspect = next((n for n, m in remaining.items() if m is mode and kin[n] == kin[name]),
                           None)   # refinement 1: a twin of the failure, alone next
    return failed


def dry_run_modes(step: TrainingStep, candidates: list[CandidateCost], step_index: int, *,
                  ranks: RankReduce | None = None,
                  stats: dict[str, int] | None = None) -> dict[str, dict[CheckpointMode, str]]:
    """Run every measured (candidate, mode) once (NOTE [mode dry runs]), identical candidates once per mode
    (NOTE [shared dry runs] in profile/shared.py), packed into shared passes (NOTE [packed dry runs]);
    name -> mode -> error. ``stats["passes"]``: passes run. ``ranks``: a job's ranks, which run the same
    passes in the same order (NOTE [dry runs in a job] in profile/shared.py).

    NOTE [packed dry runs]
    Levels (``_levels``: module candidates by nesting depth, segments by (container, length)) used to
    take their passes one level at a time: a transformer's blocks, then their children, then each
    segment length (8 on a chain of 32 blocks, NOTE [segment count]), and on the built-in gpt at
    n_layer 32 the dry runs were the largest stage of ``remat plan``. A (candidate, mode)'s verdict
    stands for every identical candidate of its level (NOTE [shared dry runs]), so any one of them
    can run it, and candidates that share no module (none is, encloses or is enclosed by another)
    can run in the same pass whatever their level: a block's mode on block 0, its attention's on
    block 5, a segment over blocks 16 to 31. Each entry is placed where it overlaps nothing wrapped
    yet, in the order of several tried that takes the fewest passes (``_pack``). A failing pass is narrowed down as any is (NOTE
    [suspect first]), so a failure still names its candidate and is recorded for every candidate it stands for.
    """
    runner = _DryRunner(step, step_index, ranks)
    failures: dict[str, dict[CheckpointMode, str]] = defaultdict(dict)
    stands_for: dict[str, list[CandidateCost]] = {}      # name -> the identical candidates its verdict covers
    entries: list[tuple[str, CheckpointMode]] = []
    kin: dict[str, Hashable] = {}                        # name -> its dry-run signature (NOTE [suspect first])
    for _, level in sorted(_levels(candidates).items()):
        signatures = dry_run_signatures(runner.model, runner.modules, level, region_module)
        kin.update(signatures)
        leader = dry_run_leaders(signatures, level, ranks)
        groups: dict[str, list[CandidateCost]] = defaultdict(list)
        for c in level:
            groups[leader[c.name]].append(c)
        for c in level:
            stands_for[c.name] = groups[leader[c.name]]
        entries += [e for p in _passes(level, leader) for e in p.items()]
    for assignment in _pack(runner.model, entries, stands_for):
        error = runner.attempt(assignment)
        if error is None:
            continue
        for name, mode, error in _isolate(runner, assignment, error, kin):
            for c in stands_for[name]:   # the same failure for every candidate it stands for
                if mode in c.saved_bytes:
                    failures[c.name][mode] = error
    if stats is not None:
        stats["passes"] = runner.passes
    return dict(failures)
