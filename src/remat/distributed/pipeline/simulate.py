"""Predict a pipeline's per-stage peaks and bubbles for world sizes this machine does not have.

NOTE [simulated pipeline]
Built on the simulate stage (NOTE [simulated step] in remat/simulate): the whole model is built
on ``meta`` and made fake at the *microbatch* shape, cut into stages exactly as the real engine
cuts it (NOTE [pipeline stages]: ``stage_layout`` and ``stage_examples``), and for each stage,
under ``FakeTensorMode`` (nothing is allocated, nothing computed):
* its forward and backward on one microbatch run under the simulate stage's ``OpCostRecorder``
  and are priced by its roofline model of the target device (ms);
* its static bytes are its parameters, their gradients and the optimizer state after one
  optimizer step on fake gradients (the workload's own optimizer);
* under the live-tensor tracker (the one real CPU traces use): the bytes one microbatch leaves
  held after the stage's forward (saved activations and the output), and the peak of that
  microbatch's forward and backward above what was live before it.
Predicted stage peak = static + (in-flight - 1) x held + that one-microbatch peak: the other
held microbatches wait while one goes through its backward; in-flight is the schedule's count
(NOTE [pipeline in-flight cost model]). The bubble comes from playing the
schedule's order (GPipe: all forwards then all backwards; 1F1B: p - k warm-up forwards, then
one backward / one forward, then the remaining backwards) with each stage's predicted forward
and backward times and free communication: stage k's forward of microbatch i starts when stage
k is free and stage k - 1 has finished it; its backward when stage k + 1 has finished that
microbatch's backward. Bubble per stage = 1 - busy / step, as the measured engine reports it.
Without split points the blocks are cut as the engine cuts them (NOTE [default split]), by the
roofline's predicted forward time per block, embedding and head + loss instead of measured ones.
A plan (``PipelinePlan``, the whole model's names) is applied before the stages are cut, so its
boundaries' savings and replays are simulated, not modelled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._codec import JsonCodec
from ...errors import DistributedError
from ...plan.pipeline import PipelinePlan, Schedule, ideal_bubble, in_flight
from ...types import Phase, ProgressFn, no_progress
from .engine import microbatch_shape, split_batch, stage_examples, stage_layout


@dataclasses.dataclass(kw_only=True)
class SimulatedStage(JsonCodec):
    stage: int
    blocks: list[str]
    in_flight: int
    forward_ms: float        # one microbatch, predicted on the target device
    backward_ms: float       # one microbatch, replay included when a plan is applied
    held_bytes: int          # one microbatch's live bytes after the stage's forward (saved activations + output)
    static_bytes: int        # parameters + gradients + optimizer state
    peak_bytes: int          # predicted: static + (in_flight - 1) x held + one microbatch's fwd+bwd peak
    bubble_fraction: float   # from the schedule's order with these times


@dataclasses.dataclass(kw_only=True)
class SimulatedPipeline(JsonCodec):
    spec: str
    device: str
    world_size: int
    schedule: Schedule
    microbatches: int
    split_points: list[str]
    split_source: str
    step_ms: float
    ideal_bubble_fraction: float
    stages: list[SimulatedStage]


def schedule_order(schedule: Schedule | str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s compute actions in order, ``("F"|"B", microbatch)``, as torch's single-stage schedules
    issue them (GPipe: every forward, then every backward; 1F1B: min(m, p - k) warm-up forwards, then one backward
    and one forward in turn, then the remaining backwards)."""
    m = microbatches
    if Schedule(schedule) is Schedule.GPIPE:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if Schedule(schedule).multi:
        raise DistributedError("simulating an interleaved schedule is not supported yet",
                               tip="simulate gpipe or 1f1b")
    warm = in_flight(schedule, stage, stages, m)
    out = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        out.append(("B", b))
        b += 1
        if f < m:
            out.append(("F", f))
            f += 1
    return out


