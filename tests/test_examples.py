"""The examples under examples/ at their tiny size (issue 15): three training steps each, with
remat and without; the losses must be equal (same seed) and the measured peak under the budget.
Examples needing an optional package (transformers, peft, lightning) skip without it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "examples", ROOT / "benchmarks" / "zoo"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

BUDGET = "75%"


def need(*packages: str) -> None:
    for pkg in packages:   # a package that is installed but does not import fails the test: never hidden
        pytest.importorskip(pkg)


def run_both(name: str, tmp_path) -> tuple:
    ex = importlib.import_module(name)
    planned = ex.main(size="tiny", steps=3, budget=BUDGET, plan=True, cache_dir=str(tmp_path), measure_replays=False)
    control = ex.main(size="tiny", steps=3, plan=False)
    r = planned.report
    assert len(planned.losses) == 3 and planned.losses == control.losses      # bitwise: the same floats
    assert r.boundaries, "the tiny examples do not fit 75% unplanned: a plan must checkpoint something"
    assert r.measured_peak_bytes <= r.effective_budget_bytes < r.baseline_peak_bytes
    return planned, control, r


def test_example_plain_loop(tmp_path):
    run_both("auto_plain_loop", tmp_path)


def test_example_peft_lora(tmp_path):
    need("transformers", "peft")
    planned, control, r = run_both("peft_lora", tmp_path)
    assert planned.trainable.keys() == control.trainable.keys() and all("lora_" in n for n in planned.trainable)
    assert all(torch.equal(planned.trainable[n], control.trainable[n]) for n in planned.trainable)
    assert "over 4 parameter(s)" in r.optimizer     # the LoRA A/B of 2 layers: the frozen base has no state


def test_example_hf_trainer_callback(tmp_path):
    need("transformers", "accelerate")
    planned, control, r = run_both("hf_trainer", tmp_path)
    assert all(torch.equal(planned.params[n], control.params[n]) for n in planned.params)
    logged = [h for h in planned.log_history if "remat_predicted_peak_bytes" in h]
    assert logged and logged[0]["remat_predicted_peak_bytes"] == r.predicted_peak_bytes
    assert logged[0]["remat_measured_peak_bytes"] == r.measured_peak_bytes
    assert "2 group(s)" in r.optimizer and not r.optimizer_assumed   # the Trainer's own AdamW: decay / no decay


def test_example_lightning_callback(tmp_path):
    need("lightning")
    planned, control, r = run_both("lightning_callback", tmp_path)
    assert not r.optimizer_assumed and "AdamW" in r.optimizer


def test_enable_replaces_hugging_face_checkpointing(tmp_path):
    """enable() is the drop-in for gradient_checkpointing_enable(): called after it, it switches the
    Hugging Face flag off (remat.auto refuses a model checkpointed twice) and plans instead."""
    need("transformers", "peft")
    import peft_lora
    from remat.errors import AutoError
    from remat.integrations.transformers import enable
    model = peft_lora.build("tiny", 0)
    with pytest.warns(FutureWarning, match="activation_checkpointing_enable"):   # transformers 5 deprecates it
        model.gradient_checkpointing_enable()
    batch = peft_lora.batches("tiny", 1, 0)[0]
    with pytest.raises(AutoError, match=r"activation_checkpointing_disable\(\) first"):   # the 5.x name of the call
        import remat
        remat.auto(model, batch, budget=BUDGET, cache_dir=tmp_path)
    h = enable(model, batch, budget=BUDGET, cache_dir=tmp_path, measure_replays=False, baseline=False)
    assert not [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert h.plan.boundaries and h.report.measured_peak_bytes <= h.report.effective_budget_bytes
    assert h.baseline is None                                    # baseline=False: nothing measured


@pytest.mark.slow
def test_example_auto_fsdp2_ddp(tmp_path):
    """examples/auto_fsdp2.py on 2 gloo ranks (tests/fixtures/auto_job.py), FSDP2 per block and DDP:
    remat.auto after the wrapping, one plan on both ranks, losses bitwise equal to the unplanned job,
    each rank's peak by torch.profiler within the budget; the plan cache hits only when it hits on
    both ranks; hand-made segments across FSDP2 units (per block, per sub-module) train bitwise as
    the unplanned job."""
    import json
    import os
    import subprocess
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "fixtures" / "auto_job.py"), str(tmp_path), "fsdp2", "ddp", "cache", "segments"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    fraction = float(BUDGET.rstrip("%")) / 100
    for engine in ("fsdp2", "ddp"):
        planned = [r[engine]["planned"] for r in ranks]
        assert planned[0]["plan_digest"] == planned[1]["plan_digest"] and planned[0]["boundaries"]
        for r in ranks:
            p, c = r[engine]["planned"], r[engine]["control"]
            assert p["losses"] == c["losses"]                                  # bitwise
            assert p["peak_bytes"] <= p["budget_bytes"] < c["peak_bytes"]      # torch.profiler's peaks
            assert p["peak_bytes"] <= fraction * c["peak_bytes"]
    calls = [r["cache"]["calls"] for r in ranks]
    assert [c[0]["cache"] for c in calls] == ["hit", "hit"]                    # the fsdp2 job stored it
    assert calls[0][0]["digest"] == calls[1][0]["digest"] == ranks[0]["fsdp2"]["planned"]["plan_digest"]
    assert [c[1]["cache"] for c in calls] == ["stored", "stored"]              # rank 1 missed: both re-plan
    assert calls[0][1]["digest"] == calls[1][1]["digest"]
    # mid-training (shards, grads, AdamW state: 27 + 27 + 81, and the RNG), planned in place: all as they were
    assert all(c[1]["state_kept"] and c[1]["state_tensors"] == 136 for c in calls)
    for r in ranks:
        for case, runs in r["segments"].items():
            assert runs["planned"] == runs["control"], case                   # losses and shards, bitwise


def _flagged(model) -> list[str]:
    return [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]


def test_enable_replaces_activation_checkpointing_enable_and_measures_against_it(tmp_path):
    """transformers 5.x: after model.activation_checkpointing_enable(every_n_layers=2), enable() records which
    layers Hugging Face checkpoints, switches it off, plans, and measures that configuration against the plan.
    Ground truth for the baseline: the same configuration put on a copy by Hugging Face's own call, its step
    peak measured here by the live-tensor tracker; the unplanned peak (more) and the budget (the plan, under)."""
    need("transformers", "peft")
    import copy
    import peft_lora
    from remat.memory.measure import measure_step_peak
    from remat.integrations.transformers import enable
    from remat.workload import TrainingStep, Workload
    model = peft_lora.build("tiny", 0)
    batch = peft_lora.batches("tiny", 1, 0)[0]
    sgd = lambda params: torch.optim.SGD(params, lr=1e-2)        # noqa: E731 - one optimizer for both sides
    twin = copy.deepcopy(model)
    model.activation_checkpointing_enable(every_n_layers=2)
    flagged = _flagged(model)
    assert flagged and len(flagged) < peft_lora.SIZES["tiny"]["n_layer"] + 1   # every 2nd of the 2 blocks
    h = enable(model, batch, budget=BUDGET, optimizer=sgd([p for p in model.parameters() if p.requires_grad]),
               use_cache=False, measure_replays=False)
    assert not _flagged(model) and h.plan.boundaries                           # switched off; remat plans instead
    b = h.baseline
    assert b is not None and b.library == "transformers 5" and "activation_checkpointing_enable" in b.what
    twin.activation_checkpointing_enable(every_n_layers=2)                  # the same configuration, by HF's call
    assert _flagged(twin) == flagged
    step = TrainingStep(Workload(model=twin, batch=lambda i: {k: v.clone() for k, v in batch.items()},
                                 loss=lambda m, x: m(**x).loss, optimizer=lambda ps: sgd([p for p in ps if p.requires_grad])))
    step.run(0)
    # within 1% (measured: 4 KiB apart of 3.5 MB); checkpointing one block more or less moves it by far more
    assert measure_step_peak(step, 1).peak_bytes == pytest.approx(b.peak_bytes, rel=0.01)
    assert b.peak_bytes < h.report.baseline_peak_bytes                  # HF's checkpointing saves bytes too
    assert b.plan_peak_bytes <= h.report.effective_budget_bytes           # the plan, measured here, under the budget
    assert b.saved_bytes == b.peak_bytes - b.plan_peak_bytes and b.step_ms > 0 and b.plan_step_ms > 0
    assert "interleaved" in b.summary()
    h.remove()


def test_enable_takes_activation_checkpointing_enables_keywords_or_refuses_them():
    from remat.errors import AutoError
    from remat.integrations.transformers import CheckpointingOptions
    ok = CheckpointingOptions(kwargs={"use_reentrant": False}, every_n_layers=3)
    assert ok.hf_call() == {"activation_checkpointing_kwargs": {"use_reentrant": False}, "every_n_layers": 3}
    for bad, match in [(dict(offload="50%"), "not a share"), (dict(kwargs={"use_reentrant": True}), "reentrant"),
                       (dict(kwargs={"context_fn": None}), "context_fn"), (dict(every_n_layers=0), "positive"),
                       (dict(kwargs={"preserve_rng_state": False}), "preserve_rng_state=True")]:
        with pytest.raises(AutoError, match=match):
            CheckpointingOptions(**bad)


def test_example_diffusion_finetune(tmp_path):
    need("transformers", "diffusers", "peft")
    planned, control, r = run_both("diffusion_finetune", tmp_path)
    assert planned.trainable.keys() == control.trainable.keys() and all("lora_" in n for n in planned.trainable)
    assert all(torch.equal(planned.trainable[n], control.trainable[n]) for n in planned.trainable)
    assert "AdamW" in r.optimizer and not r.optimizer_assumed


def test_diffusers_checkpointing_is_named_by_its_own_calls_and_switched_off(monkeypatch):
    """remat.auto's refusal names diffusers' disable_gradient_checkpointing() (diffusers models have no
    gradient_checkpointing_disable()); diffusers.enable switches it off before planning."""
    need("transformers", "diffusers", "peft")
    import diffusion_finetune as ex
    import remat
    from remat.errors import AutoError
    from remat.integrations import baseline, diffusers
    unet = ex.build("tiny", 0)
    batch = ex.batches("tiny", 1, 0)[0]
    assert not hasattr(unet, "gradient_checkpointing_disable")
    unet.enable_gradient_checkpointing()
    flagged = _flagged(unet)
    assert flagged
    with pytest.raises(AutoError) as err:
        remat.auto(unet, batch, budget=BUDGET, loss_fn=ex.noise_prediction_loss, use_cache=False)
    assert "disable_gradient_checkpointing() first" in str(err.value) and "enable_gradient_checkpointing()" in str(err.value)
    assert "gradient_checkpointing_disable" not in str(err.value)
    seen = []

    class Planned(Exception):
        pass

    def planning(model, *a, **k):         # what remat.auto is handed: the flags are off by then
        seen.append(_flagged(model))
        raise Planned
    monkeypatch.setattr(baseline, "auto", planning)
    with pytest.raises(Planned):
        diffusers.enable(unet, batch, budget=BUDGET, loss_fn=ex.noise_prediction_loss)
    assert seen == [[]]
    with pytest.raises(AutoError, match="gradient_checkpointing_func"):
        diffusers.enable(unet, batch, budget=BUDGET, loss_fn=ex.noise_prediction_loss, gradient_checkpointing_func=print)
