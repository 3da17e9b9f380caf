#!/usr/bin/env python
"""Side-by-side benchmark of remat ``optimal`` against the anchors (issue 5).

    .venv/bin/python benchmarks/compare.py            # gpt, mlp, cnn; writes benchmarks/RESULTS.md section
    .venv/bin/python benchmarks/compare.py --quick    # smaller shapes, no torch.compile (~1 min)
    .venv/bin/python benchmarks/compare.py --check-tracker   # does the CPU tracker see compiled graphs?

For each workload, in ONE process and one interleaved round-robin (remat.frontier's
NOTE [interleaved timing]), it measures the whole training step (batch, forward,
backward, optimizer) of:

  none            the unmodified step (the control; every overhead is against it)
  all             every block checkpointed (HF / Megatron "full")                 [remat planner]
  uniform:2       every 2nd block                                                  [remat planner]
  sqrt            Chen et al.'s sqrt(n) trade, per-module form (plan/planners.py)  [remat planner]
  sac-matmuls     torch SAC, "save matmuls / attention / conv, recompute the rest",
                  on every block (= remat's ``selective`` planner, wrap/policy.py)
  ckpt_seq:S      torch.utils.checkpoint.checkpoint_sequential over the block chain,
                  S segments (S = 2, ceil(sqrt n), n); see SequentialArm for ModuleList models
  compile-amb0.5  torch.compile with torch._functorch.config.activation_memory_budget = 0.5
  first-k@B       the first k blocks checkpointed, each alone, with the k of least predicted
                  overhead that fits B (remat's ``first-k`` planner, issue 14)              [remat planner]
  remat optimal@B remat's optimal plan for a peak budget B (share of the control's
                  profiled peak; default 70% and 55%), planned with no reserve through the
                  closed loop

Peaks: each arm alone, one warm step, remat's CPU peak (the allocator counter, or the live-tensor
tracker where it cannot be built: ``measure_step_peak``); the compiled arm's peak
comes from torch.profiler's allocator events instead (see CompileArm: the tracker cannot
see compiled graphs). Capacity: the largest batch_size whose peak fits each budget
(remat.frontier.search_capacity, probes memoised across budgets).

Results go to benchmarks/results/compare.json (raw) and, unless --no-write, to the
"## Frontier and anchors (issue 5)" section of benchmarks/RESULTS.md (other sections
are left as they are).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from remat.closed_loop import plan_closed_loop
from remat.frontier import CapacityTry, capacity_try, p50_difference, search_capacity
from remat.frontier.model import unresolved_why
from remat.measure import Arm, measure_arm_peak, prepare_arm, release_memory, time_round_robin
from remat.memory import PeakMeasurement, profiler_step_peak
from remat.plan import InfeasibleBudget, make_plan
from remat.profile import profile_workload
from remat.types import MemorySource
from remat.workload import LoadedWorkload, TrainingStep, load_workload
from remat.wrap import PlanArm

HERE = Path(__file__).resolve().parent
MIB = 2 ** 20
SECTION = "## Frontier and anchors (issue 5)"

# Shapes: defaults of the built-ins, sized to take ~0.3-0.8 s a step on one core here, with
# activations (not AdamW state) dominating the peak, so that checkpointing has something to do.
# Profiled here: checkpoint floors (lowest predicted peak of any plan) ~47% (gpt), ~45% (mlp),
# ~50% (cnn) of the control's peak; at the built-ins' own defaults mlp and cnn floors are 75-79%
# (AdamW state / stem activations dominate), which leaves nothing to choose below 80%.
FULL = {
    "gpt": {"batch_size": 8, "seq_len": 128},                    # 6 layers, d_model 256, vocab 1024
    "mlp": {"batch_size": 2048, "width": 128},                    # 12 uneven blocks (1x..8x hidden)
    "cnn": {"batch_size": 32, "width": 16, "blocks_per_stage": 4},  # ResNet, 12 BasicBlocks (BatchNorm)
}
# zoo transformers (benchmarks/zoo/, issue 14): their defaults, by file; ``--workloads hf_gpt2,...``
ZOO_SPECS = {name: str(HERE / "zoo" / f"{name}.py") + ":build" for name in ("hf_gpt2", "hf_llama", "hf_bert_mlm")}
FULL.update({name: {} for name in ZOO_SPECS})
QUICK = {
    "gpt": {"batch_size": 8, "seq_len": 64, "n_layer": 4, "d_model": 128},
    "mlp": {"batch_size": 1024, "width": 64, "depth": 8},
    "cnn": {"batch_size": 16, "width": 8, "blocks_per_stage": 3},
    **{name: {} for name in ZOO_SPECS},
}


# -- the anchors as remat.frontier arms -------------------------------------------------------

class SequentialCheckpoint(nn.Module):
    """Runs a chain of blocks with torch's ``checkpoint_sequential`` (non-reentrant)."""

    def __init__(self, blocks: list[nn.Module], segments: int) -> None:
        super().__init__()
        self.chain = nn.ModuleList(blocks)
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(list(self.chain), self.segments, x, use_reentrant=False)


