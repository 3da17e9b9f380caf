"""The replay-hazard suite (issue 23): one tiny model per hazard class, each caught at plan time
with its module and cause named, each with a safe twin that must not be flagged."""

from __future__ import annotations

import contextlib
import functools

import pytest
from torch import nn

from remat.plan.planners import classify_candidates
from remat.profile import ProfileReport, profile_workload
from remat.types import HazardKind
from remat.verify import verify_plan
from remat.workload import load_workload

from .conftest import FIXTURES, hand_plan

ZOO = f"{FIXTURES / 'hazard_zoo.py'}:build"
BLOCK = "blocks.0"


def _stats_hook(module, args, output):
    """A user's global activation-statistics hook."""
    _stats_hook.calls += 1


def _pre_stats_hook(module, args):
    _pre_stats_hook.calls += 1


_stats_hook.calls = _pre_stats_hook.calls = 0
GLOBAL_HOOKS = {"global_hook": lambda: nn.modules.module.register_module_forward_hook(_stats_hook),
                "global_prehook": lambda: nn.modules.module.register_module_forward_pre_hook(_pre_stats_hook)}


@functools.lru_cache(maxsize=None)
def _profiled(kind: str) -> ProfileReport:
    with contextlib.ExitStack() as stack:
        if kind in GLOBAL_HOOKS:
            stack.callback(GLOBAL_HOOKS[kind]().remove)
        lw = load_workload(ZOO, {"kind": "plain" if kind in GLOBAL_HOOKS else kind})
        return profile_workload(lw, candidates=[BLOCK], repeats=1)


# hazard class: (model with the hazard, its safe twin, words the exclusion must hold, preserve RNG state)
CLASSES = {
    "python attribute counter": ("counting", "caches_shape", ["python_state", "calls"], True),
    "buffer mutated in forward": ("step_buffer", "normed", ["buffer_mutation", "seen"], True),
    "in-place write into the input": ("halves_input", "inplace_inside", ["inplace"], True),
    "tensor-valued attribute": ("ema", "tensor_const", ["python_state", "ema: tensor"], True),
    "module global counter": ("global_counter", "global_const", ["global_state", "global _CALLS", "hazard_zoo.py"],
                              True),
    "module global read, changed before the replay": ("global_reader", "const_reader",
                                                      ["global_read", "global _TICKS", "replays it", "read at replay"],
                                                      True),
    "closure cell counter": ("closure_counter", "closure_reader", ["global_state", "closure cell", ".calls"], True),
    "forward hook inside": ("hook_inner", "hook_outer", ["hook", "count_activation", "submodule lin"], True),
    "pre-forward hook inside": ("prehook_inner", "prehook_outer", ["hook", "count_input", "pre-hook"], True),
    "global forward hook": ("global_hook", "plain", ["hook", "global forward hook", "_stats_hook"], True),
    "global pre-forward hook": ("global_prehook", "plain", ["hook", "global forward pre-hook", "_pre_stats_hook"],
                                True),
    "torch RNG, state not preserved": ("droppath_torch", "plain", ["rng", "CPU", "not preserved"], False),
    "Python random, state not preserved": ("droppath_python", "plain", ["rng", "python random", "not preserved"],
                                           False),
    "numpy RNG, state not preserved": ("droppath_numpy", "plain", ["rng", "numpy random", "not preserved"], False),
}


def _exclusion(kind: str, preserve: bool) -> str | None:
    elig = classify_candidates(_profiled(kind), preserve_rng_state=preserve)
    return next((e.reason for e in elig.excluded if e.module == BLOCK), None)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_hazard_is_caught_at_plan_time_with_module_and_cause(name):
    hazard, _, words, preserve = CLASSES[name]
    reason = _exclusion(hazard, preserve)
    assert reason is not None, f"{name}: {hazard} was not excluded"
    assert all(w in reason for w in words), reason


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_safe_twin_is_not_flagged(name):
    _, twin, _, preserve = CLASSES[name]
    assert _exclusion(twin, preserve) is None
    assert BLOCK in classify_candidates(_profiled(twin), preserve_rng_state=preserve).allowed


