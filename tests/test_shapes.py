"""The runtime shape guard on remat.auto's handle (NOTE [shape guard]): warn, raise or re-plan at a
batch larger than any planned one; nothing at smaller or equal ones."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import remat
from remat.autoplan import CacheStatus, NewShapeWarning, ShapeEnvelope, ShapeGuard, ShapePolicy
from remat.autoplan.shapes import grow_batch
from remat.errors import AutoError, NewShapeError
from remat.memory import profiler_step_peak
from remat.memory.measure import measure_step_peak
from remat.workload import TrainingStep, Workload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import auto_plain_loop as ex  # noqa: E402


def tokens(seq: int, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 64, (batch, seq + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return ex.TinyLM(64, 32, 2)


# -- the envelope and the tiled batch ---------------------------------------------------------

def test_policy_parses_strings_and_refuses_others():
    assert ShapePolicy.parse("replan") is ShapePolicy.REPLAN and ShapePolicy.parse("RAISE") is ShapePolicy.RAISE
    assert ShapePolicy.parse(ShapePolicy.WARN) is ShapePolicy.WARN
    with pytest.raises(AutoError, match="on_new_shape='ignore'"):
        ShapePolicy.parse("ignore")


def test_envelope_of_several_batches_is_the_max_per_dimension():
    env = ShapeEnvelope.of_batches([tokens(64, batch=8), tokens(128, batch=2), {"n": 3, "s": torch.tensor(1.0)}])
    assert env.dims == {2: (8, 128)}                        # 0-d tensors and non-tensors have no size
    assert env.beyond([(8, 128), (2, 100), (8, 1)]) == []   # equal or smaller in every dimension
    assert env.beyond([(9, 16), (4, 129)]) == [(9, 16), (4, 129)]
    assert env.beyond([(100,), (1, 2, 3)]) == []            # ranks the batches have none of: not compared
    assert env.grown([(4, 200), (7,)]).dims == {2: (8, 200)}


def test_grow_batch_tiles_the_dimensions_that_grew():
    x, y = tokens(8, batch=2)
    labels = torch.arange(2)
    planned = ShapeEnvelope.of_batches([(x, y, labels)])
    gx, gy, gl = grow_batch((x, y, labels), planned, ShapeEnvelope({2: (3, 20), 1: (2,)}))
    assert gx.shape == gy.shape == (3, 20) and gl.shape == (3,)   # labels follow the batch size 2 -> 3
    assert torch.equal(gx[:2, :8], x) and torch.equal(gx[:2, 8:16], x) and torch.equal(gx[2], x[0].repeat(3)[:20])
    assert torch.equal(gl, torch.tensor([0, 1, 0]))


# -- the guard on a module --------------------------------------------------------------------

class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def test_warn_once_per_new_shape_and_never_at_smaller_or_equal():
    m = Counting()
    guard = ShapeGuard(m, ShapeEnvelope.of_batches([torch.zeros(2, 8, 4)]), ShapePolicy.WARN)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for shape in [(2, 8, 4), (1, 5, 4), (2, 8, 4)]:
            m(torch.zeros(shape))
        assert seen == []
        for shape in [(2, 12, 4), (2, 12, 4), (1, 12, 4), (2, 16, 4), (2, 12, 4)]:
            m(torch.zeros(shape), mask=torch.ones(2, 12))   # the mask (rank 2) is of no planned rank
    msgs = [str(w.message) for w in seen if issubclass(w.category, NewShapeWarning)]
    assert len(msgs) == len(seen) == 2              # (2, 12, 4) once, (2, 16, 4) once; (1, 12, 4) is inside
    assert "(2, 12, 4)" in msgs[0] and "(2, 8, 4)" in msgs[0] and "(2, 16, 4)" in msgs[1]
    assert len(guard.seen_new) == 3                 # ... but was seen, and is recorded
    with torch.no_grad(), warnings.catch_warnings(record=True) as evaluation:
        warnings.simplefilter("always")
        m(torch.zeros(8, 64, 4))                    # autograd off: nothing saved for backward, not checked
    assert evaluation == []
    guard.remove()
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        m(torch.zeros(4, 32, 4))
    assert after == [] and m.calls == 10


def test_raise_before_the_forward_runs_and_copies_pass():
    m = Counting()
    ShapeGuard(m, ShapeEnvelope.of_batches([torch.zeros(2, 4)]), ShapePolicy.RAISE)
    m(torch.zeros(2, 4))
    with pytest.raises(NewShapeError, match=r"\(3, 4\).*planned, largest per dimension: \(2, 4\)"):
        m(torch.zeros(3, 4))
    with pytest.raises(NewShapeError):      # every call at a new shape, not once
        m(torch.zeros(3, 4))
    assert m.calls == 1
    twin = copy.deepcopy(m)                 # the copy keeps the hook, which checks only the guarded model
    twin(torch.zeros(3, 4))
    assert twin.calls == 2


# -- remat.auto: re-plan, warn, raise (ground truth: the tracker and torch.profiler) --------------

def _peak(model: nn.Module, batch, *, profiler: bool = False) -> int:
    step = TrainingStep(Workload(model=model, batch=lambda i: batch, loss=ex.loss_fn))
    step.run(0)
    return profiler_step_peak(step, 1) if profiler else measure_step_peak(step, 1).peak_bytes


def test_auto_replans_at_a_larger_shape_and_holds_the_budget_there(tmp_path):
    small, large = tokens(32), tokens(40, seed=1)
    budget = int(_peak(tiny_lm(), small) * 0.95)      # bytes: the same device limit at every shape
    kw = dict(budget=budget, loss_fn=ex.loss_fn, cache_dir=tmp_path, measure_replays=False, segments=False)
    model = tiny_lm()
    h = remat.auto(model, small, on_new_shape="replan", **kw)
    first = h.plan
    assert h.planned_shapes.dims == {2: (4, 32)} and h.replans == 0
    # the first plan at the larger shape misses the budget (what the guard is for: this check can fail)
    control = tiny_lm()
    with remat.apply(control, first):
        assert _peak(control, large) > budget
    replanned_peak = _peak(model, large)                 # the guard re-plans before this forward
    assert h.replans == 1 and h.plan is not first and h.planned_shapes.dims == {2: (4, 40)}
    assert h.report.cache is CacheStatus.STORED
    assert replanned_peak <= h.report.effective_budget_bytes <= budget
    assert _peak(model, large, profiler=True) <= budget  # torch.profiler's allocator events agree
    _peak(model, tokens(40, seed=2))
    _peak(model, small)
    assert h.replans == 1                                # inside the grown envelope: nothing more
    h.remove()
    assert not model._forward_pre_hooks and not any("forward" in vars(m) for m in model.modules())

    # a new remat.auto at the same shapes: the larger shape's plan is its own cache bucket (a hit)
    again = remat.auto(tiny_lm(), small, on_new_shape="replan", **kw)
    assert again.report.cache is CacheStatus.HIT
    _peak(again.model, large)
    assert again.replans == 1 and again.report.cache is CacheStatus.HIT
    again.remove()

    warned = remat.auto(tiny_lm(), small, **kw)         # the default: warn (a cache hit: no profiling)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for batch in (small, tokens(24), large, large):
            _peak(warned.model, batch)
    assert [issubclass(w.category, NewShapeWarning) for w in seen] == [True]
    assert "(4, 40)" in str(seen[0].message) and "(4, 32)" in str(seen[0].message)
    assert warned.plan.boundaries == first.boundaries   # warned, not re-planned
    warned.remove()

    raised = remat.auto(tiny_lm(), small, on_new_shape=ShapePolicy.RAISE, **kw)
    _peak(raised.model, small)
    with pytest.raises(NewShapeError):
        _peak(raised.model, large)
    raised.remove()
