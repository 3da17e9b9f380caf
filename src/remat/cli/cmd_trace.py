"""``remat trace``: phase trace of the training step at the target (and boundary) shape."""

from __future__ import annotations

import argparse

from rich.table import Table

from .._io import atomic_write_json
from ..errors import DeviceTooSmall, WorkloadError
from ..measure import Arm, measure_arm
from ..plan import parse_capacity
from .._codec import to_json
from ..profile.model import describe_refusal
from ..simulate import DEVICE_MODELS, simulate_workload
from ..trace import StepTrace, to_perfetto, trace_on_device, trace_workload
from ..workload import parse_shape
from ..units import fmt_bytes
from ..receipt.schema import MAX_STEPS, MAX_WARMUP
from .common import (add_compile_args, add_workload_args, bounded_int, check_out_dir, out_folder,
                     simulate_compile_from_args, load_from_args)
from .render import console, progress_bar


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="trace a training step by phase and find the blocking peak")
    add_workload_args(p)
    p.add_argument("--boundary-shape", default="", help="a second shape to trace (e.g. the first one that does not fit)")
    p.add_argument("--warmup", type=bounded_int(0, MAX_WARMUP), default=2, help="untraced warm-up steps (default 2)")
    p.add_argument("--steps", type=bounded_int(1, MAX_STEPS), default=3, help="traced steps (default 3)")
    p.add_argument("--out", required=True, type=out_folder, help="output folder")
    p.add_argument("--device-memory", default=None,
                   help="the device's capacity (e.g. 2GiB), enforced on the CPU: a step that does not fit it "
                        "writes refusal.json (the phase, the refused allocation, the bytes live by kind) and exits 2")
    add_compile_args(p)
    p.add_argument("--simulate", action="store_true",
                   help="run the step under FakeTensorMode: any shape, nothing allocated, memory_source 'simulated'")
    p.add_argument("--target-device", choices=sorted(DEVICE_MODELS), default=None,
                   help="with --simulate: device whose kernels and roofline times to predict "
                        "(default: h100 with --device cuda, else cpu)")
    p.set_defaults(func=run)


