"""Gradient accumulation (NOTE [accumulated step] in src/remat/workload/contract.py): remat.auto(...,
accumulation_steps=N) plans the accumulated step, whose later micro-batches run with the earlier ones'
gradients alive. Ground truth is the user's own loop measured by torch.profiler, not remat's instruments."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import remat
from remat.autoplan import CacheStatus
from remat.errors import AutoError, WorkloadError
from remat.memory import profiler_memory_peak

D, BATCH = 192, 4                  # width, sequences per micro-batch
LENGTHS = (32, 48, 64, 96)         # one step's 4 micro-batches (tokens each), the longest last
BUDGET_SHARE = 0.86                # of the unplanned accumulated loop's peak: fits only with the gradients planned for


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # (B, T, D)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])   # 4.5 MiB of float32 parameters, as many of gradients
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def micro_batch(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(BATCH, tokens, D, generator=torch.Generator().manual_seed(seed))   # (B, T, D)


def accumulated_step_peak(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> int:
    """One optimizer step of the user's loop over the 4 micro-batches; its peak (bytes): what is live at its
    start (parameters, optimizer state, each storage once, counted by hand) plus the peak of torch.profiler's
    allocator events in it (as examples/auto_fsdp2.py's ``step_peak_bytes``)."""
    live = [t for t in (*model.parameters(), *(p.grad for p in model.parameters()),
                        *(v for s in opt.state.values() for v in s.values())) if isinstance(t, torch.Tensor)]
    start = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in live}.values())

    def run() -> None:
        for i, tokens in enumerate(LENGTHS):
            (loss_fn(model, micro_batch(tokens, 10 * step + i)) / len(LENGTHS)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return start + profiler_memory_peak(run).peak_delta_bytes


def loop_peaks(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> list[int]:
    return [accumulated_step_peak(model, opt, s) for s in range(steps)]


def planned(budget: int, accumulation_steps: int, cache_dir) -> tuple[remat.AutoHandle, list[int]]:
    model, opt = build()
    handle = remat.auto(model, micro_batch(LENGTHS[-1], 99), budget=budget, loss_fn=loss_fn, optimizer=opt,
                        accumulation_steps=accumulation_steps, cache_dir=cache_dir, measure_replays=False)
    return handle, loop_peaks(model, opt)


def test_accumulated_loop_stays_under_the_budget_planned_for_it(tmp_path):
    unplanned = max(loop_peaks(*build()))
    budget = int(BUDGET_SHARE * unplanned)
    grad_bytes = sum(p.numel() * p.element_size() for p in build()[0].parameters())   # 4.52 MiB

    one, one_peaks = planned(budget, 1, tmp_path)
    four, four_peaks = planned(budget, 4, tmp_path)

    # the plan for the accumulated step holds on every step of the loop, torch.profiler's count
    assert four.report.accumulation_steps == 4 and four.plan.boundaries
    assert all(p <= budget for p in four_peaks), (four_peaks, budget)
    # negative control: planned on one micro-batch, the same loop goes over the same budget on its warm steps
    # (the optimizer state exists from the first step on), by about the gradients' bytes
    assert all(p > budget for p in one_peaks[1:]), (one_peaks, budget)
    assert one.report.predicted_peak_bytes < max(one_peaks)
    # the unplanned peak ("70%" is of it) is the accumulated step's: the loop's, within the instruments' 3%,
    # and the gradients' bytes above the one-micro-batch step's
    assert abs(four.report.baseline_peak_bytes - unplanned) <= 0.03 * unplanned
    assert four.report.baseline_peak_bytes - one.report.baseline_peak_bytes == pytest.approx(grad_bytes, rel=0.05)
    # the cache keys on the accumulation: the plan for one micro-batch is not the accumulated step's
    assert one.report.cache is CacheStatus.STORED and four.report.cache is CacheStatus.STORED
    assert one.report.cache_path != four.report.cache_path


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True, None])
def test_accumulation_steps_must_be_a_positive_integer(bad):
    model, opt = build()
    with pytest.raises(AutoError, match="accumulation_steps"):
        remat.auto(model, micro_batch(8, 0), budget="90%", loss_fn=loss_fn, accumulation_steps=bad, use_cache=False)
    with pytest.raises(WorkloadError, match="accumulation_steps"):
        remat.Workload(model=model, batch=lambda step: micro_batch(8, step), loss=loss_fn, accumulation_steps=bad)


from .test_examples import need   # noqa: E402  the optional-package guard, which also puts benchmarks/zoo on the path


class _Module(nn.Module):
    """A LightningModule's surface as RematCallback uses it: training_step and log_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build()[0][:2]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return loss_fn(self.net, batch)

    def log_dict(self, *args, **kwargs) -> None:
        pass


def test_lightning_callback_plans_for_accumulate_grad_batches(tmp_path):
    pytest.importorskip("lightning")
    from remat.integrations.lightning import RematCallback
    module = _Module()
    trainer = types.SimpleNamespace(optimizers=[torch.optim.AdamW(module.parameters())], accumulate_grad_batches=3)
    callback = RematCallback(budget="1GiB", cache_dir=tmp_path, measure_replays=False)
    callback.on_train_batch_start(trainer, module, micro_batch(16, 0), 0)
    assert callback.handle.report.accumulation_steps == 3
    callback.handle.remove()
    with pytest.raises(AutoError, match="accumulate_grad_batches=3"):   # a different value given to the callback
        RematCallback(budget="1GiB", accumulation_steps=1).on_train_batch_start(trainer, module, micro_batch(16, 0), 0)


def test_hf_trainer_callback_plans_for_gradient_accumulation_steps(tmp_path):
    need("transformers", "accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from remat.integrations.transformers import RematTrainerCallback
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    callback = RematTrainerCallback(budget="1GiB", cache_dir=tmp_path, measure_replays=False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, logging_steps=1)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert callback.handle.report.accumulation_steps == 2
    logged = [h for h in callback._state.log_history if "remat_accumulation_steps" in h]
    assert logged and logged[0]["remat_accumulation_steps"] == 2
