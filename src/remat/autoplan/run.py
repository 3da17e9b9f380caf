"""``remat.auto``: profile the real step on copies, plan, apply to the user's model, cache the plan."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .. import __version__
from ..wrap import ApplyHandle, apply, check_applies, recover_handle
from ..closed_loop import TimeRaceSettings, plan_for_device
from ..errors import AutoError, OptionStyle, RematError, option_style
from ..plan import Plan, PlannerSpec, budget_on_device, check_budget_syntax, parse_capacity, parse_reserve
from ..profile.model import ProfileReport
from ..profile import fingerprint
from ..profile.model import StepSample
from ..profile.sample import profile_sample
from ..types import ProgressFn, no_progress
from ..host_rng import RngState
from ..verify import tolerance_table, verify_plan
from ..workload import parse_autocast
from ..workload.contract import is_accumulation_count
from .batches import ExampleBatches
from .compiled import check_uncompiled
from .cache import CacheKey, PlanCache, default_cache_dir, device_identity, stale_entry
from .digest import StableDigest, qualified_name, sha256_json
from .inplace import InPlaceSource, JobEngine, check_job, job_engine
from .offload import host_budget_of, offload_pricing
from .job import JobInputs, job_call
from .ranks import JobRanks, agree_profile, job_ranks
from .library_flags import DIFFUSERS, TRANSFORMERS_4, checkpointing_api, flagged_modules
from .report import AutoHandle, AutoReport, CacheStatus, VerifyStatus
from .shapes import ShapeEnvelope, ShapeGuard, ShapePolicy, grow_batch
from .source import InMemoryWorkload
from .source import CopyFn, LossFn, ModelSource, OptimizerSpec, Parked, default_loss, model_device, unwrap_optimizer
from ..profile.blocked import BlockedStep, leading_size, profile_smaller, slice_batch
from ..memory.capacity import active_capacity, clear_refusal, last_refusal, step_capacity, storage_bytes
from ..memory.measure import optimizer_state_tensors

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
    flagged = flagged_modules(model)
    if flagged:
        api = checkpointing_api(model) or TRANSFORMERS_4   # a bare flag: the call most code still makes
        where = "diffusers" if api is DIFFUSERS else "transformers"
        found.append(f"{'diffusers' if api is DIFFUSERS else 'Hugging Face'} gradient checkpointing ({api.enable}()) "
                     f"on {len(flagged)} module(s), e.g. {', '.join(flagged[:3])}: call model.{api.disable}() first "
                     f"(remat.integrations.{where}.enable replaces it)")
    return found


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoSettings:
    """:func:`auto`'s keywords and their defaults, declared here once and validated here. Each is documented
    on :func:`auto`, whose signature spells them out for IDEs; tests/test_auto.py checks that it names these
    fields, in this order, with these defaults, and :func:`auto` builds this from its own arguments by these
    fields' names."""

    budget: str | int | None = None   # bytes, "8GiB", "70%" of the unplanned step's measured peak; None: fit the device
    loss_fn: LossFn | None = None     # None: default_loss(batch)
    optimizer: torch.optim.Optimizer | None = None
    verify: str | None = None         # one of VERIFY_MODES
    cache_dir: str | Path | None = None
    use_cache: bool = True
    reserve: str | float = 0.05       # as given: 0.05 or "5%"
    planner: str | PlannerSpec = "optimal"   # a planner spec; text is parsed here, once (NOTE [planner specs])
    copy_fn: CopyFn | None = None
    measure_replays: bool = True
    segments: bool = True
    progress: ProgressFn = no_progress
    autocast: str | None = None   # as given: "bf16", "bfloat16", "fp16", "float16"
    on_new_shape: ShapePolicy | str = ShapePolicy.WARN   # NOTE [shape guard]; a string is parsed
    accumulation_steps: int = 1   # micro-batches per optimizer step (NOTE [accumulated step])
    device_memory: str | int | None = None   # the device capacity as given: bytes or "2GiB" (NOTE [device capacity])
    offload: bool | str | int | None = False   # as given: True, "16GiB", bytes (NOTE [auto offload])
    reserve_fraction: float = dataclasses.field(init=False)   # ``reserve`` parsed (0.05 for "5%")
    host_budget_bytes: int | None = dataclasses.field(init=False)   # ``offload`` parsed; None: recompute only

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise AutoError(f"verify={self.verify!r}: expected None (default: not verified) or 'quick'")
        if self.budget is not None:
            check_budget_syntax(self.budget)
        _check_cache_dir(self.cache_dir)
        if self.device_memory is not None:
            parse_capacity(self.device_memory)
        object.__setattr__(self, "reserve_fraction", parse_reserve(self.reserve))
        object.__setattr__(self, "host_budget_bytes", host_budget_of(self.offload))
        object.__setattr__(self, "autocast", parse_autocast(self.autocast))
        object.__setattr__(self, "on_new_shape", ShapePolicy.parse(self.on_new_shape))
        object.__setattr__(self, "planner", PlannerSpec.parse(self.planner))
        n = self.accumulation_steps
        if not is_accumulation_count(n):
            raise AutoError(f"accumulation_steps={n!r}: expected an integer >= 1, the micro-batches per optimizer step",
                            tip="pass your loop's gradient accumulation (HF gradient_accumulation_steps, Lightning "
                                "accumulate_grad_batches), or leave it out for 1")

    def step_autocast(self, device: torch.device) -> str | None:
        """The autocast dtype the step runs under: ``autocast``, or the caller's own ``torch.autocast``
        block around ``remat.auto`` (NOTE [autocast steps]); AutoError when the two disagree."""
        if not torch.is_autocast_enabled(device.type):
            return self.autocast
        ambient = str(torch.get_autocast_dtype(device.type)).replace("torch.", "")
        if self.autocast is not None and self.autocast != ambient:
            raise AutoError(f"remat.auto(autocast={self.autocast!r}) was called inside torch.autocast({device.type}, "
                            f"dtype={ambient})", tip="pass the dtype you train with once: the keyword or the block")
        return ambient

    @property
    def quick_verify(self) -> bool:
        return self.verify == "quick"

    def plan_cache(self) -> PlanCache | None:
        """The plan cache (``cache_dir``, else ``default_cache_dir()``); None with ``use_cache=False``."""
        if not self.use_cache:
            return None
        return PlanCache(Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir())