def play_schedule(schedule: Schedule | str, fwd_ms: list[float], bwd_ms: list[float],
                  microbatches: int) -> tuple[float, list[float]]:
    """(step ms, busy ms per stage): the schedule's order played with free communication (NOTE [simulated
    pipeline]). Dependencies: F(k, i) after F(k-1, i); B(k, i) after B(k+1, i) and after F(k, i)."""
    p = len(fwd_ms)
    orders = [schedule_order(schedule, k, p, microbatches) for k in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    while any(pos[k] < len(orders[k]) for k in range(p)):
        progressed = False
        for k in range(p):
            while pos[k] < len(orders[k]):
                kind, i = orders[k][pos[k]]
                dep = ("F", k - 1, i) if kind == "F" and k > 0 else ("B", k + 1, i) if kind == "B" and k < p - 1 else None
                if dep is not None and dep not in done:
                    break
                start = max(free[k], done.get(dep, 0.0) if dep else 0.0)
                end = start + (fwd_ms[k] if kind == "F" else bwd_ms[k])
                done[(kind, k, i)] = free[k] = end
                pos[k] += 1
                progressed = True
        if not progressed:   # pragma: no cover - the orders above always make progress
            raise DistributedError("the simulated schedule deadlocked")
    step = max(free)
    busy = [microbatches * (fwd_ms[k] + bwd_ms[k]) for k in range(p)]
    return step, busy


def _storage_bytes(tensors: list[Any]) -> int:
    seen: dict[Any, int] = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            key = st._cdata if hasattr(st, "_cdata") else id(st)
            seen[key] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _default_split(sim: Any, inputs: Any, targets: Any, world_size: int) -> list[str]:
    """The engine's default split (NOTE [default split]), balanced by *predicted* forward time per block."""
    import torch

    from ...simulate import OpCostRecorder, predict_runtime
    from ...workload.contract import call_user
    from .engine import balanced_bounds, find_blocks
    wl = sim.loaded.workload
    model = wl.model
    path = find_blocks(model)
    n = len(model.get_submodule(path))
    probe = stage_layout(model, [f"{path}.{max(1, (k * n) // world_size)}" for k in range(1, world_size)]
                         if n >= world_size else [], world_size, inputs)
    with OpCostRecorder(model) as cost, torch.no_grad():
        cost.marker(Phase.FORWARD)
        call_user("the workload's loss", wl.loss, model, (inputs, targets))
    run = predict_runtime(cost.ops, sim.device_model)
    fwd = run.module_fwd_ms
    costs = [fwd.get(f"{path}.{i}", 0.0) for i in range(n)]
    embed_ms = sum(fwd.get(m, 0.0) for m in probe.embed_modules)
    # the head and the loss: everything of the forward outside the embedding and the blocks
    bounds = balanced_bounds(costs, world_size, embed_ms,
                             max(0.0, run.phase_ms.get(Phase.FORWARD, 0.0) - embed_ms - sum(costs)))
    return [f"{path}.{b}" for b in bounds[1:-1]]


def _apply_merged(model: Any, plan: PipelinePlan) -> None:
    """Every stage's boundaries on the whole model (they carry its names), before the stages are cut."""
    from ...wrap import apply
    merged = dataclasses.replace(plan.stages[0].plan, boundaries=[b for st in plan.stages for b in st.plan.boundaries])
    apply(model, merged)


def _static_bytes(sim: Any, names: list[str]) -> int:
    """Parameters of the stage's modules, their gradients and the optimizer's state after one step (bytes).
    Leaves zero gradients on them, so a microbatch's backward accumulates into them in place."""
    import torch

    from ...simulate.semantics import prepare_optimizer
    from ...workload.contract import call_user
    wl = sim.loaded.workload
    model = wl.model
    # every name a parameter goes by: a tied weight (gpt's lm_head.weight is wte.weight) is on both end stages
    params = list({id(p): p for n, p in model.named_parameters(remove_duplicate=False)
                   if any(n == m or n.startswith(m + ".") for m in names)}.values())
    model.zero_grad(set_to_none=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = call_user("the workload's optimizer", wl.optimizer, params) if wl.optimizer is not None \
        else torch.optim.SGD(params, lr=1e-3)
    prepare_optimizer(opt, sim.semantics)
    opt.step()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return _storage_bytes(params) * 2 + _storage_bytes(state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Microbatch:
    """One microbatch through one stage."""

    held_bytes: int      # live after the stage's forward (saved activations + output)
    peak_bytes: int      # the peak of its forward and backward above what was live before it
    forward_ms: float    # predicted on the target device
    backward_ms: float


def _microbatch_pass(sim: Any, layout: Any, k: int, stage_in: Any, targets: Any) -> _Microbatch:
    """Stage ``k``'s forward (and loss on the last stage) and backward of one microbatch, under the live-tensor
    tracker and the cost recorder (NOTE [simulated pipeline])."""
    import torch

    from ...memory.tracker import LiveTensorTracker
    from ...simulate import OpCostRecorder, predict_runtime
    from ...workload.contract import call_user
    wl = sim.loaded.workload
    model = wl.model
    chain = layout.chain
    first, last = k == 0, k == layout.stages - 1
    with LiveTensorTracker(keep_timeline=False) as tracker:
        with OpCostRecorder(model) as fcost:
            h = chain.embed(model, stage_in) if first else stage_in
            for i in range(layout.bounds[k], layout.bounds[k + 1]):
                h = chain.block(model, i, h)
            out = call_user("the workload's loss", wl.loss, _Out(chain.head(model, h)), (None, targets)) \
                if last else h
        held = tracker.live_bytes
        with OpCostRecorder(model) as bcost:
            if last:
                out.backward()
            else:
                out.backward(torch.ones_like(out))
        del out, h
        peak = tracker.peak_bytes
    return _Microbatch(held_bytes=held, peak_bytes=peak, forward_ms=predict_runtime(fcost.ops, sim.device_model).step_ms,
                       backward_ms=predict_runtime(bcost.ops, sim.device_model).step_ms)


def _simulate_stage(sim: Any, layout: Any, k: int, inputs: Any, targets: Any, schedule: Schedule,
                    microbatches: int) -> SimulatedStage:
    """Stage ``k``: its static bytes, one microbatch's pass, and its peak with the schedule's in-flight count
    (its bubble comes from playing the schedule, :func:`play_schedule`)."""
    model = sim.loaded.workload.model
    stage_in, _ = stage_examples(model, layout, k, inputs)
    static = _static_bytes(sim, layout.stage_modules(k))
    mb = _microbatch_pass(sim, layout, k, stage_in, targets)
    n_held = in_flight(schedule, k, layout.stages, microbatches)
    return SimulatedStage(stage=k, blocks=layout.stage_blocks(k), in_flight=n_held, forward_ms=mb.forward_ms,
                          backward_ms=mb.backward_ms, held_bytes=mb.held_bytes, static_bytes=static,
                          peak_bytes=static + (n_held - 1) * mb.held_bytes + mb.peak_bytes, bubble_fraction=0.0)


def simulate_pipeline(spec: str, shape: dict[str, Any], *, world_size: int, microbatches: int,
                      schedule: Schedule | str = Schedule.ONE_F_ONE_B, split_points: list[str] | None = None,
                      target_device: str = "cpu", dtype: str = "float32", plan: PipelinePlan | None = None,
                      progress: ProgressFn = no_progress) -> SimulatedPipeline:
    """NOTE [simulated pipeline]. ``split_points``: as the engine takes them (default: even block counts)."""
    from ...simulate import load_simulated
    schedule = Schedule(schedule)
    if schedule.multi:
        schedule_order(schedule, 0, world_size, microbatches)   # the typed refusal
    sim = load_simulated(spec, microbatch_shape(shape, microbatches), dtype=dtype, target_device=target_device)
    model = sim.loaded.workload.model
    stages: list[SimulatedStage] = []
    with sim.session():
        inputs, targets = split_batch(sim.loaded.workload.batch(0))
        source = "given"
        if split_points is None:
            split_points = _default_split(sim, inputs, targets, world_size)
            source = "default: even by predicted forward time"
        layout = stage_layout(model, split_points, world_size, inputs)
        if plan is not None:
            _apply_merged(model, plan)
        for k in range(world_size):
            progress("simulating pipeline stages", k, world_size)
            stages.append(_simulate_stage(sim, layout, k, inputs, targets, schedule, microbatches))
    step, busy = play_schedule(schedule, [s.forward_ms for s in stages], [s.backward_ms for s in stages], microbatches)
    for s, bz in zip(stages, busy):
        s.bubble_fraction = max(0.0, 1.0 - bz / step) if step > 0 else 0.0
    progress("simulating pipeline stages", world_size, world_size)
    return SimulatedPipeline(spec=spec, device=sim.device_model.name, world_size=world_size, schedule=schedule,
                             microbatches=microbatches, split_points=list(split_points), split_source=source,
                             step_ms=step, ideal_bubble_fraction=ideal_bubble(world_size, microbatches), stages=stages)


class _Out:
    """A stand-in model for the workload's loss: returns the stage's output (as the engine's loss_fn does)."""

    def __init__(self, output: Any) -> None:
        self.output = output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.output
