"""Candidates that are the same region share one replay measurement.

NOTE [shared replay measurements]
A transformer's N blocks are the same code on the same shapes: timing each one's replay
alone (NOTE [measured replay costs] in profile/replay.py) measures one figure N times and
took most of the planning time. So the candidates are grouped by a *signature* and one
member of each group (the first to run) is measured; the others take its estimate.

Two candidates share a signature when all of these are equal:
- the region's structure: the class of every module in its subtree (a segment: of each
  member's, in order), by qualified name, with every parameter's and buffer's relative
  name, shape, dtype and ``requires_grad``;
- its inputs as the captured forward saw them: the pytree structure of ``(args, kwargs)``,
  each tensor's shape, dtype, device and ``requires_grad``, and every non-tensor leaf of a
  plain type (None, bool, int, float, str) by value (anything else by type and identity,
  so two regions handed different objects never share);
- the modes still offered (after the dry runs);
- the bytes the profiled step measured for *this* instance: input bytes, saved bytes and
  first-estimate replay extra bytes per mode. These come from each instance's own window
  in the recorded step, so a region whose structure and shapes match but which does other
  work (another attention mask path, a layer that caches something) shows other bytes and
  is measured on its own: a wrong reuse is caught by figures measured per instance.
And the forward times the profile measured per instance (``fwd_ms``) must agree within a
factor ``FORWARD_RATIO`` (or differ by less than ``FORWARD_FLOOR_MS``): a region that does
other work the bytes do not show (a Python-side sleep, another kernel on the same shapes)
is measured alone. That check is loose on purpose (the profile's forward times are medians
of a few noisy steps); a false alarm only costs one more region's rounds.

What is shared is what the timing rounds produce (replay ms, spread, rounds) and the
tracked replay's extra bytes; each follower records which candidate measured it
(``ReplayEstimate.shared_from``), so a report can say so.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..types import CheckpointMode, RankReduce
from .model import CandidateCost

_PLAIN = (type(None), bool, int, float, str)


def _qualified(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def module_structure(module: nn.Module) -> tuple:
    """Classes, parameter and buffer shapes of ``module``'s subtree (relative names)."""
    classes = tuple((n, _qualified(m)) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers())
    return classes, params, buffers


def _leaf(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), str(leaf.dtype), str(leaf.device), leaf.requires_grad)
    if isinstance(leaf, _PLAIN):
        return (type(leaf).__name__, leaf)
    return (_qualified(leaf), id(leaf))   # an object: shared only with regions handed the same one


def _inputs(inputs: tuple[tuple, dict]) -> tuple:
    leaves, spec = tree_flatten(inputs)
    return str(spec), tuple(_leaf(x) for x in leaves)


def _measured_bytes(cost: CandidateCost) -> tuple:
    """The per-instance byte figures of the profiled step (sorted by mode)."""
    modes = sorted(cost.saved_bytes, key=lambda m: m.value)
    return (cost.input_bytes, tuple((m.value, cost.saved_bytes[m], cost.replay_extra_bytes.get(m)) for m in modes))


def region_signature(region: nn.Module, cost: CandidateCost, inputs: tuple[tuple, dict],
                     modes: list[CheckpointMode]) -> tuple:
    """What must be equal for two candidates to share a replay measurement (NOTE [shared replay measurements]).

    ``region``: the candidate's module (a segment's: the ``nn.Sequential`` of its members)."""
    return module_structure(region), _inputs(inputs), tuple(m.value for m in modes), _measured_bytes(cost)


FORWARD_RATIO = 2.0      # forward times of two instances further apart than this: not the same work
FORWARD_FLOOR_MS = 0.05  # ms; differences below this are not told apart by the profile's timing


def forward_times_agree(a_ms: float, b_ms: float) -> bool:
    """Two instances' profiled forward times are consistent with the same work (NOTE [shared replay measurements])."""
    lo, hi = sorted((a_ms, b_ms))
    return hi - lo < FORWARD_FLOOR_MS or hi <= FORWARD_RATIO * lo