def _check_cache_dir(cache_dir: Any) -> None:
    """``cache_dir`` is None (the default folder) or names a folder: ``Path("")`` is ``.``, and a cache
    written into whatever the current directory is (``./plans/``) is a surprise, never a setting; so
    an empty (or blank) name is refused before any planning, and ``use_cache=False`` is how to say "no cache"."""
    if cache_dir is None:
        return
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise AutoError(f"cache_dir={cache_dir!r}: expected a folder (str or os.PathLike), or None for the default",
                        tip="pass cache_dir=\"/path/to/cache\", or use_cache=False for no cache")
    text = os.fspath(cache_dir)
    if isinstance(text, bytes) or not text.strip():
        raise AutoError(f"cache_dir={cache_dir!r} names no folder (an empty path would be the current directory)",
                        tip="pass use_cache=False to plan without the cache, or cache_dir= a folder "
                            "(None: $REMAT_CACHE_DIR, else ~/.cache/remat)")


def _check_trainable(model: Any) -> None:
    """``model`` is a module, and autograd is on (a training step is what remat plans)."""
    if not isinstance(model, nn.Module):
        raise AutoError(f"remat.auto needs a torch.nn.Module, got {type(model).__name__}")
    # a meta tensor has a shape and no storage: no step can run, so nothing can be measured (torch would
    # fail later, untyped, wherever it first needs data: autocast's device check, a CPU batch's matmul)
    on_meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"), None)
    if on_meta is not None:
        raise AutoError(f"the model's {on_meta!r} is on the meta device (a shape without storage): remat.auto "
                        "measures a real training step, which a meta model cannot run",
                        tip="materialize the model first (model.to_empty(device=...) and its init, or load its "
                            "weights), then call remat.auto; to plan without allocating, use `remat plan --simulate`")
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        ctx = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise AutoError(f"remat.auto was called under {ctx}: it plans a training step, which needs autograd "
                        "(nothing would be saved for backward, so there is nothing to checkpoint)",
                        tip=f"call remat.auto outside the {ctx} block, where you train")