# NOTE [checkpoint_sequential on ModuleList models]
# checkpoint_sequential needs the blocks as one chain x -> b0 -> b1 -> ... -> b(n-1).
# cnn keeps them in an nn.Sequential (``model.blocks``), which is swapped for a
# SequentialCheckpoint over the same block objects. gpt (``model.h``) and mlp
# (``model.blocks``) keep them in an nn.ModuleList that the parent's forward iterates as a
# plain chain (``for block in self.h: x = block(x)``; read in workload/builtins/), so the
# ModuleList is swapped for a one-element ModuleList holding a SequentialCheckpoint over
# the original blocks: the parent's loop then calls the whole chain once. The parameters
# are the same objects (the optimizer is made after the swap). For any other parent
# (a ModuleList used with skips, extra arguments...) the arm is skipped with that reason.
_CHAIN_LOOPS = {("GPT", "h"), ("ResidualMLP", "blocks")}


class SequentialArm(Arm):
    def __init__(self, container: str, segments: int) -> None:
        super().__init__(f"ckpt_seq:{segments}")
        self.container = container
        self.segments = segments

    def prepare(self, fresh: LoadedWorkload):  # noqa: ANN201
        model = fresh.workload.model
        parent_path, _, attr = self.container.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if isinstance(old, nn.Sequential):
            setattr(parent, attr, SequentialCheckpoint(list(old), self.segments))
        elif isinstance(old, nn.ModuleList) and (type(parent).__name__, attr) in _CHAIN_LOOPS:
            setattr(parent, attr, nn.ModuleList([SequentialCheckpoint(list(old), self.segments)]))
        else:
            raise RuntimeError(f"{self.container} is a {type(old).__name__} whose parent's forward is not known "
                               "to be a plain chain")
        return lambda: setattr(parent, attr, old)


class CompileArm(Arm):
    """torch.compile of the model (activation_memory_budget set process-wide before any compile).

    NOTE [compiled peaks]
    The live-tensor tracker is a TorchDispatchMode; Dynamo refuses to run compiled code
    under one ("non-infra torch dispatch mode present, this is not supported today in
    torch.compile", torch/_dynamo/convert_frame.py) and runs the frame eagerly, so the
    tracker reports the *eager* step's peak. Worse, once skipped the frame stayed eager for
    the rest of the process here (the profiler then also showed the eager peak). So this
    arm never runs under the tracker: its peak is torch.profiler's running sum of CPU
    allocator ``[memory]`` events over one warm step plus the step's starting state
    (parameters, buffers, optimizer state, counted as the tracker counts them), which
    agreed with the tracker on eager steps (remat.memory.reference). Capacity is not
    searched for it: the probes run under the tracker, and every new batch size recompiles.
    """

    def __init__(self, budget: float) -> None:
        super().__init__(f"compile-amb{budget:g}")
        self.compile_s: float | None = None

    def prepare(self, fresh: LoadedWorkload):  # noqa: ANN201
        fresh.workload.model = torch.compile(fresh.workload.model)
        return None

    def measure_peak(self, step: TrainingStep, step_index: int) -> PeakMeasurement:
        return PeakMeasurement(profiler_step_peak(step, step_index), MemorySource.CPU_LIVE_TENSORS, None)


# -- one workload -----------------------------------------------------------------------------