def group_by_signature(signatures: dict[str, Hashable], fwd_ms: dict[str, float]) -> dict[str, str]:
    """Candidate name -> the candidate (in the order given) whose measurement it takes: the first with
    its signature whose forward time agrees with its own; itself when there is none."""
    groups: dict[Hashable, list[str]] = {}
    out: dict[str, str] = {}
    for name, sig in signatures.items():
        leaders = groups.setdefault(sig, [])
        lead = next((n for n in leaders if forward_times_agree(fwd_ms[n], fwd_ms[name])), None)
        if lead is None:
            leaders.append(name)
        out[name] = lead or name
    return out


def dry_run_signatures(model: nn.Module, modules: dict[str, nn.Module], level: list[CandidateCost],
                       region_of: Callable[[nn.Module, dict[str, nn.Module], str], nn.Module]) -> dict[str, Hashable]:
    """Candidate name -> what must be equal for two candidates of ``level`` to share their dry runs,
    forward times aside (``dry_run_leaders`` adds those): structure, modes and per-instance bytes."""
    return {c.name: (module_structure(region_of(model, modules, c.name)), tuple(m.value for m in c.saved_bytes),
                     _measured_bytes(c)) for c in level}


def dry_run_leaders(signatures: dict[str, Hashable], level: list[CandidateCost],
                    ranks: RankReduce | None = None) -> dict[str, str]:
    """Candidate name -> the candidate of ``level`` that stands for it in the dry runs (``signatures``:
    ``dry_run_signatures`` of the level). ``ranks``: the job's ranks, whose figures are agreed first
    (NOTE [dry runs in a job]).

    NOTE [shared dry runs]
    The dry runs (NOTE [mode dry runs] in profile/dryrun.py) ask whether a mode *runs* on a
    candidate: forward and backward of the whole step with it wrapped. Before this, one pass per
    (level, mode) wrapped every candidate of the level, so a transformer's blocks took one pass
    per mode. Identical candidates of one level (the signature of NOTE [shared replay
    measurements] less the captured inputs, which the dry runs have not seen yet: structure,
    modes, per-instance bytes, and forward times that agree; in a job, all of them agreed over the
    ranks first: NOTE [dry runs in a job]) now try their modes on different
    members in one pass: block 0 in ``full``, block 1 in ``selective``, ... A failing pass is
    narrowed down to the (candidate, mode) entries that fail alone (NOTE [suspect first] in
    profile/dryrun.py), and the failure found on one member is recorded for every member it
    stands for. Groups never cross levels; passes may (NOTE [packed dry runs]), and no two
    candidates wrapped in one pass overlap.
    """
    fwd_ms = {c.name: c.fwd_ms for c in level}
    if ranks is not None:
        signatures, fwd_ms = agree_over_ranks(ranks, signatures, fwd_ms)
    return group_by_signature(signatures, fwd_ms)


def agree_over_ranks(ranks: RankReduce, signatures: dict[str, Hashable],
                     fwd_ms: dict[str, float]) -> tuple[dict[str, Hashable], dict[str, float]]:
    """Every rank's signatures and forward times made one (a collective: every rank calls it with the same
    names, in the same order).

    NOTE [dry runs in a job]
    In a torchrun job (``remat.auto`` after FSDP2 / DDP: NOTE [one plan per job] in
    autoplan/ranks.py) every dry-run pass is a training step whose collectives must pair with the
    other ranks' passes, so the ranks must run the same passes in the same order. The groups of
    NOTE [shared dry runs] were made from each rank's *own* forward times: a context switch on one
    rank split a group there and not on the others, that rank ran one pass more, and gloo aborted
    (``op.preamble.length <= op.nbytes``) in 9 of 19 launches of a torchtitan-style job on a busy
    machine. So before grouping, the ranks exchange what the grouping reads: a candidate's
    signature is the tuple of every rank's (equal on every rank; two candidates share a group only
    where they are identical on every rank), its forward time the median over the ranks (one
    figure everywhere, as ``agree_profile`` reduces times). And each pass's outcome is agreed too
    (``_DryRunner.attempt`` in profile/dryrun.py): a pass failed when it failed on any rank, with
    the first such rank's error and suspect, so the narrowing of NOTE [suspect first] takes the
    same branches everywhere. Nothing in the dry runs' control flow is a rank-local figure.
    """
    names = list(signatures)
    per_rank = ranks.gather([signatures[n] for n in names])
    times = ranks.median_ms([fwd_ms[n] for n in names])
    agreed = {n: tuple(sigs[i] for sigs in per_rank) for i, n in enumerate(names)}
    return agreed, dict(zip(names, times))