def _check_unwrapped(model: nn.Module) -> None:
    wrapped = existing_checkpointing(model)
    if wrapped:
        raise AutoError("the model is already checkpointed by " + "; and by ".join(wrapped),
                        tip="remat plans an unwrapped model and applies its own wrappers")


def auto(model: nn.Module, example_batch: Any, *, budget: str | int | None = None, loss_fn: LossFn | None = None,
         optimizer: torch.optim.Optimizer | None = None, verify: str | None = None,
         cache_dir: str | Path | None = None, use_cache: bool = True, reserve: str | float = 0.05,
         planner: str = "optimal", copy_fn: CopyFn | None = None, measure_replays: bool = True,
         segments: bool = True, progress: ProgressFn = no_progress, autocast: str | None = None,
         on_new_shape: ShapePolicy | str = ShapePolicy.WARN, accumulation_steps: int = 1,
         device_memory: str | int | None = None, offload: bool | str | int = False) -> AutoHandle:
    """Fit ``model``'s training step under ``budget``: profile on copies, plan, apply; returns the handle.

    ``budget``: bytes, ``"8GiB"``, or ``"70%"`` of the unplanned step's measured peak; None (the
    default): fit the device (NOTE [device capacity]), and a budget above the device's capacity is
    refused. ``device_memory``: the device's capacity, bytes or ``"2GiB"``; on CUDA the memory free
    at the call (with the model's and optimizer's own tensors) by default; on the CPU it is what
    you state (or the :class:`remat.CpuCapacity` block you are in), *enforced*: every step remat
    runs is refused past it with ``torch.OutOfMemoryError``, as CUDA would. A step that does not
    fit unplanned is planned from smaller batches that fit (NOTE [blocked step]): ``report.blocked``.
    ``reserve``: the share of the budget kept free, 0.05 or ``"5%"`` (the default): the measured
    peak must stay under ``budget x (1 - reserve)`` (NOTE [the reserve]).
    ``example_batch``: one batch, or ``remat.ExampleBatches(b1, b2, ...)`` (e.g. seq 64 and seq 128):
    each is a sampled step (NOTE [step sample]), so the plan holds on the largest; ``"70%"`` is then
    of the largest unplanned peak, and ``report`` / the plan record each batch's measured peak.
    ``loss_fn(model, batch)``: the scalar training loss; default ``model(**batch).loss`` for a dict
    batch with ``labels``. ``optimizer``: yours (its class, hyperparameters and groups are rebuilt
    on each copy: its state counts in the peak); None assumes AdamW, and ``report.optimizer`` says so.
    ``verify="quick"``: one seed, one step, paired control on a copy, with negative controls
    (VerificationFailed when it differs). ``cache_dir``: default ``$REMAT_CACHE_DIR`` or
    ``~/.cache/remat`` (NOTE [plan cache key]); an empty string is refused (AutoError), never read as the
    current directory: pass ``use_cache=False`` for no cache. ``copy_fn``: how to copy the model when
    ``copy.deepcopy`` cannot. ``measure_replays=False`` keeps the profile's first replay-cost
    estimates instead of timing each candidate's replay alone (faster; the overhead is less exact).
    ``segments=False``: plan per-module boundaries only, no segment candidates (NOTE [segments]):
    what ``export_check_fn`` and torch's per-module ``checkpoint_wrapper`` can express.
    ``autocast="bf16"`` (or ``"fp16"``): plan, measure and verify the step with its forward under
    ``torch.autocast`` as you train it (NOTE [autocast steps]); called inside a ``torch.autocast``
    block, remat.auto plans under that block's dtype, and ``report.autocast`` says which.
    ``on_new_shape``: what the handle does when the model is called with a tensor larger than any
    the example batch planned for (NOTE [shape guard]): ``"warn"`` (the default, once per new shape,
    :class:`NewShapeWarning`), ``"raise"`` (:class:`~remat.errors.NewShapeError`) or ``"replan"``
    (plan again at the larger shape and apply that plan before the forward runs).
    ``accumulation_steps``: the micro-batches your loop accumulates gradients over per optimizer
    step; above 1, the step measured and planned is the worst micro-batch of the accumulated step,
    forward and backward with the earlier micro-batches' gradients alive, then the optimizer step
    (NOTE [accumulated step]), and ``"70%"`` is of that step's unplanned peak: pass the longest
    micro-batch as ``example_batch``. ``offload=True`` or a host budget (``"16GiB"``, bytes): plan
    keep / recompute / offload per boundary, an offloaded module's saved activations waiting in
    host memory until its backward, the copies priced from this machine's measured link bandwidth
    and the offloaded bytes bounded by the host budget (``True``: half of physical memory; NOTE
    [auto offload]); ``report.offload`` records the pricing. Nothing of
    yours is changed but the wrapped modules' ``forward``
    (NOTE [no side effects]); ``handle.remove()`` undoes that.
    """
    given = locals()   # the arguments alone: AutoSettings's fields name the options
    t0 = time.perf_counter()
    _check_trainable(model)
    with option_style(OptionStyle.KEYWORDS):   # NOTE [option spelling]
        settings = AutoSettings(**{f.name: given[f.name] for f in dataclasses.fields(AutoSettings) if f.init})
    _check_unwrapped(model)
    check_uncompiled(model)   # NOTE [compiled blocks]
    return _fit(model, example_batch, settings, t0)