@dataclasses.dataclass
class ArmResult:
    label: str
    kind: str                               # control | remat-optimal | baseline
    peak_bytes: int | None = None
    peak_source: str = ""
    step_ms: list[float] = dataclasses.field(default_factory=list)
    p50_ms: float | None = None
    p95_ms: float | None = None
    overhead_pct: float | None = None
    capacity: dict[str, int | None] = dataclasses.field(default_factory=dict)  # budget label -> batch
    capacity_resolved: dict[str, bool] = dataclasses.field(default_factory=dict)  # False: a lower bound
    capacity_note: str = ""
    skipped: str = ""                        # why this arm has no figures
    boundaries: list[str] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _top_container(report) -> tuple[str, int]:  # noqa: ANN001
    """The container of the most numbered top-level candidates (cnn's ``blocks``, not its ``stem``)."""
    names = {c.name for c in report.candidates}
    top = [c.name for c in report.candidates if c.parent is None or c.parent not in names]
    groups: dict[str, int] = {}
    for n in top:
        parent, _, last = n.rpartition(".")
        if last.isdigit():
            groups[parent] = groups.get(parent, 0) + 1
    if not groups:
        raise RuntimeError(f"top-level candidates {top} are not the numbered children of a container")
    parent = max(groups, key=lambda p: groups[p])
    return parent, groups[parent]


# NOTE [selective on guarded blocks]
# With this torch and remat.apply as of this run, a SELECTIVE (SAC) boundary on a block
# whose BatchNorm buffers remat guards fails at the first backward: "aten.clone.default
# encountered during backward but not found in storage" (the guard snapshots the buffers
# with clone() when the replay starts, an op SAC's recompute mode did not see in the
# forward). When the unrestricted optimal plan hits that, the benchmark re-plans with
# SELECTIVE removed from those candidates (FULL stays allowed) and says so in the results.
def _without_guarded_selective(report):  # noqa: ANN001, ANN202
    import copy

    from remat.types import CheckpointMode, HazardKind
    out = copy.deepcopy(report)
    for c in out.candidates:
        if any(h.kind is HazardKind.BUFFER_MUTATION for h in c.hazards):
            for table in (c.saved_bytes, c.replay_ms, c.replay_extra_bytes):
                table.pop(CheckpointMode.SELECTIVE, None)
    return out


