"""What a real training loop does around remat.auto's planned model: gradient accumulation over
micro-batches, eval passes between optimizer steps, dropout drawing from the global RNG. Ground
truth: an unplanned twin (a copy made before planning) run through the very same loop with the
same seed; the deliberately wrong twin (one micro-batch fewer) must be told apart."""

from __future__ import annotations

import copy

import torch

import remat

from .test_auto import FAST, ex, tiny

MICRO = 4          # micro-batches per optimizer step
OPT_STEPS = 2


def _loop(model, micro_batches, micro: int = MICRO) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Accumulate ``micro`` micro-batches per step (loss / micro), an eval pass after each step."""
    torch.manual_seed(1)     # dropout masks: the same stream for every model run through here
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, evals = [], []
    for _ in range(OPT_STEPS):
        model.train()
        for batch in micro_batches[:micro]:
            loss = ex.loss_fn(model, batch) / micro
            loss.backward()
            train.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            evals.append(ex.loss_fn(model, micro_batches[0]).item())
    return train, evals, {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a, b) -> bool:
    """Bitwise: the same floats for every loss, and every parameter byte for byte."""
    return a[0] == b[0] and a[1] == b[1] and a[2].keys() == b[2].keys() and all(
        torch.equal(a[2][n], b[2][n]) for n in a[2])


def test_gradient_accumulation_with_eval_between_is_bitwise_the_unplanned_loop(tmp_path):
    model, first = tiny()
    micro_batches = [first] + [tiny(seed=k)[1] for k in range(1, MICRO)]   # the same shape, other tokens
    twin = copy.deepcopy(model)
    h = remat.auto(model, first, budget="75%", loss_fn=ex.loss_fn, use_cache=False, **FAST)   # one micro-batch's step
    assert h.plan.boundaries, "the tiny model fits 75% unplanned: nothing would be checkpointed"
    wrong = copy.deepcopy(twin)
    planned, control = _loop(model, micro_batches), _loop(twin, micro_batches)
    assert len(planned[0]) == MICRO * OPT_STEPS and len(planned[1]) == OPT_STEPS
    assert _same(planned, control)
    assert not _same(_loop(wrong, micro_batches, micro=MICRO - 1), control)   # the wrong twin is told apart