def _fit(model: nn.Module, example_batch: Any, settings: AutoSettings, t0: float) -> AutoHandle:
    """:func:`auto` once its arguments hold: the plan applied, and the shape guard on the handle."""
    applied, report = _plan_and_apply(model, example_batch, settings, t0)
    handle = AutoHandle(applied, report)
    batches = list(example_batch.batches) if isinstance(example_batch, ExampleBatches) else [example_batch]
    planned = ShapeEnvelope.of_batches(batches)
    # REPLAN tiles the largest example batch (most elements) to the grown shape
    largest = max(batches, key=lambda b: sum(t.numel() for t in tree_leaves(b) if isinstance(t, torch.Tensor)))
    replan = _Replanner(handle, largest, planned, settings) if settings.on_new_shape is ShapePolicy.REPLAN \
        else None
    handle.guard = ShapeGuard(model, planned, settings.on_new_shape, replan)
    return handle


@option_style(OptionStyle.KEYWORDS)   # auto and a re-plan come through here (NOTE [option spelling] in remat/errors.py)
def _plan_and_apply(model: nn.Module, example_batch: Any, settings: AutoSettings,
                    t0: float) -> tuple[ApplyHandle, AutoReport]:
    """The cached or a new plan for ``example_batch``, applied to ``model``, and its report
    (``t0``: when the call began, perf_counter seconds); its errors' tips name auto's keywords."""
    batches = example_batch.batches if isinstance(example_batch, ExampleBatches) else (example_batch,)
    source, *others = [_source(model, b, settings) for b in batches]
    cache = settings.plan_cache()
    fit = _Fit(capacity_bytes=device_capacity(source, settings))
    with _job_watch(source, list(batches), settings):
        if cache is None:
            plan, verified = _plan_and_verify(source, None, settings, others, fit)
            status, path = CacheStatus.DISABLED, None
        else:
            plan, verified, status, path = _fit_cached(source, settings, cache, others, fit)
    handle = apply(model, plan)
    report = dataclasses.replace(_auto_report(plan, settings, source, status, path, verified,
                                              seconds=time.perf_counter() - t0),
                                 autocast=source.autocast, tolerances=tolerance_table(autocast=source.autocast),
                                 device_memory_bytes=fit.capacity_bytes, blocked=plan.blocked)
    return handle, report


@dataclasses.dataclass
class _Fit:
    """The device capacity one plan is made for (bytes; None: none known) and, once planned, how the
    step was planned if it did not fit unplanned (NOTE [blocked step])."""

    capacity_bytes: int | None
    blocked: BlockedStep | None = None
    verify_source: ModelSource | None = None   # the largest batch at which the control fits, when blocked


