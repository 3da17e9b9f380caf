"""Offload in the everyday path: ``remat.auto(offload=...)``, the drop-ins, and the host buffer pool
(NOTE [auto offload], NOTE [host buffer pool]).

The test model is one recompute cannot plan at all: every block carries a user's forward hook on
its activation (a monitoring hook, as training code registers to log activation statistics), and
a replay would fire it a second time (NOTE [replayed hooks]), so remat never recomputes a block;
its children (``up``, ``act``, ``down``) free nothing when checkpointed alone. Offload replays
nothing, so it is the one lever left. Ground truths: the unplanned step (gradients bitwise, the
hook's call count), a hand count of the bytes each block offloads, the host budget, and the
refusal of the recompute-only twin at the same budget.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.autoplan import CacheStatus, VerifyStatus
from remat.errors import AutoError, BudgetError
from remat.plan import Plan
from remat.types import CheckpointMode
from remat.wrap.offload import HostPool

O = CheckpointMode.OFFLOAD
B, D, H, N = 256, 128, 512, 3    # batch, width, hidden, blocks
BUDGET = "85%"                   # of the unplanned peak: two blocks' activations must leave the device
# per block, what offload copies to the host: up's input (B, D), act's input (B, H), down's input (B, H)
BLOCK_HOST_BYTES = B * (D + H + H) * 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Monitor:
    """A user's monitoring hook: counts the forwards of each block's activation."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.calls += 1


def _model() -> tuple[nn.Sequential, Monitor]:
    torch.manual_seed(0)
    model, monitor = nn.Sequential(*[Block() for _ in range(N)]), Monitor()
    for block in model:
        block.act.register_forward_hook(monitor)
    return model, monitor


def _batch() -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _auto(model: nn.Module, **kw) -> remat.AutoHandle:
    # replay costs from the profile's first estimates: the test's subject is which modes fit, not their ms
    return remat.auto(model, _batch(), budget=BUDGET, loss_fn=_loss, measure_replays=False,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, _batch()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory) -> tuple[remat.AutoHandle, nn.Module, Monitor, str]:
    cache = str(tmp_path_factory.mktemp("cache"))
    model, monitor = _model()
    return _auto(model, offload=True, verify="quick", cache_dir=cache), model, monitor, cache


def test_auto_offload_ships_a_verified_plan_with_offload_boundaries_at_a_budget_recompute_cannot_reach(offloaded):
    handle, model, monitor, _ = offloaded
    r = handle.report
    offloads = [b for b in handle.plan.boundaries if b.mode is O]
    assert offloads and all(b.mode is O for b in handle.plan.boundaries)   # a hooked block is never recomputed
    assert r.verification is VerifyStatus.PASSED
    assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.effective_budget_bytes
    assert r.effective_budget_bytes < r.baseline_peak_bytes
    # the pricing the plan was made with: this machine's measured link, the default host budget
    assert r.offload is not None and r.offload == handle.plan.offload and r.offload.source in ("measured", "cached")
    assert r.offload.d2h_bytes_per_ms > 0 and r.offload.h2d_bytes_per_ms > 0
    assert r.offload.host_budget_bytes == remat.autoplan.offload.default_host_budget()
    assert "offload:" in r.summary() and "GB/s" in r.summary()
    # the planned model against an unplanned copy: bitwise gradients, the hook once per forward,
    # and the hand-counted bytes held on the host
    control, _ = _model()
    before = monitor.calls
    assert all(torch.equal(a, b) for a, b in zip(_grads(control), _grads(model)))
    assert monitor.calls - before == N
    assert handle.host_pool.peak_bytes == len(offloads) * BLOCK_HOST_BYTES


def test_recompute_only_at_the_same_budget_is_refused_and_the_cache_keeps_the_two_apart(offloaded):
    """The wrong twin: offload=False must not ship (or reuse) the offload plan; the cache key holds offload."""
    handle, _, _, cache = offloaded
    model, _ = _model()
    with pytest.raises(BudgetError, match="replay hazard"):
        _auto(model, offload=False, cache_dir=cache)
    assert not remat.recover_handle(model).wrappers
    again, _ = _model()
    hit = _auto(again, offload=True, cache_dir=cache)   # the safe twin: the same call hits its own entry
    assert hit.report.cache is CacheStatus.HIT and hit.plan.to_json() == handle.plan.to_json()
    hit.remove()


def test_the_host_budget_binds_at_the_hand_counted_bytes():
    """Two blocks must leave the device at this budget: a host budget of their hand-counted bytes ships
    (the safe twin), one byte less cannot hold both and is refused (the wrong one)."""
    model, _ = _model()
    with pytest.raises(BudgetError):   # one block offloaded is all the host holds: measured over the budget
        _auto(model, offload=2 * BLOCK_HOST_BYTES - 1, use_cache=False)
    assert not remat.recover_handle(model).wrappers
    handle = _auto(model, offload=2 * BLOCK_HOST_BYTES, use_cache=False)
    assert [b.mode for b in handle.plan.boundaries] == [O, O]
    _grads(model)
    assert handle.host_pool.peak_bytes == 2 * BLOCK_HOST_BYTES == handle.report.offload.host_budget_bytes
    handle.remove()


@pytest.mark.parametrize("bad, needle", [("50%", "not a share"), ("lots", "host budget"), (0, "host budget"),
                                         (1.5, "expected True"), ([1], "expected True")])
