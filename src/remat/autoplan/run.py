"""``remat.auto``: profile the real step on copies, plan, apply to the user's model, cache the plan."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import __version__
from ..wrap import apply, recover_handle
from ..closed_loop import plan_closed_loop
from ..errors import AutoError
from ..plan import Plan, check_budget_syntax, parse_budget, parse_reserve
from ..profile import fingerprint, profile_workload
from ..types import ProgressFn, no_progress
from ..verify import RngState, verify_plan
from .cache import CacheKey, PlanCache, code_identity, default_cache_dir, device_identity
from .report import AutoHandle, AutoReport, CacheStatus, VerifyStatus
from .source import CopyFn, LossFn, ModelSource, OptimizerSpec, Parked, default_loss, describe_batch, model_device

VERIFY_MODES = (None, "quick")
_HOW_TO_VERIFY = ("not verified: pass verify='quick' (one seed, one step, paired control on a copy), or run "
                  "`remat verify` on a workload file for the full check")


def existing_checkpointing(model: nn.Module) -> list[str]:
    """What already checkpoints ``model``, one line per kind, naming the wrapper and where it is."""
    found: list[str] = []
    remat_paths = [w.path for w in recover_handle(model).wrappers]
    if remat_paths:
        found.append(f"remat.apply wrappers on {', '.join(remat_paths[:5])}"
                     + (f" (+{len(remat_paths) - 5})" if len(remat_paths) > 5 else "")
                     + ": call handle.remove() (or remat.recover_handle(model).remove()) first")
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except ImportError:   # a torch built without distributed: no such wrapper can exist
        ActivationWrapper = ()  # type: ignore[assignment,misc]
    torch_wrapped = [(n or "<root>", type(m).__name__) for n, m in model.named_modules()
                     if isinstance(m, ActivationWrapper)]
    if torch_wrapped:
        found.append(f"torch's {torch_wrapped[0][1]} (apply_activation_checkpointing / checkpoint_wrapper) on "
                     f"{', '.join(n for n, _ in torch_wrapped[:5])}: plan the model before wrapping it, or hand "
                     "remat's plan to apply_activation_checkpointing through remat.export_check_fn")
    hf = [n or "<root>" for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if hf:
        found.append(f"Hugging Face gradient checkpointing (gradient_checkpointing_enable()) on {len(hf)} module(s), "
                     f"e.g. {', '.join(hf[:3])}: call model.gradient_checkpointing_disable() first "
                     "(remat.integrations.transformers.enable replaces it)")
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        found.append("torch.compile's OptimizedModule: pass the model before torch.compile (model._orig_mod) "
                     "and compile after remat.auto")
    return found


def _check_callable_state(model: Any, verify: Any) -> None:
    if not isinstance(model, nn.Module):
        raise AutoError(f"remat.auto needs a torch.nn.Module, got {type(model).__name__}")
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        ctx = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise AutoError(f"remat.auto was called under {ctx}: it plans a training step, which needs autograd "
                        "(nothing would be saved for backward, so there is nothing to checkpoint)",
                        tip=f"call remat.auto outside the {ctx} block, where you train")
    if verify not in VERIFY_MODES:
        raise AutoError(f"verify={verify!r}: expected None (default: not verified) or 'quick'")
    wrapped = existing_checkpointing(model)
    if wrapped:
        raise AutoError("the model is already checkpointed by " + "; and by ".join(wrapped),
                        tip="remat plans an unwrapped model and applies its own wrappers")


def auto(model: nn.Module, example_batch: Any, *, budget: str | int, loss_fn: LossFn | None = None,
         optimizer: torch.optim.Optimizer | None = None, verify: str | None = None,
         cache_dir: str | Path | None = None, use_cache: bool = True, reserve: str | float = 0.05,
         planner: str = "optimal", copy_fn: CopyFn | None = None, measure_replays: bool = True,
         segments: bool = True, progress: ProgressFn = no_progress) -> AutoHandle:
    """Fit ``model``'s training step under ``budget``: profile on copies, plan, apply; returns the handle.

    ``budget``: bytes, ``"8GiB"``, or ``"70%"`` of the unplanned step's measured peak.
    ``loss_fn(model, batch)``: the scalar training loss; default ``model(**batch).loss`` for a dict
    batch with ``labels``. ``optimizer``: yours (its class, hyperparameters and groups are rebuilt
    on each copy: its state counts in the peak); None assumes AdamW, and ``report.optimizer`` says so.
    ``verify="quick"``: one seed, one step, paired control on a copy, with negative controls
    (VerificationFailed when it differs). ``cache_dir``: default ``$REMAT_CACHE_DIR`` or
    ``~/.cache/remat`` (NOTE [plan cache key]). ``copy_fn``: how to copy the model when
    ``copy.deepcopy`` cannot. ``measure_replays=False`` keeps the profile's first replay-cost
    estimates instead of timing each candidate's replay alone (faster; the overhead is less exact).
    ``segments=False``: plan per-module boundaries only, no segment candidates (NOTE [segments]):
    what ``export_check_fn`` and torch's per-module ``checkpoint_wrapper`` can express. Nothing of
    yours is changed but the wrapped modules' ``forward``
    (NOTE [no side effects]); ``handle.remove()`` undoes that.
    """
    t0 = time.perf_counter()
    _check_callable_state(model, verify)
    check_budget_syntax(budget)
    reserve_f = parse_reserve(reserve)
    loss = loss_fn if loss_fn is not None else default_loss(example_batch)
    device = model_device(model)
    spec = OptimizerSpec.of(model, optimizer)
    key = CacheKey(
        fingerprint=fingerprint(model).digest,
        trainable=hashlib.sha256(bytes(p.requires_grad for p in model.parameters())).hexdigest(),
        training=model.training, batch=describe_batch(example_batch), budget=str(budget), reserve=reserve_f,
        planner=planner, segments=segments, loss=code_identity(loss), optimizer=spec.key(), device=device_identity(device),
        torch_version=torch.__version__, remat_version=__version__)
    cache = PlanCache(Path(cache_dir) if cache_dir is not None else default_cache_dir()) if use_cache else None

    plan = cache.load(key) if cache is not None else None
    status = CacheStatus.HIT if plan is not None else (CacheStatus.STORED if cache else CacheStatus.DISABLED)
    verified = VerifyStatus.NOT_VERIFIED
    rng = RngState.capture()
    try:
        if plan is None or verify == "quick":
            with Parked(model, optimizer if device.type == "cuda" else None) if device.type == "cuda" else _Nothing():
                source = ModelSource(model, example_batch, loss, spec, device, copy_fn)
                if plan is None:
                    plan = _plan(source, budget, reserve_f, planner, measure_replays, segments, progress)
                if verify == "quick":
                    progress("auto: verify (quick)", 0, 1)
                    verify_plan(source.loaded(), plan, steps=1, seeds=1, timing_steps=0).raise_if_failed()
                    verified = VerifyStatus.PASSED
    finally:
        rng.restore()
    path = None
    if cache is not None:
        path = str(cache.path(key))
        if status is CacheStatus.STORED:
            cache.store(key, plan)
    handle = apply(model, plan)
    report = AutoReport(
        planner=plan.planner, boundaries=tuple(f"{b.module} ({b.mode.value})" for b in plan.boundaries),
        budget=str(budget), budget_bytes=plan.budget_bytes or 0, effective_budget_bytes=plan.effective_budget_bytes or 0,
        baseline_peak_bytes=plan.baseline_peak_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=plan.measured_peak_bytes, memory_source=plan.memory_source,
        baseline_step_ms=plan.baseline_step_ms, measured_step_ms=plan.measured_step_ms,
        predicted_overhead_ms=plan.predicted_overhead_ms, optimizer=spec.describe(), optimizer_assumed=spec.assumed,
        cache=status, cache_path=path, verification=verified,
        verify_note="verified (quick: 1 seed, 1 step, negative controls rejected)" if verified is VerifyStatus.PASSED
        else _HOW_TO_VERIFY,
        seconds=time.perf_counter() - t0)
    return AutoHandle(handle, report)


def _plan(source: ModelSource, budget: str | int, reserve: float, planner: str, measure_replays: bool,
          segments: bool, progress: ProgressFn) -> Plan:
    loaded = source.loaded()
    profile = profile_workload(loaded.rebuild(), measure_replays=measure_replays, segments=segments,
                               progress=progress)
    budget_bytes = parse_budget(budget, profile.baseline_peak_bytes)
    return plan_closed_loop(loaded, profile, planner, budget_bytes=budget_bytes, reserve=reserve,
                            progress=progress).plan


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