def render_trace(trace: StepTrace, title: str) -> None:
    table = Table(title=title)
    for col in ("phase", "start", "end", "peak", "ms"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for ph in trace.phases:
        mark = " [bold red]<- blocking[/]" if ph.name == trace.peak_phase else ""
        table.add_row(ph.name.value + mark, fmt_bytes(ph.start_bytes), fmt_bytes(ph.end_bytes),
                      fmt_bytes(ph.peak_bytes), f"{ph.duration_ms:.1f}")
    console.print(table)
    cats = ", ".join(f"{c.value} {fmt_bytes(b)}" for c, b in trace.categories_at_peak.items() if b)
    console.print(f"peak {fmt_bytes(trace.peak_bytes)} in [bold]{trace.peak_phase.value if trace.peak_phase else '?'}[/] "
                  f"({trace.memory_source.value}); at the peak: {cats}")
    if trace.reference_peak_bytes is not None:
        console.print(f"torch.profiler peak of the same step: {fmt_bytes(trace.reference_peak_bytes)} "
                      f"(tracker/profiler = {trace.peak_bytes / max(1, trace.reference_peak_bytes):.3f})")
    top = ", ".join(f"{m.module} {fmt_bytes(m.bytes)}" for m in trace.top_modules_at_peak[:5])
    console.print(f"largest contributors: {top}")


def _checked_flags(args: argparse.Namespace):  # noqa: ANN202 - (CompileSpec | None, capacity bytes | None)
    """Usage errors before any work: (the compile spec, the device capacity in bytes)."""
    compile = simulate_compile_from_args(args)
    capacity = parse_capacity(args.device_memory) if args.device_memory is not None else None
    if capacity is not None and (args.simulate or compile is not None):
        raise WorkloadError("--device-memory traces the eager step measured", tip="drop --simulate and --compile")
    return compile, capacity


def _on_device(args: argparse.Namespace, capacity: int, boundary: dict, progress):  # noqa: ANN001, ANN202
    """The step traced under the device capacity; DeviceTooSmall (refusal.json written) when it does not fit."""
    found, refusal = trace_on_device(load_from_args(args), capacity, warmup=args.warmup, steps=args.steps,
                                     boundary_shape=boundary or None, progress=progress)
    if refusal is not None:
        atomic_write_json(args.out / "refusal.json", to_json(refusal))
        raise DeviceTooSmall(f"the unplanned step does not fit the device capacity of {fmt_bytes(capacity)}: "
                             f"{describe_refusal(refusal)}; wrote {args.out / 'refusal.json'}. remat plan "
                             "with the same --device-memory plans it from smaller batches",
                             capacity_bytes=capacity, floor_bytes=None)
    assert found is not None
    return found


def _write_simulation(args: argparse.Namespace, sim, trace) -> None:  # noqa: ANN001
    atomic_write_json(args.out / "simulation.json", sim.to_json())
    dm = sim.device_model
    console.print(f"simulated for {dm.description}: predicted step {sim.runtime.step_ms:.1f} ms "
                  f"(roofline x {dm.calibration:g}); peak {fmt_bytes(trace.peak_bytes)} "
                  f"{'fits' if sim.fits else '[bold red]does not fit[/]'} in {fmt_bytes(dm.memory_bytes)}; "
                  f"simulated in {sim.wall_s:.1f} s")


def _write_compiled(args: argparse.Namespace, compile, compiled, trace) -> None:  # noqa: ANN001
    atomic_write_json(args.out / "compiled.json", {
        "compile": compile.to_json(), **compiled.to_json(),
        "eager_peak_bytes": trace.peak_bytes, "eager_memory_source": trace.memory_source.value,
        "note": "the phase trace (trace.json) is the eager step: the live-tensor tracker would run compiled "
                "code eagerly; this file is the compiled whole step, measured warm after compiling"})
    console.print(f"compiled ({compile.describe()}): peak {fmt_bytes(compiled.peak_bytes)} "
                  f"({compiled.memory_source.value}) vs eager {fmt_bytes(trace.peak_bytes)}; warm p50 "
                  f"{compiled.p50_ms:.1f} ms; compile {compiled.compile_s or 0:.1f} s (not in the step times); "
                  f"wrote {args.out / 'compiled.json'}", highlight=False)


def run(args: argparse.Namespace) -> int:
    boundary = parse_shape(args.boundary_shape)
    check_out_dir(args.out, ("trace.json", "trace.perfetto.json", "simulation.json", "trace.boundary.perfetto.json",
                             "compiled.json", "refusal.json"))
    compile, capacity = _checked_flags(args)
    compiled = None
    sim = None
    with progress_bar() as progress:
        if args.simulate:
            target = args.target_device or ("h100" if args.device.startswith("cuda") else "cpu")
            sim = simulate_workload(args.workload, parse_shape(args.shape), dtype=args.dtype, target_device=target,
                                    warmup=args.warmup, steps=args.steps, boundary_shape=boundary or None,
                                    progress=progress)
            trace = sim.trace
        elif capacity is not None:
            trace = _on_device(args, capacity, boundary, progress)
        else:
            loaded = load_from_args(args)
            trace = trace_workload(loaded, warmup=args.warmup, steps=args.steps,
                                   boundary_shape=boundary or None, progress=progress)
            if compile is not None:   # the phase trace needs the live-tensor tracker: eager (NOTE [compiled arms])
                compiled = measure_arm(loaded, Arm("compiled", compile=compile), warmup=max(1, args.warmup),
                                       steps=max(3, args.steps))
    atomic_write_json(args.out / "trace.json", trace.to_json())
    atomic_write_json(args.out / "trace.perfetto.json", to_perfetto(trace))
    render_trace(trace, f"{trace.context.workload} {trace.context.shape or '(default shape)'}")
    if sim is not None:
        _write_simulation(args, sim, trace)
    if compiled is not None:
        _write_compiled(args, compile, compiled, trace)
    if trace.boundary is not None:
        render_trace(trace.boundary, f"boundary shape {trace.boundary.context.shape}")
        atomic_write_json(args.out / "trace.boundary.perfetto.json", to_perfetto(trace.boundary))
    console.print(f"wrote {args.out / 'trace.json'} and {args.out / 'trace.perfetto.json'}")
    return 0