def test_malformed_offload_is_refused_before_any_work(bad, needle):
    model, _ = _model()
    with pytest.raises(AutoError, match=needle):
        _auto(model, offload=bad, use_cache=False)
    assert not remat.recover_handle(model).wrappers


def test_a_stale_cache_entry_whose_offload_disagrees_with_the_key_is_rejected(offloaded):
    from remat.autoplan.cache import _offload_mismatch
    plan = offloaded[0].plan
    budget = plan.offload.host_budget_bytes
    assert _offload_mismatch(plan, budget) is None                        # the safe twin
    assert "recompute only" in _offload_mismatch(plan, None)              # an offload plan for offload=False
    assert "host budget" in _offload_mismatch(plan, budget // 2)          # another host budget
    recompute = Plan.from_json({**plan.to_json(), "boundaries": []})
    recompute.offload = None
    assert "without offload" in _offload_mismatch(recompute, budget)
    assert _offload_mismatch(recompute, None) is None


# -- the host buffer pool (NOTE [host buffer pool]) ------------------------------------------------

def _offload_all(model: nn.Module, pool_reuse: bool = True) -> remat.ApplyHandle:
    from tests.test_offload import _plan
    handle = remat.apply(model, _plan(model, {str(i): O for i in range(N)}))
    handle.host_pool.reuse = pool_reuse
    return handle


def test_the_pool_allocates_once_and_reuses_its_buffers_on_every_later_step():
    model, _ = _model()
    handle = _offload_all(model)
    pool: HostPool = handle.host_pool
    per_step = 3 * N                         # saved tensors copied out per step (hand count: 3 per block)
    grads = [_grads(model) for _ in range(3)]
    assert pool.copies_out == 3 * per_step
    assert pool.allocations == per_step and pool.reuses == 2 * per_step   # step 1 allocates, 2 and 3 reuse
    assert pool.held_bytes == 0 and pool.free_bytes == N * BLOCK_HOST_BYTES == pool.high_water_bytes
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2]))    # reused buffers, the same values
    control, _ = _model()
    assert all(torch.equal(a, b) for a, b in zip(_grads(control), grads[0]))
    handle.remove()
    assert pool.free_bytes == 0                                            # remove() hands the buffers back


def test_without_reuse_every_saved_tensor_allocates_and_the_values_are_the_same():
    """The wrong twin of reuse (the unpooled behaviour): every step allocates every buffer again."""
    model, _ = _model()
    handle = _offload_all(model, pool_reuse=False)
    grads = [_grads(model) for _ in range(2)]
    assert handle.host_pool.allocations == 2 * 3 * N and handle.host_pool.reuses == 0
    assert handle.host_pool.free_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def test_the_pool_never_holds_more_than_the_most_ever_held_at_once():
    """A new shape: buffers of the old sizes are dropped before host memory grows past the high-water mark."""
    pool = HostPool()
    small = [pool.take(1000, pinned=False) for _ in range(4)]       # 4000 held
    for b in small:
        pool.give_back(b)
    assert pool.free_bytes == 4000 and pool.high_water_bytes == 4000
    big = pool.take(3000, pinned=False)                             # no 3000-byte buffer: allocated
    assert pool.held_bytes + pool.free_bytes <= pool.high_water_bytes == 4000
    assert pool.free_bytes == 1000                                  # three 1000-byte buffers dropped
    again = pool.take(1000, pinned=False)
    assert again in small and pool.reuses == 1                      # the survivor is reused
    pool.give_back(big)
    pool.give_back(again)
    assert pool.held_bytes == 0 and pool.free_bytes <= pool.high_water_bytes


# -- the Hugging Face drop-in ---------------------------------------------------------------------

def _gpt2() -> tuple[nn.Module, Monitor]:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model, monitor = GPT2LMHeadModel(cfg), Monitor()
    for block in model.transformer.h:   # monitoring hooks in each block's attention and MLP: never replayed
        block.attn.c_proj.register_forward_hook(monitor)
        block.mlp.act.register_forward_hook(monitor)
    return model, monitor


def _gpt2_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone()}


def _enable(model: nn.Module, offload) -> remat.AutoHandle:
    from remat.integrations.transformers import enable
    return enable(model, _gpt2_batch(), budget=BUDGET, offload=offload, use_cache=False, measure_replays=False,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1), verify="quick" if offload else None)


def test_hugging_face_enable_offload_true_plans_offload_where_recompute_cannot():
    """transformers' offload=True, taken: remat plans it (verified), where the recompute-only twin is refused."""
    from tests.test_examples import need
    need("transformers")
    model, monitor = _gpt2()
    handle = _enable(model, True)
    r = handle.report
    assert any(b.mode is O for b in handle.plan.boundaries) and r.verification is VerifyStatus.PASSED
    assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.effective_budget_bytes
    assert r.offload is not None and r.offload.host_budget_bytes == remat.autoplan.offload.default_host_budget()
    control, _ = _gpt2()
    grads = []
    before = monitor.calls
    for m in (control, model):
        m.zero_grad(set_to_none=True)
        m(**_gpt2_batch()).loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert monitor.calls - before == 2 * 2   # the planned model's: 2 hooks x 2 blocks, each once (nothing replayed)
    twin, _ = _gpt2()
    with pytest.raises(BudgetError):
        _enable(twin, False)
    assert not remat.recover_handle(twin).wrappers
