"""``remat plan``: profile candidates, plan under a peak budget, apply and measure (closed loop)."""

from __future__ import annotations

import argparse
import dataclasses

from rich.markup import escape
from rich.table import Table

from .._io import atomic_write_json
from ..closed_loop import ClosedLoopResult
from ..plan import PLANNER_SPECS, Plan, budget_on_device, check_budget_syntax, parse_budget, parse_capacity, parse_reserve
from ..plan.offload import measured_pricing, modelled_pricing
from ..errors import WorkloadError
from ..profile import ProfileReport
from ..profile.model import DEFAULT_SAMPLE_STEPS, MAX_SAMPLE_STEPS, StepSample
from ..workflow.plan import PlanSettings, plan_simulated, plan_step
from ..workload import parse_shape
from ..units import fmt_bytes
from .common import (add_autocast_arg, add_budget_args, add_compile_args, add_workload_args, bounded_int, check_out_dir, out_folder, simulate_compile_from_args,
                     load_from_args, refuse_autocast_with)
from .render import console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose the cheapest checkpoint boundaries whose step peak fits a budget")
    add_workload_args(p)
    add_autocast_arg(p)
    add_plan_args(p)
    p.add_argument("--out", required=True, type=out_folder, help="output folder (plan.json, profile.json)")
    add_compile_args(p)
    p.set_defaults(func=run)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_budget_args(p, budget_needs="required by the optimal and greedy planners",
                    device_memory="; on the CPU it is enforced (an allocation past it raises out of memory, as on "
                                  "CUDA), and a step that does not fit it unplanned is planned from smaller batch_size "
                                  "values (NOTE [blocked step])")
    p.add_argument("--planner", default="optimal", help=f"one of: {', '.join(PLANNER_SPECS)} (default optimal)")
    p.add_argument("--candidates", default=None,
                   help="comma-separated module paths, class names or regexes (default: repeated blocks and their children)")
    p.add_argument("--allow-hazards", action="store_true",
                   help="plan hazardous candidates unguarded (to show verification catching them)")
    p.add_argument("--no-measure", action="store_true", help="skip the apply-and-measure closed loop")
    p.add_argument("--no-time-race", action="store_true",
                   help="ship the closed loop's plan without timing it against the fastest simple plan that fits "
                        "(all blocks, every k-th, first k, checkpoint_sequential; NOTE [time race]); saves about "
                        "21 steps and up to 3 peak measurements")
    p.add_argument("--offload", action="store_true",
                   help="also offer activation offload per boundary (saved activations wait in host memory), "
                        "and a segment's input on the host while it waits for its replay (mode full-host-input), "
                        "priced from this machine's measured copy bandwidth; the planner picks keep, recompute "
                        "or offload per boundary")
    p.add_argument("--host-budget", default=None,
                   help="with --offload: host memory the offloaded activations may hold (e.g. 16GiB; default: no bound)")
    p.add_argument("--simulate", action="store_true",
                   help="profile under FakeTensorMode (any shape, nothing allocated) with times from a device "
                        "model; the plan records that its figures are simulated (no closed loop)")
    p.add_argument("--target-device", default=None, help="with --simulate: h100, a100, h200 or cpu")
    add_sample_args(p)


def add_sample_args(p: argparse.ArgumentParser, *, boundary_shape: bool = True) -> None:
    """``--sample-steps`` (and ``--boundary-shape``): the steps profiled and measured (NOTE [step sample])."""
    p.add_argument("--sample-steps", type=bounded_int(1, MAX_SAMPLE_STEPS), default=DEFAULT_SAMPLE_STEPS,
                   help=f"steps profiled and measured per shape, each with its own batch and seed; the plan holds "
                        f"on all of them (default {DEFAULT_SAMPLE_STEPS}; 1: one step, as before)")
    if boundary_shape:
        p.add_argument("--boundary-shape", default="",
                       help="shape keywords of a second build whose steps join the sample, e.g. seq_len=128 "
                            "(the longest batch of the run): the plan holds at both shapes")


