"""The pipeline engine's rank program (``python -m remat.distributed.worker --config C --out DIR``), one per stage.

Started by torchrun through the launcher of NOTE [launcher] (distributed/launch.py), with the same rank
files (NOTE [rank files] in distributed/worker.py), errors (NOTE [rank errors]) and teardown (NOTE [teardown]).
Rank k runs stage k (NOTE [pipeline stages], engine.py) under torch.distributed.pipelining's
``PipelineStage`` and ``ScheduleGPipe``/``Schedule1F1B``, for each side in turn: no plan, the
uniform plan on every stage, remat's per-stage plans (planned here, after the unplanned side
measured every stage's peak: NOTE [pipeline in-flight cost model]). Rank 0 writes
``DIR/pipeline.json``.

NOTE [pipeline instruments]
Every interval is read on one clock (``time.perf_counter_ns``: CLOCK_MONOTONIC, shared by the
processes of one host, so the stages' timelines line up):
* compute: ``stage.forward_one_chunk``, ``stage.backward_one_chunk`` and the schedule's loss
  (``_maybe_compute_loss``), wrapped on this stage and schedule instance, plus the optimizer step;
* replay: a RegionObserver on each of remat's checkpoint wrappers (``replay=True``), inside backward;
* p2p: the schedule module's ``_batch_p2p`` (posting isend/irecv) and ``_wait_batch_p2p``
  (blocking on them), patched in this process only: the time this stage's thread is blocked in
  p2p. ``exposed p2p`` = union(p2p) - union(compute) (NOTE [exposed communication]); on one
  thread they never overlap, so it equals the blocked time, and it includes waiting for a peer
  that is still computing (that is the bubble seen from here);
* idle = the pipeline's step - union(compute), where the pipeline's step runs from the first
  stage's start to the last stage's end (a stage that finishes early waits for the next step's
  input then); bubble fraction = idle / that step. With equal stage times and free
  communication it is (p - 1) / (m + p - 1) for GPipe and 1F1B (plan/pipeline.ideal_bubble).
Timed steps start after a barrier.

NOTE [pipeline closed loop]
The per-stage prediction can miss (the cost model counts each held microbatch's saving but not
every transient the stage keeps). When a stage of remat's side measures over the per-device
budget, every rank (same gathered peaks, same deterministic planner) re-plans the stages that
missed once, each stage's unplanned peak raised by its miss (measured - predicted:
plan.correction_margin, the single-device loop's error), and runs the side again; the report's
notes say so, and the figures are the second attempt's. This is the one closed loop
(NOTE [one closed loop], closed_loop.py; RematSideLoop here) with two tries, no relaxing and no fallbacks:
a pipeline plan is measured by running the whole side on every rank (warm-up, timed and memory
steps), so measuring fallback plans as well would multiply the run, and the pipeline's report
shows what was measured, each stage's fit included (``remat distributed`` exits 1 when remat's
side missed), instead of refusing; relaxing is for compiled steps, and the stages run eager.
A given ``--plan`` runs as given. Memory is read on one more step under the live-tensor
tracker (its per-op cost would distort the times): the stage's peak, and the live bytes when each
microbatch's backward starts (the held activations of every in-flight microbatch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from ..._io import atomic_write_json
from ...closed_loop import ClosedLoopSettings, LoopSteps, run_closed_loop
from ...errors import BudgetError, DistributedError, PlanError
from ...memory.measure import optimizer_state_tensors
from ...plan.model import Plan
from ...plan.planners import correction_margin
from ...plan.spec import PlannerSpec
from ...plan.pipeline import PipelinePlan, Side, StagePlan, in_flight, in_flight_from_order, plan_stages
from ...types import MemCategory, MemorySource
from ...workload.contract import call_user
from ...workload.loader import load_workload
from ..config import DistributedConfig
from ..intervals import exposed_ns, total_ns, union
from .engine import (PIPELINE_REPORT_NAME, build_stage_modules, make_loss_fn, split_batch,
                       stage_examples, stage_layout)
from .report import RankOutcome, StageResult, TimelineEvent, assemble_pipeline
from ..worker import RankFiles, _env_int, _maybe_fault, compare_grads

_COMPUTE = ("forward", "loss", "backward", "optimizer")


class StageRecorder:
    """NOTE [pipeline instruments]: this stage's intervals of the current step, and memory figures."""

    def __init__(self) -> None:
        self.events: list[TimelineEvent] = []
        self.on = False
        self.tracker: Any = None
        self.held_at_backward: list[int] = []

    @contextlib.contextmanager
    def span(self, kind: str, mb: int) -> Iterator[None]:
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            if self.on:
                self.events.append(TimelineEvent(kind=kind, mb=mb, start_ns=t0, end_ns=time.perf_counter_ns()))

    # remat.apply's RegionObserver protocol: replays only
    def region(self, wrapper: Any, *, replay: bool) -> Any:
        return self.span("replay", -1) if replay else contextlib.nullcontext()


