"""Blocks no sampled step ran, costed like an identical twin that ran (NOTE [unsampled blocks]).

NOTE [unsampled blocks]
Stochastic depth and layerdrop skip a block when ``torch.rand`` says so. A block skipped in every
sampled step (NOTE [step sample] in profile/sample.py) left no bytes in any profiled step, so it
was no candidate and its activations were in no peak row: the plan was made for a step with one
block fewer than the run will have. An 8-block model, each block skipped with p = 0.3, whose 3
sampled steps all skipped one block, planned under ``--budget 60%`` with no warning and then ran
over budget on 5 of 20 later steps (up to 1.13x); ``remat.auto``, which samples one step per
example batch, ran over on 12 and 15 of 20 steps (1.22x and 1.51x) on two seeds of a model like it.

Dynamic control flow is planned for its worst case: the step in which every dynamic block runs.
A never-run block whose subtree is the same as a block that ran (``module_structure`` of NOTE [shared
replay measurements] in profile/shared.py: the class of every module, every parameter's and
buffer's relative name, shape, dtype and ``requires_grad``) is costed as that *twin* (its bytes,
times and modes), and placed in the forward order by module registration order (after the
candidates registered before it). Merging then treats it as a dynamic candidate absent from every
point, so each point's rows come again with it held where it would be (``_with_absent`` in
profile/sample.py): the prediction covers the step in which it runs too. The twin is the nearest
one registered before it (else after it), and a child of a twinned block takes the same child of
its parent's twin, so ``blocks.3.up`` is costed as ``blocks.2.up`` when ``blocks.3`` is as ``blocks.2``.

Measured (tests/test_dynamic_depth.py's model, torch.profiler over 20 later steps): the
``remat.auto`` seeds above now peak at 0.96x and 0.91x the budget, two more at 0.99x and 0.91x;
planned while blocks 2 and 5 never ran, the step running every block peaks at 0.86x the budget
(1.20x with no twins, the old behaviour).

What this assumes: the twin's inputs have the shapes the never-run block's would have (true of a
residual stack, whose blocks all map (B, T, C) to (B, T, C)); a block with the same parameters on
other shapes would be mis-costed, and the closed loop cannot catch it (no sampled step runs it).
A twinned block's figures are the twin's, not measured on it: the merged profile records them
(``ProfileReport.costed_as_twin``) and :class:`UnsampledBlockWarning` names each with its twin and
the sample's spread, so the prediction says what its evidence is. A never-run block with no twin
among the candidates cannot be costed: :class:`UnsampledBlockWarning` names it with the spread of the sampled steps' unplanned peaks (how much the steps differ, the
figure a block's absence moves), and it stays excluded with that reason. More steps
(``--sample-steps``, or more example batches) make such a block unlikely: p**n for n steps.
"""

from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from ..errors import Option, spell
from ..units import fmt_bytes
from .model import NOT_CALLED, ProfileReport
from .shared import module_structure


class UnsampledBlockWarning(UserWarning):
    """A block ran in no sampled step and has no identical twin that did: the plan cannot cover the step
    in which it runs (NOTE [unsampled blocks] in remat/profile/twins.py)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Twin:
    """A module no sampled step ran (``name``), costed as ``twin``, which ran; ``after``: the candidate
    (or twinned module) registered last before it, which places it in the forward order (None: first)."""

    name: str
    twin: str
    after: str | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unsampled:
    """What the sample left out: the twinned never-run modules, the untwinned ones, and the spread of the
    sampled steps' unplanned peaks (bytes) for the warning."""

    twins: tuple[Twin, ...]
    untwinned: tuple[str, ...]
    peaks: tuple[int, ...]            # each sampled step's unplanned peak (bytes), in point order

    def spread(self) -> str:
        lo, hi = min(self.peaks), max(self.peaks)
        return f"{fmt_bytes(lo)}-{fmt_bytes(hi)}, {(hi - lo) / lo * 100:.0f}% apart" if lo else fmt_bytes(hi)