def sample_from_args(args: argparse.Namespace) -> StepSample:
    boundary = parse_shape(args.boundary_shape)
    return StepSample.of(args.sample_steps, [boundary] if boundary else [])


def plan_from_args(args: argparse.Namespace, progress) -> tuple[ProfileReport, ClosedLoopResult | Plan]:  # noqa: ANN001
    """``remat plan``'s flags, checked before any work, then one library call: ``plan_simulated`` with
    --simulate, else ``plan_step`` (closed loop unless --no-measure)."""
    settings, host_budget = _settings_from_args(args)
    if args.simulate:
        if args.boundary_shape:
            raise WorkloadError("--boundary-shape is measured, not simulated: it joins the steps of a second build "
                                "to the sample (NOTE [step sample])", tip="drop --simulate, or plan --simulate at "
                                                                          "the longer shape with --shape")
        from ..simulate import get_device_model
        refuse_autocast_with(args, "--simulate", "the simulated step models the workload's own dtype only")
        target = args.target_device or ("h100" if args.device.startswith("cuda") else "cpu")
        get_device_model(target)  # a typed error for an unknown device, before profiling
        if args.offload:
            settings = dataclasses.replace(settings, offload=modelled_pricing(target, host_budget_bytes=host_budget))
        return plan_simulated(args.workload, parse_shape(args.shape), dtype=args.dtype, device=args.device,
                              target_device=target, settings=settings, progress=progress)
    if args.offload:
        settings = dataclasses.replace(settings, offload=measured_pricing(args.device, host_budget_bytes=host_budget))
    loaded = load_from_args(args)
    return plan_step(loaded, settings, sample_from_args(args), progress)


def _settings_from_args(args: argparse.Namespace) -> tuple[PlanSettings, int | None]:
    """(the settings the flags give, offload pricing to come; the host budget, bytes): usage errors before any work."""
    reserve = parse_reserve(args.reserve)
    if args.budget is not None:
        check_budget_syntax(args.budget)  # syntax check before minutes of profiling
    capacity = parse_capacity(args.device_memory) if args.device_memory is not None else None
    if capacity is not None:
        if args.simulate:
            raise WorkloadError("--device-memory is measured, not simulated", tip="drop --simulate, or --device-memory")
        if args.budget is not None and not str(args.budget).strip().endswith("%"):
            budget_on_device(args.budget, 0, capacity)   # an amount above the device: refused before profiling
    candidates = [c.strip() for c in args.candidates.split(",") if c.strip()] if args.candidates else None
    compile = simulate_compile_from_args(args)
    return PlanSettings(planner=args.planner, budget=args.budget, reserve=reserve, capacity_bytes=capacity,
                        candidates=candidates, allow_hazards=args.allow_hazards, measure=not args.no_measure,
                        compile=compile, time_race=not args.no_time_race), _host_budget_from_args(args, compile)


def _host_budget_from_args(args: argparse.Namespace, compile) -> int | None:  # noqa: ANN001
    """``--offload`` / ``--host-budget``: usage errors before any work, and the host budget (bytes) or None."""
    offload, host_budget = args.offload, args.host_budget
    if host_budget is not None and not offload:
        raise WorkloadError("--host-budget only applies with --offload", tip="add --offload")
    if not offload:
        return None
    if compile is not None:
        raise WorkloadError("--offload cannot be combined with --compile: offload boundaries run eagerly "
                            "(NOTE [activation offload])", tip="drop --offload or --compile")
    host_bytes = None
    if host_budget is not None:
        check_budget_syntax(host_budget)
        if str(host_budget).strip().endswith("%"):
            raise WorkloadError(f"--host-budget {host_budget}: give bytes with a unit (16GiB), not a share",
                                tip="e.g. --host-budget 16GiB")
        host_bytes = parse_budget(host_budget, 1)
    return host_bytes