def _instrument(stages: list[Any], schedule: Any, rec: StageRecorder) -> None:
    """Wrap each of this rank's stages' forward/backward chunks, and the schedule's loss (NOTE [pipeline
    instruments]); ``mb`` of an event is the microbatch."""
    for stage in stages:
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(chunk: int, *args: Any, _fwd: Any = fwd, **kwargs: Any) -> Any:
            with rec.span("forward", chunk):
                return _fwd(chunk, *args, **kwargs)

        def backward_one_chunk(chunk: int, *args: Any, _bwd: Any = bwd, **kwargs: Any) -> Any:
            if rec.tracker is not None:
                rec.held_at_backward.append(rec.tracker.live_bytes)
            with rec.span("backward", chunk):
                return _bwd(chunk, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
    loss = schedule._maybe_compute_loss

    def maybe_compute_loss(st: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any) -> Any:
        with rec.span("loss", mb_index):
            return loss(st, output, target_mbs, mb_index, *args)

    if any(st.is_last for st in stages):   # the schedule calls it on every stage; only the last computes a loss
        schedule._maybe_compute_loss = maybe_compute_loss


def _patch_p2p(rec_of: Callable[[], StageRecorder | None]) -> None:
    """Time posting and waiting on p2p ops in torch's schedules module (this process only)."""
    from torch.distributed.pipelining import schedules
    post, wait = schedules._batch_p2p, schedules._wait_batch_p2p
    desc_of: dict[int, str] = {}

    def _batch_p2p(ops: list, desc: str | None = None) -> list:
        rec = rec_of()
        if rec is None or not ops:
            return post(ops, desc)
        with rec.span(f"p2p:{desc or 'post'}", -1):
            works = post(ops, desc)
        desc_of[id(works)] = desc or "wait"
        return works

    def _wait_batch_p2p(work: list) -> None:
        rec = rec_of()
        if rec is None or not work:
            return wait(work)
        with rec.span(f"p2p:{desc_of.pop(id(work), 'wait')}", -1):
            return wait(work)

    schedules._batch_p2p = _batch_p2p
    schedules._wait_batch_p2p = _wait_batch_p2p


def _order_of(schedule: Any, rank: int) -> list[tuple[int, str]]:
    """This rank's compute actions in the schedule's own order, ``(stage, "F"|"B")`` (multi-stage schedules
    carry it as ``pipeline_order``); [] for the single-stage schedules, whose load is a formula."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return []
    out = []
    for a in order.get(rank, []):
        if a is None:
            continue
        kind = str(getattr(a.computation_type, "value", a.computation_type))
        if kind in ("F", "B"):
            out.append((a.stage_index, kind))
    return out


@dataclasses.dataclass
class _Side:
    stage_module: Any
    schedule: Any
    optimizer: Any
    handle: Any
    rec: StageRecorder
    inputs: Callable[[int], Any]
    targets: Callable[[int], Any]
    tied: list[Any]
    tied_group: Any


class PipelineRank:
    def __init__(self, cfg: DistributedConfig, files: RankFiles) -> None:
        assert cfg.pipeline is not None   # DistributedConfig checks engine pipeline has its settings
        self.cfg, self.pp = cfg, cfg.pipeline
        self.files = files
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.first, self.last = self.rank == 0, self.rank == self.p - 1
        self.done = 0
        self.total = len(self.pp.sides) * (cfg.warmup + cfg.steps + 1)
        self.current: StageRecorder | None = None
        _patch_p2p(lambda: self.current)
        # every rank joins every group creation (collective); only the first and last use it
        self.tied_group = dist.new_group([0, self.p - 1]) if self.p > 2 else None

    def build(self, plan: Plan | None) -> _Side:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)
        cfg = self.cfg
        torch.manual_seed(cfg.seed)   # every rank builds the same whole model (NOTE [pipeline stages])
        loaded = load_workload(cfg.spec, cfg.shape, device=cfg.device, dtype=cfg.dtype)
        wl = loaded.workload
        model = wl.model
        inputs0, _ = split_batch(wl.batch(0))
        mb = inputs0[: max(1, inputs0.shape[0] // self.pp.microbatches)]
        layout = stage_layout(model, self.pp.split_points, cfg.n_stages, mb)
        mine = self.local_stages()
        examples = [stage_examples(model, layout, k, mb) for k in mine]
        tied_names = layout.tied
        handle = None
        rec = StageRecorder()
        if plan is not None and plan.boundaries:
            from ...wrap import apply
            handle = apply(model, plan)   # the whole model's names and fingerprint; then prune
            for w in handle:
                w.observers.append(rec)
        params = dict(model.named_parameters(remove_duplicate=False))
        tied = [params[n] for n in tied_names] if (self.first or self.last) else []
        modules = build_stage_modules(model, layout, mine)
        # static metadata: torch 2.13's runtime inference deadlocked here when the first stage's input
        # (token ids) needs no gradient (stage 1 sends backward metadata that stage 0 never receives)
        # fully static: the gradients' metadata too (a received activation's gradient goes back; the first
        # stage's integer inputs get none, the last stage's output gets its gradient from the loss)
        stages = [PipelineStage(mod, k, cfg.n_stages, torch.device(cfg.device), input_args=ex_in, output_args=ex_out,
                                input_grads=None if k == 0 else torch.zeros_like(ex_in),
                                output_grads=None if k == cfg.n_stages - 1 else torch.zeros_like(ex_out))
                  for mod, k, (ex_in, ex_out) in zip(modules, mine, examples)]
        # every rank gets the loss_fn: torch's schedule decides from it whether there is a backward at all
        # (with None the first stage posts no gradient receives and its backward silently does nothing)
        if self.pp.schedule.multi:
            schedule = ScheduleInterleaved1F1B(stages, self.pp.microbatches, loss_fn=make_loss_fn(wl, layout.chain.unpack),
                                               scale_grads=True)
        else:
            cls = Schedule1F1B if self.pp.schedule.value == "1f1b" else ScheduleGPipe
            schedule = cls(stages[0], self.pp.microbatches, loss_fn=make_loss_fn(wl, layout.chain.unpack), scale_grads=True)
        _instrument(stages, schedule, rec)
        stage_module = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
        optimizer = call_user("the workload's optimizer", wl.optimizer, list(stage_module.parameters())) \
            if wl.optimizer is not None else torch.optim.SGD(stage_module.parameters(), lr=1e-3)
        self.orders = {r: _order_of(schedule, r) for r in range(self.p)}
        self.layout = layout
        return _Side(stage_module, schedule, optimizer, handle, rec,
                     inputs=lambda i: split_batch(wl.batch(i))[0], targets=lambda i: split_batch(wl.batch(i))[1],
                     tied=tied, tied_group=self.tied_group)

    def local_stages(self, rank: int | None = None) -> list[int]:
        """A rank's stages: r, r + p, ..., r + (v - 1) p (torch's looped placement for interleaved schedules)."""
        r = self.rank if rank is None else rank
        return [r + j * self.p for j in range(self.pp.stages_per_rank)]

    def stage_in_flight(self, rank: int) -> dict[int, int]:
        """{stage: microbatches it holds at the rank's peak} (NOTE [pipeline in-flight cost model])."""
        cfg = self.cfg
        if self.pp.schedule.multi:
            return in_flight_from_order(self.orders[rank])
        return {rank: in_flight(self.pp.schedule, rank, self.p, self.pp.microbatches)}

    def rank_blocks(self, rank: int) -> list[str]:
        return [b for k in self.local_stages(rank) for b in self.layout.stage_blocks(k)]

    def block_in_flight(self, rank: int) -> dict[str, int]:
        per_stage = self.stage_in_flight(rank)
        return {b: per_stage.get(k, 1) for k in self.local_stages(rank) for b in self.layout.stage_blocks(k)}

    def step(self, side: _Side, i: int, what: str, losses: list | None = None) -> None:
        if self.first:
            side.schedule.step(side.inputs(i), return_outputs=False)
        elif self.last:
            side.schedule.step(target=side.targets(i), losses=losses, return_outputs=False)
        else:
            side.schedule.step(return_outputs=False)
        if side.tied and self.p > 1:   # NOTE [pipeline stages]: the tied parameters' two partial gradients
            with side.rec.span("p2p:tied_allreduce", -1):
                for prm in side.tied:
                    if prm.grad is None:
                        prm.grad = torch.zeros_like(prm)
                    dist.all_reduce(prm.grad, group=side.tied_group)

    def optimize(self, side: _Side) -> None:
        with side.rec.span("optimizer", -1):
            side.optimizer.step()
            side.optimizer.zero_grad(set_to_none=True)

    def tick(self, what: str) -> None:
        self.done += 1
        self.files.progress(self.done, self.total, what)
        _maybe_fault(self.rank, self.done)

    def run_side(self, name: str, plan: Plan | None) -> tuple[StageResult, list, float | None]:
        cfg = self.cfg
        side = self.build(plan)
        rec = side.rec
        self.current = rec
        torch.manual_seed(cfg.seed + 1000 * self.rank)   # dropout: the same masks for every side
        grads: list = []
        loss0: float | None = None
        i = 0
        for w in range(cfg.warmup):
            losses: list = []
            self.step(side, i, f"{name}: warm-up", losses)
            if w == 0:
                grads = [(n, None if p.grad is None else p.grad.detach().clone())
                         for n, p in side.stage_module.named_parameters()]
                loss0 = float(losses[0]) if losses else None
            self.optimize(side)
            self.tick(f"{name}: warm-up")
            i += 1
        step_ns: list[tuple[int, int]] = []
        per_step: list[list[TimelineEvent]] = []
        for _ in range(cfg.steps):
            dist.barrier()
            rec.events = []
            rec.on = True
            t0 = time.perf_counter_ns()
            self.step(side, i, f"{name}: timed steps")
            self.optimize(side)
            t1 = time.perf_counter_ns()
            rec.on = False
            step_ns.append((t0, t1))
            per_step.append(rec.events)
            self.tick(f"{name}: timed steps")
            i += 1
        peak, held = self.memory_step(side, i)
        self.tick(f"{name}: memory step")
        result = self.figures(name, plan, step_ns, per_step, peak, held)
        if side.handle is not None:
            side.handle.remove()
        self.current = None
        del side
        gc.collect()
        # the first step's gradients, summed in float64: ground truth for tests against the unsplit model
        result.grad_sq_sum = float(sum(g.double().pow(2).sum() for _, g in grads if g is not None))
        return result, grads, loss0

    def memory_step(self, side: _Side, i: int) -> tuple[int, list[int]]:
        from ...memory.tracker import LiveTensorTracker
        dist.barrier()
        rec = side.rec
        rec.held_at_backward = []
        with LiveTensorTracker(keep_timeline=False) as tracker:
            tracker.track(side.stage_module.parameters(), MemCategory.PARAMETERS)
            tracker.track(optimizer_state_tensors(side.optimizer), MemCategory.OPTIMIZER_STATE)
            rec.tracker = tracker
            try:
                self.step(side, i, "memory step")
                self.optimize(side)
            finally:
                rec.tracker = None
        return tracker.peak_bytes, list(rec.held_at_backward)

    def figures(self, name: str, plan: Plan | None, step_ns: list[tuple[int, int]],
                per_step: list[list[TimelineEvent]], peak: int, held: list[int]) -> StageResult:
        fwd, bwd, rep, p2p, exposed, busy, opt = [], [], [], [], [], [], []
        for (t0, t1), events in zip(step_ns, per_step):
            compute = [(e.start_ns, e.end_ns) for e in events if e.kind in _COMPUTE]
            comm = [(e.start_ns, e.end_ns) for e in events if e.category == "p2p"]

            def total(kind: str) -> float:
                return total_ns([(e.start_ns, e.end_ns) for e in events if e.kind == kind]) / 1e6
            fwd.append(total("forward") + total("loss"))
            bwd.append(total("backward"))
            rep.append(total("replay"))
            opt.append(total("optimizer"))
            p2p.append(total_ns(comm) / 1e6)
            exposed.append(exposed_ns(comm, compute) / 1e6)
            busy.append(total_ns(union(compute)) / 1e6)   # busy ms; idle is taken against the pipeline's step
        last_t0 = step_ns[-1][0]
        return StageResult(
            side=name, stage=self.rank, rank=self.rank, host=socket.gethostname(),
            in_flight=sum(self.stage_in_flight(self.rank).values()),
            blocks=self.rank_blocks(self.rank),
            boundaries=[] if plan is None else [b.module for b in plan.boundaries],
            step_ns=step_ns, forward_ms=fwd, backward_ms=bwd, replay_ms=rep, optimizer_ms=opt, p2p_ms=p2p,
            exposed_p2p_ms=exposed, compute_ms=busy, peak_bytes=peak, held_at_backward_bytes=held,
            timeline=[dataclasses.replace(e, start_ns=e.start_ns - last_t0, end_ns=e.end_ns - last_t0)
                      for e in per_step[-1]], timeline_t0_ns=last_t0)

    def plans(self, base_peaks: list[int]) -> tuple[PipelinePlan | None, PipelinePlan | None, "StageReplanner | None"]:
        """(uniform, remat, how to re-plan remat): both plans from the profile and the measured unplanned stage
        peaks; the re-planner only when remat's plans were made here (a given plan runs as given)."""
        cfg = self.cfg
        from ...plan.budget import parse_budget
        report = self.profile()
        budget = parse_budget(self.pp.budget or "80%", max(base_peaks))
        planner = PlannerSpec.parse(self.pp.planner)   # the config's text, parsed once (NOTE [planner specs])
        # one plan per rank: with several stages per rank they share its device and budget
        replanner = StageReplanner(report=report, stage_blocks=[self.rank_blocks(k) for k in range(self.p)],
                                   budget_bytes=budget, planner=planner, base_peaks=base_peaks,
                                   plan_kw=dict(schedule=self.pp.schedule, microbatches=self.pp.microbatches, reserve=self.pp.reserve,
                                                in_flights=[self.block_in_flight(k) for k in range(self.p)])) \
            if report is not None else None
        uniform = remat = None
        if Side.UNIFORM in self.pp.sides and replanner is not None:
            uniform = self.pipeline_plan(replanner.plan(planner=self.pp.uniform_planner, budget_bytes=None), budget,
                                         base_peaks)
        if Side.REMAT in self.pp.sides:
            if cfg.plan is not None:
                remat = cfg.plan
                assert isinstance(remat, PipelinePlan)   # DistributedConfig refuses a whole-model plan here
                if len(remat.stages) != self.p:
                    raise PlanError(f"the pipeline plan has {len(remat.stages)} stages; this run has {self.p}")
                return uniform, remat, None
            if replanner is not None:
                remat = self.pipeline_plan(replanner.plan(planner=planner, budget_bytes=budget), budget,
                                           base_peaks)
        return uniform, remat, replanner if remat is not None else None

    def profile(self) -> Any:
        """The config's ProfileReport (what the per-stage plans are planned from), or None."""
        from ...profile.model import ProfileReport
        if self.pp.profile is None:
            return None
        try:
            return ProfileReport.from_json(self.pp.profile)
        except (KeyError, TypeError, ValueError) as exc:
            raise DistributedError(f"the pipeline config's profile is malformed: {exc!r}") from None

    def pipeline_plan(self, plans: list[Plan], budget: int, base_peaks: list[int]) -> PipelinePlan:
        """Every rank's plan, with the stages' blocks, loads and measured unplanned peaks (bytes)."""
        cfg = self.cfg
        return PipelinePlan(schedule=self.pp.schedule, microbatches=self.pp.microbatches, budget_bytes=budget,
                            reserve=self.pp.reserve,
                            stages=[StagePlan(stage=k, blocks=self.rank_blocks(k),
                                              in_flight=sum(self.stage_in_flight(k).values()),
                                              base_peak_bytes=base_peaks[k], plan=plans[k])
                                    for k in range(self.p)],
                            split_points=list(self.pp.split_points), split_source=self.pp.split_source)

    def gather_peaks(self, result: StageResult | None) -> list[int]:
        """Every rank's measured peak (bytes) of the side just run (a collective: every rank calls it)."""
        if result is None:
            raise DistributedError("per-stage planning needs the unplanned side ('none') first")
        peaks: list[Any] = [None] * self.p
        dist.all_gather_object(peaks, result.peak_bytes)
        return [int(x) for x in peaks]

    def run(self) -> RankOutcome:
        cfg = self.cfg
        results: dict[Side, StageResult] = {}
        grads: dict[Side, list] = {}
        losses: dict[Side, float | None] = {}
        uniform = remat = replanner = None
        notes: list[str] = []
        for side in self.pp.sides:
            if side in (Side.UNIFORM, Side.REMAT) and uniform is None and remat is None:
                uniform, remat, replanner = self.plans(self.gather_peaks(results.get(Side.NONE)))
            if side is Side.REMAT and remat is not None and replanner is not None:
                remat, run = RematSideLoop(rank=self, replanner=replanner, notes=notes).run(remat)
            else:
                run = self.run_side(side, _side_plan(side, uniform, remat, self.rank))
            results[side], grads[side], losses[side] = run
        return self.outcome(results, grads, losses, notes, {Side.UNIFORM: uniform, Side.REMAT: remat})

    def outcome(self, results: dict[Side, StageResult], grads: dict[Side, list], losses: dict[Side, float | None],
                notes: list[str], plans: dict[Side, PipelinePlan | None]) -> RankOutcome:
        """What this rank gathers to rank 0: its results, each planned side's gradients against ``none``'s,
        the negative control, and the plans (``self.pp.sides`` are the keys)."""
        control = grads.get(Side.NONE)
        comparisons = {} if control is None else \
            {name: compare_grads(control, g) for name, g in grads.items() if name is not Side.NONE}
        negative = negative_control_rejected(control) if self.pp.perturb_control and control is not None else None
        # every parameter of the stage must have a gradient: None on both sides would compare as "equal"
        missing = {name: [n for n, g in gs if g is None] for name, gs in grads.items()}
        return RankOutcome(results=results, comparisons=comparisons, negative_rejected=negative, losses=losses,
                           missing_grads=missing, notes=notes, plans={k: p for k, p in plans.items() if p is not None})


def negative_control_rejected(control: list) -> bool:
    """Whether :func:`compare_grads` tells the unplanned gradients from a copy with one element moved by 1e-3."""
    bad = [(n, None if g is None else g.clone()) for n, g in control]
    for n, g in bad:
        if g is not None and g.numel():
            g.view(-1)[0] += 1e-3
            break
    return not compare_grads(control, bad).bitwise_equal


_SideRun = tuple[StageResult, list, "float | None"]   # one side on this rank: figures, first-step grads, first loss


def _side_plan(side: Side, uniform: PipelinePlan | None, remat: PipelinePlan | None, rank: int) -> Plan | None:
    """This rank's plan on ``side`` (none: no plan)."""
    pipeline = {Side.UNIFORM: uniform, Side.REMAT: remat}.get(side)
    return pipeline.for_stage(rank) if pipeline else None


@dataclasses.dataclass(kw_only=True)
class StageReplanner:
    """NOTE [pipeline closed loop]: what planning the stages needs; the same on every rank (same gathered peaks,
    same deterministic planner), so every rank re-plans alike."""

    report: Any                 # ProfileReport: the whole model at the microbatch shape
    stage_blocks: list[list[str]]
    budget_bytes: int           # the per-device budget
    planner: PlannerSpec
    base_peaks: list[int]       # each stage's measured unplanned peak (bytes)
    plan_kw: dict[str, Any]     # the rest of plan_stages' keywords: schedule, microbatches, reserve, in_flights

    def plan(self, *, planner: str | PlannerSpec, budget_bytes: int | None, base_peaks: list[int] | None = None) -> list[Plan]:
        return plan_stages(self.report, self.stage_blocks, planner=planner, budget_bytes=budget_bytes,
                           base_peaks=self.base_peaks if base_peaks is None else base_peaks, **self.plan_kw)

    def over(self, peaks: list[int]) -> list[int]:
        """The stages whose measured peak (bytes) is over the per-device budget."""
        return [k for k, peak in enumerate(peaks) if peak > self.budget_bytes]

    def replan(self, remat: PipelinePlan, peaks: list[int]) -> PipelinePlan:
        """Every stage that measured over the budget planned again, its unplanned peak raised by what the model
        missed (measured - predicted with its plan: correction_margin); the others keep their plans. BudgetError
        when no plan fits a raised stage."""
        over = self.over(peaks)
        base = list(self.base_peaks)
        for k in over:
            base[k] += correction_margin(remat.stages[k].plan, peaks[k])
        fresh = self.plan(planner=self.planner, budget_bytes=self.budget_bytes, base_peaks=base)
        stages = [dataclasses.replace(st, plan=fresh[k], base_peak_bytes=base[k]) if k in over else st
                  for k, st in enumerate(remat.stages)]
        return dataclasses.replace(remat, stages=stages)


class RematSideLoop:
    """NOTE [pipeline closed loop]: remat's per-stage plans through the one closed loop (NOTE [one closed loop]),
    each plan run as the whole remat side on every rank and measured per stage."""

    settings = ClosedLoopSettings(max_tries=2, what="remat side")   # the plan, and one re-plan

    def __init__(self, *, rank: PipelineRank, replanner: StageReplanner, notes: list[str]) -> None:
        self.rank, self.replanner, self.notes = rank, replanner, notes
        self.runs: dict[Any, _SideRun] = {}
        self.peaks: list[int] = []    # bytes: every stage's measured peak with the plan run last

    def run(self, remat: PipelinePlan) -> tuple[PipelinePlan, _SideRun]:
        """The plan whose figures the report shows (the re-plan's when there was one), and its run."""
        steps = LoopSteps(measure=self.measure, fits=self.fits, key=_stages_key, cost=_stages_cost,
                          correct=self.correct)   # no relax, no fallbacks: NOTE [pipeline closed loop]
        plan = run_closed_loop(remat, steps, self.settings).plan
        assert plan is not None   # without fallbacks the loop ships the last plan it measured
        return plan, self.runs[_stages_key(plan)]

    def measure(self, remat: PipelinePlan) -> None:
        rank = self.rank
        if self.runs:   # one more side on the progress bar
            rank.total += rank.cfg.warmup + rank.cfg.steps + 1
        run = rank.run_side(Side.REMAT, remat.for_stage(rank.rank))
        self.runs[_stages_key(remat)] = run
        self.peaks = rank.gather_peaks(run[0])

    def fits(self, remat: PipelinePlan) -> bool:
        return all(peak <= remat.budget_bytes for peak in self.peaks)

    def correct(self, remat: PipelinePlan) -> PipelinePlan:
        """The stages that missed, re-planned; the report's notes say so (or that no re-plan fits)."""
        what = ", ".join(f"stage {k} measured {self.peaks[k] / 2 ** 20:.2f} MiB against a predicted "
                         f"{remat.stages[k].plan.predicted_peak_bytes / 2 ** 20:.2f} MiB"
                         for k in self.replanner.over(self.peaks))
        try:
            again = self.replanner.replan(remat, self.peaks)
        except BudgetError as exc:
            self.notes.append(f"remat side: {what}; no re-plan fits ({exc.message})")
            raise
        self.notes.append(f"remat side re-planned once (closed loop): {what}; its unplanned peak was raised by the "
                          f"difference and the stage planned again; the figures are the second attempt's")
        return again


def _stages_key(remat: PipelinePlan) -> tuple:
    """A pipeline plan's identity: each stage's (raised) unplanned peak and boundaries."""
    return tuple((st.base_peak_bytes, tuple((b.module, b.mode.value) for b in st.plan.boundaries))
                 for st in remat.stages)


def _stages_cost(remat: PipelinePlan) -> float:
    return sum(st.plan.predicted_overhead_ms for st in remat.stages)   # ms, predicted added time over all stages


def run_pipeline_rank(cfg: DistributedConfig, out: Path, files: RankFiles) -> None:
    """One rank of engine pipeline (started by ``remat.distributed.worker``): its stages, every side; rank 0
    gathers every rank's outcome and writes ``pipeline.json``."""
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_world = _env_int("LOCAL_WORLD_SIZE", default=world_size)
    if world_size != cfg.world_size:
        raise DistributedError(f"rank {rank}: torchrun started {world_size} ranks but the config asks for "
                               f"{cfg.world_size}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_world))
    files.what = "init_process_group"
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    out_of_rank = PipelineRank(cfg, files).run()
    files.what = "gathering results"
    gathered: list[RankOutcome] | None = [None] * world_size if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(out_of_rank, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        report = assemble_pipeline(cfg, gathered, torch_version=torch.__version__,
                                   memory_source=MemorySource.CPU_LIVE_TENSORS)
        atomic_write_json(out / PIPELINE_REPORT_NAME, report.to_json())
    files.what = "teardown"
    dist.barrier()
    dist.destroy_process_group()