def test_suite_covers_at_least_twelve_classes():
    assert len(CLASSES) >= 12


@pytest.mark.parametrize("kind,generator", [("droppath_python", "python random"), ("droppath_numpy", "numpy random"),
                                            ("droppath_torch", "CPU")])
def test_rng_draws_are_safe_while_preserved_and_verify_passes(kind, generator):
    """Python's and numpy's generators are rewound for the replay like torch's (NOTE [host RNG]): no
    CheckpointError; the RNG-off control that raises is counted as rejected, never a crash."""
    (rng,) = [h for c in _profiled(kind).candidates if c.name == BLOCK for h in c.hazards]
    assert rng.kind is HazardKind.RNG and generator in rng.detail
    assert _exclusion(kind, True) is None
    lw = load_workload(ZOO, {"kind": kind})
    report = verify_plan(lw, hand_plan(lw.workload.model, [BLOCK]), steps=2, seeds=1, timing_steps=0)
    assert report.passed, report.failures
    rng_off = next(n for n in report.negative_controls if n.name == "rng_preservation_off")
    assert rng_off.applicable and rng_off.rejected


@pytest.mark.parametrize("hooked,flagged", [("blocks.1", True), ("blocks.2", False)])
def test_a_hook_on_a_segment_member_is_inside_the_segment(hooked, flagged):
    """A member's own hooks fire again when the segment replays (NOTE [replayed hooks]); the hook
    on a module after the segment (the twin) does not."""
    lw = load_workload(f"{FIXTURES / 'segment_workload.py'}:build", {"kind": "chain"})
    lw.workload.model.get_submodule(hooked).register_forward_hook(_stats_hook)
    report = profile_workload(lw, candidates=["blocks[0:2]"], measure_replays=False, repeats=1)
    elig = classify_candidates(report)
    reason = next((e.reason for e in elig.excluded if e.module == "blocks[0:2]"), "")
    assert ("_stats_hook on blocks.1" in reason) is flagged, reason
    assert ("blocks[0:2]" in elig.allowed) is not flagged


def test_verify_names_a_hook_inside_a_hand_planned_boundary():
    """A plan made by hand around a hooked block: the paired runs agree (the hook only counts), yet
    verify fails, naming the block and the hook, instead of passing with no replay hazards."""
    lw = load_workload(ZOO, {"kind": "hook_inner"})
    report = verify_plan(lw, hand_plan(lw.workload.model, [BLOCK]), steps=1, seeds=1, timing_steps=0)
    assert not report.passed
    (h,) = report.hazards
    assert (h.module, h.kind) == (BLOCK, HazardKind.HOOK) and "count_activation on its submodule lin" in h.detail
    twin = load_workload(ZOO, {"kind": "hook_outer"})
    assert verify_plan(twin, hand_plan(twin.workload.model, [BLOCK]), steps=1, seeds=1, timing_steps=0).passed


def _losses(kind: str, boundaries: list[str], steps: int) -> list[float]:
    """Per-step losses of ``steps`` seeded SGD steps, with ``boundaries`` checkpointed by hand (no guard)."""
    import torch

    from remat.wrap import apply

    torch.manual_seed(0)
    lw = load_workload(ZOO, {"kind": kind})
    model = lw.workload.model
    if boundaries:
        apply(model, hand_plan(model, boundaries))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for s in range(steps):
        loss = lw.workload.loss(model, lw.workload.batch(s))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def test_a_global_read_that_changes_before_the_replay_diverges_unmitigated():
    """What the GLOBAL_READ exclusion prevents (NOTE [read at replay]): checkpointing blocks.0 by
    hand, training matches the control bitwise for 8 steps, then diverges (the replay at step 7
    reads the count past warm-up); the safe twin matches for every step."""
    control, planned = _losses("global_reader", [], 10), _losses("global_reader", [BLOCK], 10)
    assert planned[:8] == control[:8]
    assert all(abs(p - c) > 1e-6 * abs(c) for p, c in zip(planned[8:], control[8:])), (planned, control)
    assert _losses("const_reader", [BLOCK], 10) == _losses("const_reader", [], 10)