def run_workload(spec: str, shape: dict, *, budgets: list[int], steps: int, warmup: int, compile_: bool,
                 compile_budget: float, cap_tries: int, cap_max_factor: int, log,  # noqa: ANN001
                 capacity: bool = True, seq_all: bool = False) -> dict:
    t_start = time.perf_counter()
    loaded = load_workload(ZOO_SPECS.get(spec, spec), shape)
    log(f"[{spec}] profiling {shape}")
    report = profile_workload(loaded)
    control_peak = report.baseline_peak_bytes
    container, n_blocks = _top_container(report)
    results: dict[str, ArmResult] = {}
    arms: list[Arm] = []

    def add(arm: Arm, kind: str, **kw: Any) -> None:
        arms.append(arm)
        results[arm.label] = ArmResult(label=arm.label, kind=kind, **kw)

    def plan_info(plan) -> dict:  # noqa: ANN001 - the cost model's view, to explain a loss
        return {"boundaries": [f"{b.module}:{b.mode.value}" for b in plan.boundaries],
                "extra": {"predicted_peak_bytes": plan.predicted_peak_bytes,
                          "predicted_overhead_ms": round(plan.predicted_overhead_ms, 2)}}

    for spec_ in ("none", "all", "uniform:2", "sqrt"):
        plan = make_plan(report, spec_)
        add(PlanArm(spec_, plan), "control" if spec_ == "none" else "baseline", **plan_info(plan))
    plan = make_plan(report, "selective")
    add(PlanArm("sac-matmuls", plan), "baseline", **plan_info(plan))
    plan = make_plan(report, "floor")   # remat's lowest predicted peak: at or below every baseline's? (issue 14)
    add(PlanArm("remat floor", plan), "remat-floor", **plan_info(plan))
    for pct in budgets:   # "checkpoint the first k blocks", the best k for each budget (issue 14)
        try:
            plan = make_plan(report, "first-k", budget_bytes=int(control_peak * pct / 100), reserve=0.0)
        except InfeasibleBudget:
            continue
        label = f"first-k@{pct}%"
        if any(r.boundaries == plan_info(plan)["boundaries"] for r in results.values() if r.label.startswith("first-k")):
            continue   # the same k as a larger budget's
        add(PlanArm(label, plan), "baseline", **plan_info(plan))
    for s in (range(2, n_blocks + 1) if seq_all else sorted({2, math.ceil(math.sqrt(n_blocks)), n_blocks})):
        add(SequentialArm(container, s), "baseline")
    if compile_:
        add(CompileArm(compile_budget), "baseline")
    else:
        results[f"compile-amb{compile_budget:g}"] = ArmResult(label=f"compile-amb{compile_budget:g}", kind="baseline",
                                                               skipped="not run (--quick or --no-compile)")
    for pct in budgets:
        label = f"remat optimal@{pct}%"
        b = int(control_peak * pct / 100)
        workaround = ""
        try:
            try:
                res = plan_closed_loop(loaded, report, "optimal", budget_bytes=b, reserve=0.0, steps=1)
            except InfeasibleBudget:
                raise
            except Exception as exc:  # noqa: BLE001 - see NOTE [selective on guarded blocks]
                workaround = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                log(f"[{spec}]   {label} failed ({workaround}); re-planning without SAC on guarded blocks")
                res = plan_closed_loop(loaded, _without_guarded_selective(report), "optimal", budget_bytes=b,
                                       reserve=0.0, steps=1)
        except InfeasibleBudget as exc:
            results[label] = ArmResult(label=label, kind="remat-optimal",
                                       skipped=f"infeasible: floor {exc.floor_bytes / MIB:.2f} MiB "
                                               f"({exc.floor_bytes / control_peak:.0%} of the control)")
            continue
        info = plan_info(res.plan)
        info["extra"]["closed_loop_tries"] = len(res.attempts)
        if workaround:
            info["extra"]["workaround"] = ("planned without SELECTIVE on BatchNorm (guarded) blocks: the unrestricted "
                                           f"optimal plan's step raised {workaround}")
        add(PlanArm(label, res.plan), "remat-optimal", **info)

    # peaks, one arm at a time
    live: list[Arm] = []
    for arm in arms:
        log(f"[{spec}] peak of {arm.label}")
        t0 = time.perf_counter()
        try:
            peak = measure_arm_peak(loaded, arm, warmup=warmup)
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            results[arm.label].skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            log(f"[{spec}]   skipped: {results[arm.label].skipped}")
            continue
        results[arm.label].peak_bytes = peak.peak_bytes
        results[arm.label].peak_source = ("torch.profiler allocator events" if isinstance(arm, CompileArm)
                                          else peak.source.value)
        if isinstance(arm, CompileArm):
            results[arm.label].extra["first_build_s"] = round(time.perf_counter() - t0, 1)
        live.append(arm)

    # time, interleaved
    log(f"[{spec}] timing {len(live)} arms x {steps} steps, interleaved")
    prepared = [prepare_arm(loaded, a) for a in live]
    try:
        timings = time_round_robin(prepared, warmup=warmup, steps=steps,
                                   progress=lambda w, d, t: log(f"[{spec}]   round {d}/{t}") if d in (0, t) else None)
    finally:
        for p in prepared:
            p.close()
        prepared.clear()
        release_memory()
    ctrl = timings.p50("none")
    for a in live:
        r = results[a.label]
        r.step_ms = [round(x, 3) for x in timings.step_ms[a.label]]
        r.p50_ms = timings.p50(a.label)
        r.p95_ms = timings.p95(a.label)
        r.overhead_pct = (r.p50_ms - ctrl) / ctrl * 100

    # capacity per budget: probes memoised per arm at the largest budget, reused for the smaller ones
    start = int(shape.get("batch_size") or 8)
    limits = {f"{p}%": int(control_peak * p / 100) for p in budgets}
    top_limit = max(limits.values())
    for a in (live if capacity else []):
        r = results[a.label]
        if isinstance(a, CompileArm):
            r.capacity_note = "not searched: see NOTE [compiled peaks] (tracker probes; recompiles per shape)"
            continue
        log(f"[{spec}] capacity of {a.label}")
        cache: dict[int, CapacityTry] = {start: CapacityTry(value=start, peak_bytes=r.peak_bytes)}

        def measure(v: int, a: Arm = a, cache: dict = cache) -> CapacityTry:
            # probed against the largest budget: a probe aborted there is over every smaller one too,
            # and one that finished carries its full peak, which each search compares with its own limit
            if v not in cache:
                cache[v] = capacity_try(loaded, a, "batch_size", v, top_limit)
            return cache[v]

        notes = []
        for name, lim in limits.items():
            res = search_capacity(measure, key="batch_size", start=start, limit_bytes=lim,
                                  max_value=cap_max_factor * start, max_tries=cap_tries,
                                  granularity=max(1, start // 16))
            r.capacity[name] = res.capacity
            r.capacity_resolved[name] = res.resolved
            if not res.resolved:
                notes.append(f"{name}: {res.note}")
        r.capacity_note = "; ".join(notes)
        r.extra["capacity_probes"] = {v: (t.peak_bytes, t.oom) for v, t in sorted(cache.items())}

    summary = summarise(results, budgets=budgets, control_peak=control_peak)
    profile = {"baseline_step_ms": report.baseline_step_ms, "excluded": report.excluded,
               "candidates": [{"name": c.name, "fwd_ms": round(c.fwd_ms, 2),
                               "saved_bytes": {m.value: v for m, v in c.saved_bytes.items()},
                               "replay_ms": {m.value: round(v, 2) for m, v in c.replay_ms.items()}}
                              for c in report.candidates]}
    return {"workload": spec, "shape": shape, "control_peak_bytes": control_peak, "profile": profile,
            "control_p50_ms": ctrl, "n_blocks": n_blocks, "container": container,
            "budgets": {f"{p}%": int(control_peak * p / 100) for p in budgets},
            "arms": [dataclasses.asdict(r) for r in results.values()], "summary": summary,
            "wall_s": round(time.perf_counter() - t_start, 1)}


def summarise(results: dict[str, ArmResult], *, budgets: list[int], control_peak: int) -> list[dict]:
    out = []
    for pct in budgets:
        name = f"{pct}%"
        limit = int(control_peak * pct / 100)
        remat = results.get(f"remat optimal@{pct}%")
        fits = [r for r in results.values() if r.kind == "baseline" and r.peak_bytes is not None
                and r.p50_ms is not None and r.peak_bytes <= limit]
        best = min(fits, key=lambda r: r.p50_ms, default=None)
        row: dict[str, Any] = {"budget": name, "budget_bytes": limit,
                               "fitting_baselines": [r.label for r in sorted(fits, key=lambda r: r.p50_ms)]}
        if remat is None or remat.p50_ms is None:
            row["remat"] = None if remat is None else remat.skipped
            out.append(row)
            continue
        row.update({"remat_peak_bytes": remat.peak_bytes, "remat_fits": remat.peak_bytes <= limit,
                    "remat_overhead_pct": remat.overhead_pct, "remat_p50_ms": remat.p50_ms,
                    "remat_capacity": remat.capacity.get(name)})
        if best is not None:
            row.update({"best_baseline": best.label, "best_overhead_pct": best.overhead_pct,
                        "best_p50_ms": best.p50_ms,
                        "p50_ratio": remat.p50_ms / best.p50_ms,
                        "overhead_ratio": (remat.overhead_pct / best.overhead_pct
                                           if best.overhead_pct and best.overhead_pct > 0 else None)})
        row["capacity_vs"] = {r.label: r.capacity.get(name) for r in results.values()
                              if r.kind != "remat-optimal" and r.capacity}
        out.append(row)
    return out


# -- markdown ---------------------------------------------------------------------------------------

def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def render_markdown(data: dict) -> str:
    m = data["machine"]
    lines = [SECTION, "",
             f"Measured {m['date']} on `{m['host']}`: {m['nproc']} CPU cores (`nproc`), torch {m['torch']}, "
             f"python {m['python']}, `torch.set_num_threads({m['threads']})`, {m['platform']}.",
             "",
             "Command (one run, all workloads, every arm interleaved round-robin per workload):",
             "", "```", data["command"], "```", "",
             "**The machine was shared and noisy**: 2 cores used by several people at once (load average "
             f"{m['load_before']} before the run, {m['load_after']} after). Absolute milliseconds are not "
             "reproducible here; what is comparable is each arm against the control and against each other "
             "*within one workload*, because all arms of a workload ran interleaved (one step of each per round, "
             "rotated order), so drift hit them alike. Figures are medians (p50) and p95 of "
             f"{data['steps']} warm whole steps per arm (batch, forward, backward, AdamW/SGD step) after "
             f"{data['warmup']} warm-up rounds; peaks are one warm step with the arm alone "
             "(on CPU remat's allocator counter, or the live-tensor tracker where it cannot be built: "
             "measure_step_peak; the compiled arm: torch.profiler allocator events, see below).",
             "",
             "Budgets are shares of the control's profiled peak (70% and 55% by default, not 50%: at these "
             "shapes remat's predicted floor is 47-50% of the control, so at 50% only `all`-like plans fit and "
             "there is nothing left to choose). A baseline *fits* a budget when its measured "
             "peak is at most the budget (no reserve, for everyone). remat's `optimal@B` was planned for "
             "exactly that (reserve 0, closed loop). *ratio* = remat's p50 / the fastest fitting baseline's p50 "
             "(< 1: remat is faster); *ovh ratio* = the same with overheads over the control (p50 - control p50), "
             "given when the baseline's overhead is positive. Capacity = largest `batch_size` whose measured peak "
             "fits the budget (doubling then bisection to within 1/16 of the base batch, at most "
             f"{data['cap_tries']} probes, up to {data['cap_max_factor']}x the base batch; `>=N`: the probes ran "
             "out first, N fits).",
             ""]
    for w in data["workloads"]:
        if "error" in w:
            lines += [f"### {w['workload']}", "", f"failed: `{w['error']}`", ""]
            continue
        cp = w["control_peak_bytes"]
        lines += [f"### {w['workload']} `{json.dumps(w['shape'])}`", "",
                  f"{w['n_blocks']} blocks in `{w['container']}`; control peak {cp / MIB:.1f} MiB, "
                  f"control p50 {w['control_p50_ms']:.0f} ms; wall time of this workload {w['wall_s']:.0f} s.", ""]
        bud = list(w["budgets"])
        head = "| arm | peak MiB | % ctrl | p50 ms | p95 ms | overhead | " + " | ".join(
            f"fits {b}" for b in bud) + " | " + " | ".join(f"cap@{b}" for b in bud) + " |"
        lines += [head, "|" + "---|" * (6 + 2 * len(bud))]
        for a in w["arms"]:
            if a["skipped"] or a["p50_ms"] is None:
                lines.append(f"| {a['label']} | skipped: {a['skipped']} |" + " |" * (5 + 2 * len(bud)))
                continue
            fits = ["yes" if a["peak_bytes"] <= w["budgets"][b] else "no" for b in bud]
            caps = [(("" if a["capacity_resolved"].get(b, True) else ">=") + str(a["capacity"].get(b, "-")))
                    if a["capacity"] else "n/a" for b in bud]
            name = f"**{a['label']}**" if a["kind"] == "remat-optimal" else a["label"]
            lines.append(f"| {name} | {a['peak_bytes'] / MIB:.1f} | {a['peak_bytes'] / cp:.0%} | {a['p50_ms']:.0f} | "
                         f"{a['p95_ms']:.0f} | {a['overhead_pct']:+.1f}% | " + " | ".join(fits) + " | "
                         + " | ".join(caps) + " |")
        arms_by = {a["label"]: a for a in w["arms"]}
        lines += ["", "| budget | remat optimal: ovh, p50 | fastest fitting baseline: ovh, p50 | ratio | ovh ratio | "
                  "p50 difference, 95% CI (resolved?) | remat predicted/measured step | remat capacity vs baselines' |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in w["summary"]:
            if s.get("remat_p50_ms") is None:
                lines.append(f"| {s['budget']} | {s.get('remat') or 'no plan'} | | | | |")
                continue
            best = (f"{s['best_baseline']}: {s['best_overhead_pct']:+.1f}%, {s['best_p50_ms']:.0f} ms"
                    if s.get("best_baseline") else "none fits")
            caps = ", ".join(f"{k} {v}" for k, v in s["capacity_vs"].items() if v is not None)
            ra = arms_by[f"remat optimal@{s['budget']}"]
            diff = "-"
            if s.get("best_baseline") and ra["step_ms"] and arms_by[s["best_baseline"]]["step_ms"]:
                d = p50_difference(ra["step_ms"], arms_by[s["best_baseline"]]["step_ms"])
                diff = (f"{d.diff_ms:+.0f} ms [{d.low_ms:+.0f}, {d.high_ms:+.0f}] "
                        f"({'resolved' if d.resolved else unresolved_why(d.low_ms, d.high_ms, d.samples)})")
            pred = ra["extra"].get("predicted_overhead_ms")
            pm = "-" if pred is None else f"{(w['control_p50_ms'] + pred) / ra['p50_ms']:.2f}"
            lines.append(f"| {s['budget']} | {s['remat_overhead_pct']:+.1f}%, {s['remat_p50_ms']:.0f} ms"
                         f"{'' if s['remat_fits'] else ' (MISSES the budget)'} | {best} | "
                         f"{_f(s.get('p50_ratio'), '{:.2f}')} | {_f(s.get('overhead_ratio'), '{:.2f}')} | {diff} | {pm} | "
                         + ("not searched |" if s["remat_capacity"] is None else f"{s['remat_capacity']} vs {caps} |"))
        by = {a["label"]: a for a in w["arms"]}
        ctrl_ms = w["control_p50_ms"]
        verdicts = []
        for s in w["summary"]:
            if s.get("remat_p50_ms") is None or not s.get("best_baseline"):
                continue
            r, b = by[f"remat optimal@{s['budget']}"], by[s["best_baseline"]]
            won = s["p50_ratio"] < 1.0
            line = (f"- {s['budget']}: remat optimal {'beats' if won else 'does NOT beat'} the fastest fitting "
                    f"baseline {b['label']} (p50 ratio {s['p50_ratio']:.2f}; measured overhead "
                    f"{r['p50_ms'] - ctrl_ms:+.0f} ms vs {b['p50_ms'] - ctrl_ms:+.0f} ms")
            pr, pb = r["extra"].get("predicted_overhead_ms"), b.get("extra", {}).get("predicted_overhead_ms")
            if pr is not None:
                line += f"; cost model predicted {pr:+.0f} ms for remat"
                line += f" and {pb:+.0f} ms for {b['label']}" if pb is not None else \
                    f", and cannot express {b['label']}"
            verdicts.append(line + ").")
        if verdicts:
            lines += [""] + verdicts
        notes = [f"- {a['label']}: capacity {a['capacity_note']}" for a in w["arms"]
                 if a.get("capacity_note") and not a["capacity"]]
        notes += [f"- {a['label']}: {a['extra']['workaround']}." for a in w["arms"] if a.get("extra", {}).get("workaround")]
        comp = next((a for a in w["arms"] if a["label"].startswith("compile")), None)
        if comp and comp.get("extra", {}).get("first_build_s") is not None:
            notes.append(f"- {comp['label']}: first build + compile + warm-up + measured step took "
                         f"{comp['extra']['first_build_s']} s (FX/AOT caches on disk may have been warm).")
        if notes:
            lines += [""] + notes
        lines.append("")
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace (or append) our section of RESULTS.md; every other section is kept as it is."""
    text = path.read_text() if path.exists() else "# remat benchmarks\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip() + "\n\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    from remat._io import atomic_write_text
    atomic_write_text(path, text)


def check_compile_tracker(log) -> dict:  # noqa: ANN001
    """Does the live-tensor tracker see compiled-graph allocations? (NOTE [compiled peaks])

    mlp at batch 1024, width 256, depth 4: eager peak (tracker, profiler), then the compiled
    step's peak by the profiler, by the tracker, and by the profiler again after the tracker.
    """
    from remat.memory import measure_step_peak

    prof = profiler_step_peak

    shape = {"batch_size": 1024, "width": 256, "depth": 4}
    out: dict[str, float] = {}
    eager = TrainingStep(load_workload("mlp", shape).workload)
    eager.run(0), eager.run(1)
    out["eager_profiler_mib"] = prof(eager, 2) / MIB
    out["eager_tracker_mib"] = measure_step_peak(eager, 3).peak_bytes / MIB
    lw = load_workload("mlp", shape)
    lw.workload.model = torch.compile(lw.workload.model)
    step = TrainingStep(lw.workload)
    t0 = time.perf_counter()
    step.run(0)
    out["compile_s"] = time.perf_counter() - t0
    step.run(1)
    out["compiled_profiler_mib"] = prof(step, 2) / MIB
    out["compiled_tracker_mib"] = measure_step_peak(step, 3).peak_bytes / MIB
    out["compiled_profiler_after_tracker_mib"] = prof(step, 4) / MIB
    for k, v in out.items():
        log(f"check-tracker: {k} = {v:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, 10 steps, no torch.compile")
    ap.add_argument("--workloads", default="gpt,mlp,cnn")
    ap.add_argument("--budgets", default="70,55", help="budgets, %% of the control's peak (default 70,55)")
    ap.add_argument("--steps", type=int, default=10, help="timed warm steps per arm (default 10)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: a shared machine)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile", action="store_true", help="run torch.compile even with --quick")
    ap.add_argument("--compile-budget", type=float, default=0.5)
    ap.add_argument("--cap-tries", type=int, default=6)
    ap.add_argument("--no-capacity", action="store_true", help="skip the batch-capacity search")
    ap.add_argument("--seq-all", action="store_true", help="checkpoint_sequential:K for every K in 2..n blocks")
    ap.add_argument("--cap-max-factor", type=int, default=8)
    ap.add_argument("--json", type=Path, default=HERE / "results" / "compare.json")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--no-write", action="store_true", help="print the Markdown, do not touch RESULTS.md")
    ap.add_argument("--check-tracker", action="store_true",
                    help="only check whether the CPU tracker sees torch.compile'd allocations, then exit")
    ap.add_argument("--render-from", type=Path, default=None,
                    help="measure nothing: render the Markdown from a compare.json written earlier")
    args = ap.parse_args(argv)
    if args.render_from is not None:
        md = render_markdown(json.loads(args.render_from.read_text()))
        print(md)
        if not args.no_write:
            write_section(args.results, md)
        return 0
    torch.set_num_threads(args.threads)
    # process-wide, before any compile: only compiled graphs read it, eager arms are unaffected
    import torch._functorch.config as functorch_config
    functorch_config.activation_memory_budget = args.compile_budget
    if args.check_tracker:
        check_compile_tracker(lambda m: print(m, file=sys.stderr, flush=True))
        return 0
    shapes = QUICK if args.quick else FULL
    compile_ = (not args.quick or args.compile) and not args.no_compile
    budgets = [int(b) for b in args.budgets.split(",")]

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    data: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", "benchmarks/compare.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "host": platform.node(), "nproc": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version(), "threads": torch.get_num_threads(),
                    "platform": platform.platform(terse=True), "load_before": _load()},
        "steps": args.steps, "warmup": args.warmup, "cap_tries": args.cap_tries,
        "cap_max_factor": args.cap_max_factor, "workloads": []}
    for spec in args.workloads.split(","):
        try:
            w = run_workload(spec, shapes[spec], budgets=budgets, steps=args.steps, warmup=args.warmup,
                             compile_=compile_, compile_budget=args.compile_budget, cap_tries=args.cap_tries,
                             cap_max_factor=args.cap_max_factor, log=log, capacity=not args.no_capacity,
                             seq_all=args.seq_all)
        except Exception as exc:  # noqa: BLE001 - keep the other workloads' results
            traceback.print_exc()
            w = {"workload": spec, "error": f"{type(exc).__name__}: {exc}"}
        data["workloads"].append(w)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1, default=str))
    data["machine"]["load_after"] = _load()
    args.json.write_text(json.dumps(data, indent=1, default=str))
    md = render_markdown(data)
    print(md)
    if not args.no_write:
        write_section(args.results, md)
        log(f"wrote {args.results} ({SECTION!r}) and {args.json}")
    return 0


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