def render_plan(plan: Plan) -> None:
    table = Table(title=f"plan: {plan.planner}")
    for col in ("module", "mode", "saves", "replay ms", "guarded"):
        table.add_column(col, justify="left" if col in ("module", "mode") else "right")
    for b in plan.boundaries:
        table.add_row(b.module, b.mode.value, fmt_bytes(b.saved_bytes), f"{b.replay_ms:.2f}", "yes" if b.guarded else "")
    console.print(table)
    if plan.excluded:
        # reasons are library text that names NOTEs ("[step sample]"): not rich markup
        console.print("excluded: " + escape("; ".join(f"{e.module} ({e.reason})" for e in plan.excluded[:6]))
                      + (" ..." if len(plan.excluded) > 6 else ""))
    budget = f"{fmt_bytes(plan.budget_bytes)} less {plan.reserve:.0%} reserve = {fmt_bytes(plan.effective_budget_bytes)}" \
        if plan.budget_bytes else "none"
    console.print(f"budget: {budget}")
    console.print(f"peak: baseline {fmt_bytes(plan.baseline_peak_bytes)}, predicted {fmt_bytes(plan.predicted_peak_bytes)}"
                  + (f", measured {fmt_bytes(plan.measured_peak_bytes)} ({plan.memory_source})"
                     if plan.measured_peak_bytes is not None else ""))
    spread = plan.sample.spread if plan.sample is not None else None
    if spread is not None:
        console.print(f"sample: {len(plan.sample.point_peaks)} steps; measured peak min {fmt_bytes(spread['min'])}, "
                      f"median {fmt_bytes(spread['median'])}, max {fmt_bytes(spread['max'])} (NOTE \\[step sample])")
    if plan.blocked is not None:
        console.print(f"[bold]blocked[/]: {escape(plan.blocked.describe())}; the plan was measured at the target "
                      "(NOTE \\[blocked step])", highlight=False)
    if plan.compile is not None:
        console.print(f"compiled: {plan.compile.describe()}; measured warm after compiling")
    if plan.workload is not None and plan.workload.autocast is not None:
        console.print(f"autocast: the forward ran under torch.autocast({plan.workload.autocast}); every figure is of that step")
    if plan.time_race is not None:   # NOTE [time race]
        console.print(f"time race: {escape(plan.time_race.describe())}", highlight=False)
    if plan.small_boundaries is not None:   # NOTE [small boundaries] in remat/plan/planners.py
        console.print(f"small boundaries: {escape(plan.small_boundaries.describe())}", highlight=False)
    if plan.simulated:
        console.print(f"[yellow]simulated[/]: bytes from FakeTensorMode, times from the {plan.device_model} device model "
                      "(no step was run; nothing was measured)")
    # NOTE [auto overhead]: the planned step is timed once, not interleaved with the baseline
    console.print(f"step: baseline {plan.baseline_step_ms:.1f} ms, predicted overhead +{plan.predicted_overhead_ms:.1f} ms"
                  + (f"; the planned step measured {plan.measured_step_ms:.1f} ms in one run, not interleaved "
                     "(not an overhead: remat frontier measures that, with its interval)"
                     if plan.measured_step_ms is not None else ""))


def run(args: argparse.Namespace) -> int:
    parse_reserve(args.reserve)
    if args.budget is not None:
        check_budget_syntax(args.budget)
    check_out_dir(args.out, ("plan.json", "profile.json"))
    with progress_bar() as progress:
        report, result = plan_from_args(args, progress)
    plan = result.plan if isinstance(result, ClosedLoopResult) else result
    atomic_write_json(args.out / "profile.json", report.to_json())
    plan.save(args.out / "plan.json")
    render_plan(plan)
    if isinstance(result, ClosedLoopResult) and len(result.attempts) > 1:
        console.print(f"closed loop: {len(result.attempts)} tries; measured peaks "
                      + ", ".join(fmt_bytes(a.measured_peak_bytes) for a in result.attempts))
    if plan.effective_budget_bytes is not None and plan.measured_peak_bytes is not None \
            and plan.measured_peak_bytes > plan.effective_budget_bytes:
        console.print("[bold red]the measured peak misses the budget[/]")
        return 1
    console.print(f"wrote {args.out / 'plan.json'}")
    return 0