def never_called(reports: list[ProfileReport]) -> list[str]:
    """Module names excluded as NOT_CALLED at every point (no point offered or called them)."""
    offered = {c.name for r in reports for c in r.candidates}
    names = {n for r in reports for n, why in r.excluded.items() if why == NOT_CALLED}
    return sorted(n for n in names - offered if all(r.excluded.get(n) == NOT_CALLED for r in reports))


def find_twins(model: nn.Module, reports: list[ProfileReport]) -> Unsampled:
    """The never-run modules of ``reports`` (a sample's points, profiled on ``model``'s structure), each with
    the twin it is costed as, or listed as untwinned (NOTE [unsampled blocks])."""
    modules = dict(model.named_modules())
    index = {n: i for i, n in enumerate(modules)}
    ran = [c.name for r in reports for c in r.candidates if not c.members and c.name in modules]
    ran = sorted(set(ran), key=index.__getitem__)
    structures = {n: module_structure(modules[n]) for n in ran}
    twins: dict[str, str] = {}
    placed: list[Twin] = []
    untwinned: list[str] = []
    for name in sorted((n for n in never_called(reports) if n in modules), key=index.__getitem__):
        twin = _child_of_twin(name, twins, structures) or _nearest(name, module_structure(modules[name]), structures, index)
        if twin is not None:
            twins[name] = twin
            earlier = [n for n in (*ran, *twins) if index[n] < index[name]]
            placed.append(Twin(name=name, twin=twin, after=max(earlier, key=index.__getitem__, default=None)))
        elif not any(name.startswith(p + ".") for p in twins):   # a twinned block's rows hold its children's bytes
            untwinned.append(name)
    return Unsampled(twins=tuple(placed), untwinned=tuple(untwinned),
                     peaks=tuple(r.baseline_peak_bytes for r in reports))


def _child_of_twin(name: str, twins: dict[str, str], structures: dict[str, tuple]) -> str | None:
    """The same child of the twin of ``name``'s nearest twinned ancestor, if it ran and is identical."""
    for parent, twin in sorted(twins.items(), key=lambda kv: -len(kv[0])):
        if name.startswith(parent + "."):
            candidate = twin + name[len(parent):]
            return candidate if candidate in structures else None
    return None


def _nearest(name: str, structure: tuple, structures: dict[str, tuple], index: dict[str, int]) -> str | None:
    """The identical module that ran registered nearest before ``name``, else nearest after it."""
    same = [n for n, s in structures.items() if s == structure]
    before = [n for n in same if index[n] < index[name]]
    return before[-1] if before else (same[0] if same else None)


def warn_unsampled(unsampled: Unsampled, costed: dict[str, str]) -> None:
    """:class:`UnsampledBlockWarning` for the never-run modules: those costed as a twin (``costed``: name ->
    twin, what the merged profile records), whose figures no step measured, and those no twin stands for."""
    if costed:
        pairs = [f"{n} as {t}" for n, t in costed.items()]
        shown = ", ".join(pairs[:5]) + (f" (+{len(pairs) - 5})" if len(pairs) > 5 else "")
        warnings.warn(UnsampledBlockWarning(
            f"{len(costed)} module(s) ran in none of the {len(unsampled.peaks)} sampled step(s) and are costed as "
            f"an identical module that ran ({shown}): the plan's prediction for a step in which they run assumes "
            f"they do what their twin did, and no sampled step measured it (the sampled steps' unplanned peaks: "
            f"{unsampled.spread()}). Sample more steps ({spell(Option.SAMPLE_STEPS)}) to measure them "
            "(NOTE [unsampled blocks])"), stacklevel=4)
    if not unsampled.untwinned:
        return
    shown = ", ".join(unsampled.untwinned[:5]) + (f" (+{len(unsampled.untwinned) - 5})"
                                                  if len(unsampled.untwinned) > 5 else "")
    warnings.warn(UnsampledBlockWarning(
        f"{shown} ran in none of the {len(unsampled.peaks)} sampled step(s) and no identical module that ran "
        f"can stand for it: the plan does not cover the steps in which it runs (the sampled steps' unplanned "
        f"peaks: {unsampled.spread()}). Sample more steps ({spell(Option.SAMPLE_STEPS)}) so that it runs in "
        "one (NOTE [unsampled blocks])"), stacklevel=4)