def device_capacity(source: ModelSource, settings: AutoSettings) -> int | None:
    """The device's capacity for this step, bytes; None when none is stated or known (then ``budget`` must be given).

    NOTE [device capacity]
    What "fit this device" means, the default budget of ``remat.auto``: ``device_memory`` when it
    is given; on CUDA, the memory free at the call plus the bytes of the model's and optimizer's own
    tensors on the device (remat parks those while it measures a copy, and they are the step's own
    state, which the measured peak counts), so other tensors of the process count against it; on
    the CPU, the :class:`remat.CpuCapacity` block the call is in, likewise (its capacity less what
    is charged to it, plus the model's and optimizer's tensors). On the CPU the capacity is
    *enforced* while remat plans (NOTE [CPU device capacity]): every step remat runs is refused past
    it, so a plan, a profile or a verification never runs over it, and a step that does not fit is
    planned from smaller batches (NOTE [blocked step]). The budget is then the capacity, the plan's
    measured peak stays under it less the reserve (NOTE [the reserve]), and a budget above it is
    refused with both figures.
    """
    if settings.device_memory is not None:
        capacity = parse_capacity(settings.device_memory)
    elif source.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(source.device)
        capacity = free + _state_bytes(source.model, settings.optimizer, "cuda")   # the model's own state is the step's: parked meanwhile
    elif (cap := active_capacity()) is not None:
        capacity = cap.free_bytes + _state_bytes(source.model, settings.optimizer, "cpu")
    else:
        capacity = None
    if capacity is not None and settings.budget is not None and not str(settings.budget).strip().endswith("%"):
        budget_on_device(settings.budget, 0, capacity)   # an amount above the device: refused before profiling
    if capacity is None and settings.budget is None:
        raise AutoError("remat.auto was given no budget, and the CPU has no stated capacity to fit",
                        tip="pass device_memory=\"2GiB\" (the capacity to fit, enforced while remat plans) or "
                            "budget=\"70%\"")
    return capacity


def _state_bytes(model: nn.Module, optimizer: Any, device_type: str) -> int:
    """Bytes of the user's parameters, buffers, gradients and optimizer state on ``device_type``, each storage once."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    if optimizer is not None:
        tensors += optimizer_state_tensors(unwrap_optimizer(optimizer))
    return storage_bytes([t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == device_type], set(),
                         device_type=device_type)


def _enforced(fit: _Fit, source: ModelSource) -> contextlib.AbstractContextManager[Any]:
    """On the CPU with a capacity: every step remat runs under it (NOTE [CPU device capacity]), the user's own
    CpuCapacity block (if any) charged nothing meanwhile (remat's copies are not its); elsewhere nothing."""
    if fit.capacity_bytes is None or source.device.type != "cpu":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    user = active_capacity()
    if user is not None:
        stack.enter_context(user.suspended())
    stack.enter_context(step_capacity(fit.capacity_bytes))
    return stack


class _Replanner:
    """``on_new_shape='replan'`` (NOTE [shape guard]): plan ``handle``'s model again for a grown envelope,
    on the example batch tiled to it, and apply that plan in place of the old one."""

    def __init__(self, handle: AutoHandle, example_batch: Any, planned: ShapeEnvelope, settings: AutoSettings) -> None:
        self.handle, self.batch, self.planned, self.settings = handle, example_batch, planned, settings

    def __call__(self, grown: ShapeEnvelope) -> None:
        check_uncompiled(self.handle.model)   # compiled after remat.auto, as its tip says (NOTE [compiled blocks])
        batch = grow_batch(self.batch, self.planned, grown)
        handle, old = self.handle, self.handle.plan
        handle.unwrap()       # remat profiles an unwrapped model (its copies)
        try:
            applied, report = _plan_and_apply(handle.model, batch, self.settings, time.perf_counter())
        except BaseException:
            handle.replace(apply(handle.model, old))   # the old plan back: the error says why none is new
            raise
        handle.replace(applied, report)


def _source(model: nn.Module, example_batch: Any, settings: AutoSettings) -> ModelSource:
    """Copies of a plain model (NOTE [no side effects]); a model wrapped by FSDP2 or DDP itself, on
    every rank of its job (NOTE [wrapped models in place], NOTE [one plan per job])."""
    loss = settings.loss_fn if settings.loss_fn is not None else default_loss(example_batch)
    device = model_device(model)
    optimizer = OptimizerSpec.of(model, settings.optimizer)
    engine = job_engine(model)
    autocast = settings.step_autocast(device)
    steps = settings.accumulation_steps   # every build runs the accumulated step (NOTE [accumulated step])
    if engine is JobEngine.NONE:
        return ModelSource(model, example_batch, loss, optimizer, device, settings.copy_fn, autocast=autocast,
                           accumulation_steps=steps)
    ranks = job_ranks()
    check_job(engine, ranks, quick_verify=settings.quick_verify, copy_fn=settings.copy_fn)
    return InPlaceSource(model, example_batch, loss, optimizer, device, autocast=autocast, accumulation_steps=steps,
                         engine=engine, ranks=ranks)


def _ranks(source: ModelSource) -> JobRanks | None:
    return source.ranks if isinstance(source, InPlaceSource) else None


def _job_watch(source: ModelSource, batches: list[Any], settings: AutoSettings) -> contextlib.AbstractContextManager[Any]:
    """In a job: every rank arrived and agreed on what it plans, before any collective, and planning watched
    for faults (NOTE [job faults] in autoplan/job.py); elsewhere nothing."""
    ranks = _ranks(source)
    if ranks is None:
        return contextlib.nullcontext()
    inputs = JobInputs.of(fingerprint(source.model).digest, batches, settings.budget, settings.reserve_fraction,
                          settings.accumulation_steps, settings.host_budget_bytes)
    return job_call(ranks, inputs).watch()


def _fit_cached(source: ModelSource, settings: AutoSettings, cache: PlanCache,
                others: list[ModelSource], fit: _Fit) -> tuple[Plan, VerifyStatus, CacheStatus, str]:
    """The plan for ``source`` through ``cache`` (NOTE [plan cache key]): a usable entry, else a new plan,
    stored where the directory takes it. Returns the plan, its verification, the cache status, the entry's path."""
    key = _cache_key(source, settings, others, fit)
    cached = _usable_cached_plan(source, cache, key, settings, fit)
    ranks = _ranks(source)
    if ranks is not None and not ranks.all_true(cached is not None):
        cached = None   # a hit on every rank, or all plan again together (NOTE [one plan per job])
    plan, verified = _plan_and_verify(source, cached, settings, others, fit)
    if cached is not None:
        status = CacheStatus.HIT
    else:
        status = CacheStatus.STORED if cache.store(key, plan) is not None else CacheStatus.NOT_STORED
    return plan, verified, status, str(cache.path(key))


def _usable_cached_plan(source: ModelSource, cache: PlanCache, key: CacheKey, settings: AutoSettings,
                        fit: _Fit) -> Plan | None:
    """The entry for ``key`` if it loads, ``apply`` would take it on the model (``check_applies``: the same
    checks, nothing wrapped) and it is a plan for this call (``stale_entry``: its fingerprint, budget and
    figures agree with the key, NOTE [cache hit re-validated]); else None, the entry warned about (a
    ``BrokenCacheEntryWarning``, a ``StaleCacheEntryWarning`` for figures that disagree): the caller
    re-plans and replaces it."""
    plan = cache.load(key)
    if plan is None:
        return None
    try:   # first: a FingerprintMismatch lists what differs, where stale_entry compares digests only
        check_applies(source.model, plan)
    except RematError as exc:
        cache.reject(key, exc)
        return None
    why = stale_entry(plan, key, budget=settings.budget, capacity_bytes=fit.capacity_bytes,
                      capacity_stated=settings.device_memory is not None, device_type=source.device.type,
                      job=_ranks(source) is not None)
    if why is not None:
        cache.reject_stale(key, why)
        return None
    return plan


def _cache_key(source: ModelSource, settings: AutoSettings, others: list[ModelSource],
               fit: _Fit | None = None) -> CacheKey:
    """What a cached plan is bound to (NOTE [plan cache key]); every example batch's leaves."""
    model = source.model
    ranks = _ranks(source)
    digest = StableDigest()
    return CacheKey(
        fingerprint=fingerprint(model).digest, state=sha256_json(digest.value(model)),
        trainable=hashlib.sha256(bytes(p.requires_grad for p in model.parameters())).hexdigest(),
        training=model.training,
        batch=[digest.value(leaf) for s in (source, *others) for leaf in tree_leaves(s.batch)],
        budget=f"{settings.budget}" + _capacity_key(settings, fit),
        reserve=settings.reserve_fraction, planner=settings.planner,
        segments=settings.segments, loss=f"{qualified_name(source.loss)}:{sha256_json(digest.value(source.loss))}",
        optimizer=source.optimizer.key(), device=device_identity(source.device),
        torch_version=torch.__version__, remat_version=__version__,
        world_size=ranks.world_size if ranks is not None else 1,
        engine=source.engine if isinstance(source, InPlaceSource) else JobEngine.NONE,
        autocast=source.autocast, accumulation_steps=source.accumulation_steps,
        offload_host_budget_bytes=settings.host_budget_bytes)


def _capacity_key(settings: AutoSettings, fit: _Fit | None) -> str:
    """What of the device's capacity a cached plan is bound to (NOTE [plan cache key]): a stated capacity
    exactly; the device's free memory when it is the budget, to 256 MiB (it moves a little from call to
    call, and an exact figure would never hit); nothing when a budget is given (the capacity only gates it)."""
    if fit is None or fit.capacity_bytes is None:
        return ""
    if settings.device_memory is not None:
        return f" on a device of {fit.capacity_bytes} B"
    if settings.budget is None:
        return f" on a device with about {fit.capacity_bytes >> 28 << 8} MiB free"
    return ""


def _plan_and_verify(source: ModelSource, cached: Plan | None, settings: AutoSettings,
                     others: list[ModelSource], fit: _Fit) -> tuple[Plan, VerifyStatus]:
    """``cached``, or a new plan; verified (quick) when asked. On CUDA the user's tensors are parked on
    the CPU meanwhile, and the RNG state is restored after (NOTE [no side effects])."""
    plan = cached
    verified = VerifyStatus.NOT_VERIFIED
    rng = RngState.capture()
    try:
        if plan is None or settings.quick_verify:
            with _parked(source, settings.optimizer), _enforced(fit, source):
                if plan is None:
                    plan = _plan(source, settings, others, fit)
                if settings.quick_verify:
                    settings.progress("auto: verify (quick)", 0, 1)
                    # where the step is blocked, at the largest batch where the control fits (NOTE [blocked step])
                    control = fit.verify_source or source
                    verify_plan(control.loaded(), plan, steps=1, seeds=1, timing_steps=0).raise_if_failed()
                    verified = VerifyStatus.PASSED
    finally:
        source.restore()
        rng.restore()
    ranks = _ranks(source)
    if ranks is not None:   # the plan every rank applies (and caches) is rank 0's (NOTE [one plan per job])
        plan = Plan.from_json(ranks.from_rank0(plan.to_json()))
    return plan, verified


def _parked(source: ModelSource, optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager[Any]:
    """On CUDA, the user's model and optimizer state parked on the CPU (:class:`Parked`); elsewhere nothing."""
    if source.device.type != "cuda" or source.in_place:   # in place: the model is what is measured
        return contextlib.nullcontext()
    return Parked(source.model, optimizer)


def _plan(source: ModelSource, settings: AutoSettings, others: list[ModelSource], fit: _Fit) -> Plan:
    """Profile a copy, then plan in a closed loop under the budget (``"70%"``: of the profiled peak);
    with ``others`` (further example batches), over the sample of one step per batch (NOTE [step sample]).
    A step that does not fit the device unplanned is profiled from smaller batches (NOTE [blocked step])."""
    loaded = source.loaded()
    ranks = _ranks(source)
    # each further batch is a "boundary shape", recorded as its position among the example batches
    sample = StepSample.of(1, [{"example_batch": i + 1} for i in range(len(others))])
    variants = [s.loaded() for s in others]
    clear_refusal()
    try:
        profile = _profile(source, settings, sample, variants)
    except torch.OutOfMemoryError:
        if others or ranks is not None:
            raise AutoError("the unplanned step does not fit the device, and remat plans a blocked step from smaller "
                            "batches only for one example batch in one process", tip="pass one example batch "
                            "(the largest), or plan the blocked step in one process and apply the plan on every rank")
        profile = _profile_blocked(source, settings, fit)
    budget_bytes = budget_on_device(settings.budget, profile.baseline_peak_bytes, fit.capacity_bytes)
    assert budget_bytes is not None   # device_capacity refused a call with neither
    if ranks is not None:   # this rank's own peak above; the job plans for its smallest
        budget_bytes = ranks.min_bytes(budget_bytes)
        profile = agree_profile(profile, ranks)
    # one timed step per measured plan: auto's report shows it as a single run, never as an overhead
    # (NOTE [auto overhead]); each further step would be a step of the user's planning time
    offload = offload_pricing(source.device, settings.host_budget_bytes, cache_dir=settings.cache_dir, ranks=ranks)
    return plan_for_device(loaded, profile, settings.planner, budget_bytes=budget_bytes,
                           capacity_bytes=fit.capacity_bytes, blocked=fit.blocked, steps=1,
                           reserve=settings.reserve_fraction, sample=None if sample.is_single else sample,
                           variants=variants, offload=offload, progress=settings.progress,
                           race=TimeRaceSettings.unless_disabled()).plan   # NOTE [time race]


def _profile(source: ModelSource, settings: AutoSettings, sample: StepSample,
             variants: list[InMemoryWorkload], *, bytes_only: bool = False) -> ProfileReport:
    """``bytes_only``: no replay timed alone (the blocked step's second, smaller batch: NOTE [blocked step])."""
    ranks = _ranks(source)
    # in a job, a replay is timed until its timings settle: a per-rank decision (NOTE [one plan per job])
    return profile_sample(source.loaded().rebuild(), sample,
                          measure_replays=settings.measure_replays and ranks is None and not bytes_only,
                          segments=settings.segments,
                          variants=[v.rebuild() for v in variants], progress=settings.progress)


def _profile_blocked(source: ModelSource, settings: AutoSettings, fit: _Fit) -> ProfileReport:
    """The profile at the example batch, from its first k samples where those fit unplanned (NOTE [blocked
    step]); records the evidence in ``fit``. DeviceTooSmall when no smaller batch fits."""
    refusal = last_refusal()
    capacity = fit.capacity_bytes if fit.capacity_bytes is not None else refusal.capacity_bytes if refusal else 0
    single = StepSample.of(1, [])
    report, fit.blocked, fit.verify_source = profile_smaller(
        leading_size(source.batch), lambda k: _source(source.model, slice_batch(source.batch, k), settings),
        lambda smaller, bytes_only: _profile(smaller, settings, single, [], bytes_only=bytes_only),
        refusal, capacity, settings.progress)
    return report


def _auto_report(plan: Plan, settings: AutoSettings, source: ModelSource, cache: CacheStatus,
                 cache_path: str | None, verified: VerifyStatus, *, seconds: float) -> AutoReport:
    optimizer, ranks = source.optimizer, _ranks(source)
    return AutoReport(
        plan_digest=sha256_json(plan.to_json()), world_size=ranks.world_size if ranks is not None else 1,
        engine=source.engine if isinstance(source, InPlaceSource) else JobEngine.NONE,
        planner=plan.planner, boundaries=tuple(f"{b.module} ({b.mode.value})" for b in plan.boundaries),
        budget="the device" if settings.budget is None else str(settings.budget), budget_bytes=plan.budget_bytes or 0,
        effective_budget_bytes=plan.effective_budget_bytes or 0,
        baseline_peak_bytes=plan.baseline_peak_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
        measured_peak_bytes=plan.measured_peak_bytes, memory_source=plan.memory_source,
        baseline_step_ms=plan.baseline_step_ms, measured_step_ms=plan.measured_step_ms,
        predicted_overhead_ms=plan.predicted_overhead_ms, optimizer=optimizer.describe(),
        optimizer_assumed=optimizer.assumed, cache=cache, cache_path=cache_path, verification=verified,
        verify_note="verified (quick: 1 seed, 1 step, negative controls rejected)" if verified is VerifyStatus.PASSED
        else _HOW_TO_VERIFY,
        seconds=seconds, accumulation_steps=source.accumulation_steps, time_race=plan.time_race,
        small_boundaries=plan.small_boundaries, offload=plan.offload)
