"""``make_receipt``: the whole run, trace -> profile -> plan -> frontier -> verify, as one receipt.

It is the workflow stage of docs/DESIGN.md (just below the CLI): it calls every stage and
assembles their results into remat.receipt's model, which only holds, validates and renders them.

NOTE [receipt run]
1. Trace the unmodified step at the target shape and, when given, the boundary shape.
2. Profile the candidates once, over the step sample (``settings.sample_steps`` steps per shape,
   the boundary shape's steps joining: NOTE [step sample]); every later stage reuses this profile.
3. Plan with the optimal planner through the closed loop (apply, measure, re-plan), so
   the receipt records predicted *and* measured peaks of the plan most likely to ship; its
   measured peak is the max over the sample.
4. Frontier: every plan in ``settings.frontier_plans`` (the control always) measured
   solo for its peak and interleaved for time; the frontier's ship decision picks the
   fastest plan whose measured peak clears budget x (1 - reserve). The shipped plan is then
   measured over the sample too; if its max misses, the decision picks again (NOTE [ship over
   the sample]); when no plan holds, nothing ships, and the receipt says why.
5. Verify the plan the frontier ships (paired seeded runs, hazards, negative controls).
   Verification runs after the frontier so that the plan proved is the plan shipped,
   whichever planner made it.
6. Trace the shipped plan's step (the "plan" curve of the timeline) and measure each
   boundary's saving (NOTE [measured saving]).

NOTE [blocked receipt]
``remat receipt --device-memory 2GiB`` makes the receipt of a step that may not fit the device
(``budget`` optional: the capacity is the default). On the CPU every step runs under the
capacity, enforced (NOTE [CPU device capacity]). When the unplanned step at the target does not
fit, the receipt holds two shapes:
- the **target** (``batch_size`` = B): the refusal is the evidence (the plan's ``blocked``,
  NOTE [blocked step]); the profile is read from smaller batches; the closed loop, the frontier
  (the control a failed point), the sample maxima and the shipped plan's trace are measured at B,
  under the capacity;
- the **verified batch** k2, the largest at which the control fits: equivalence (the fixture and
  its negative controls), the control's phase trace and held bytes, and each boundary's measured
  saving, since each needs the control to run.
``remat check`` re-runs both under the gate's device memory (NOTE [gate thresholds]): the fixture
and the savings at k2, the plan's peak at B (a refusal fails), and the unplanned step at B, which
must still be refused (a step that now fits is said: the plan still holds). The overhead against
the control is not re-measured (there is no control at B), and the receipt says so.

NOTE [measured saving]
A boundary's *measured saving* is read at the turn from forward to backward, where every
activation the step keeps is alive: live bytes of the unmodified step there, minus live
bytes with only that boundary checkpointed (fresh build, ``saving_warmup`` warm steps,
one measured step; CPU live-tensor tracker or ``torch.cuda.memory_allocated``). It is the
bytes checkpointing that one module frees until its backward, net of the inputs the
checkpoint keeps, measured rather than predicted. ``remat check`` measures it again and
fails when it fell by more than ``saving_tolerance`` (default 10%).

NOTE [compiled receipts]
``remat receipt --compile`` (``settings.compile``): the frontier measures every plan eager and
compiled, plus torch's activation_memory_budget aimed at the budget (NOTE [budget aimed at a
peak]), and ships the cheapest that fits. A shipped compiled plan carries its CompileSpec
(``plan.compile``), so verification runs compiled against the compiled control (NOTE [verify
under compile]) and ``remat check`` re-runs it compiled; a shipped torch-budget point (the
unplanned model at another ratio) is verified too, since its graph differs from the control's.
The phase traces and per-boundary savings are eager measurements (the live-tensor tracker
would run compiled code eagerly); the shipped peak is the compiled one, by the instrument its
frontier point names.

NOTE [receipt decision]
The receipt does not decide on its own: the one ship decision, ``ship_decision`` in
frontier/pareto.py (NOTE [ship decision]), pure, is given the frontier's measured points, the
max over the step sample of each plan measured there (NOTE [ship over the sample]) and the
verification of the plan it picks; the receipt renders what it returns. Every point keeps the
decision's verdict and reason, and the budget, reserve and effective budget are the frontier's.
The verification is the one input the frontier does not have: a picked plan that was verified
(boundaries, or a torch budget) and failed ships nothing and is listed first as UNVERIFIED
with the failure. The control ships when it fits (nothing to checkpoint). ``clears`` compares
the shipped plan's measured peak with budget x (1 - reserve).

NOTE [re-plan after verify]
Verification can find a boundary hazardous that the profile let through (a replay side
effect its inventory does not snapshot). Shipping that plan UNVERIFIED leaves the user with
nothing; so the receipt excludes every boundary the failure implicates (a hazard in its
replay, a divergence under it), and every candidate that contains one (a parent, a segment
with it as a member), and runs steps 3-5 again on the same profile. At most
``MAX_VERIFY_ROUNDS`` (3) rounds: each re-runs the closed loop, the frontier and verification
(minutes on a real model), and a hazard found in block after block is a pattern the blocks
share (a hook, a global), which another round would only find again; past the bound, or
when verification fails without implicating a boundary, the last plan is listed UNVERIFIED.
The exclusions and their reasons are recorded (``plan.excluded_after_verify``)
and stated in the decision; when no plan reaches the budget without them, nothing ships
and the decision says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..wrap import PlanArm, boundary_members, boundary_module
from ..closed_loop import ClosedLoopResult, measure_sample_peaks, plan_for_device
from ..errors import BudgetError, DeviceTooSmall, WorkloadError
from ..frontier import FrontierPoint, FrontierReport, FrontierSettings, run_frontier
from ..frontier.pareto import SamplePeak, ShipDecision, Verdict, ship_decision
from ..measure import CompileSpec, held_bytes_at_phase, prepare_arm, shape_value
from ..memory.capacity import step_capacity
from ..plan import InfeasibleBudget, Plan, budget_on_device, check_budget_syntax
from ..profile import ProfileReport, module_revision
from ..profile.blocked import BATCH_KEY, profile_on_device
from ..profile.model import BlockedStep, StepSample
from ..profile.sample import sample_workloads
from ..trace import StepTrace, TraceContext, trace_step, trace_workload
from ..types import MemorySource, Phase, ProgressFn, no_progress
from ..verify import VerifyReport, tolerance_table, verify_plan
from ..verify.model import RunMode
from ..receipt.model import (BoundaryRecord, Coverage, Fixture, Receipt, ReceiptContext, ReceiptDecision, ReceiptPlan,
                             ReceiptTraces, RejectedPlan, Rejection, RunSettings, ShipStatus, UnsupportedMode)
from ..units import mib
from ..workload import LoadedWorkload, shape_text

FIXTURE_NAME = "paired-step"   # remat.verify.verify_plan: seeded control vs planned, train + eval



# -- measurements ----------------------------------------------------------------------------------

def _eager(plan: Plan | None) -> Plan | None:
    """The plan run eagerly: held bytes and phase traces need the live-tensor tracker (NOTE [compiled receipts])."""
    return plan if plan is None or plan.compile is None else dataclasses.replace(plan, compile=None)


def held_bytes_at_backward(loaded: LoadedWorkload, plan: Plan | None, *, warmup: int = 1) -> int:
    """Live bytes when backward starts, on a fresh build with ``plan`` applied, eagerly (NOTE [measured saving])."""
    return held_bytes_at_phase(loaded, PlanArm("plan", _eager(plan)), Phase.BACKWARD, warmup=warmup)


def measure_savings(loaded: LoadedWorkload, plan: Plan, *, warmup: int = 1,
                    progress: ProgressFn = no_progress) -> tuple[int, dict[str, int]]:
    """(control's held bytes, {boundary: bytes saved by checkpointing it alone}) (NOTE [measured saving])."""
    total = len(plan.boundaries) + 1
    progress("savings", 0, total)
    control = held_bytes_at_backward(loaded, None, warmup=warmup)
    out: dict[str, int] = {}
    for i, b in enumerate(plan.boundaries):
        progress("savings", i + 1, total)
        alone = dataclasses.replace(plan, boundaries=[b])
        out[b.module] = control - held_bytes_at_backward(loaded, alone, warmup=warmup)
    progress("savings", total, total)
    return control, out


def trace_planned(loaded: LoadedWorkload, plan: Plan, *, warmup: int, steps: int,
                  progress: ProgressFn = no_progress) -> StepTrace:
    """Phase trace of the step with ``plan`` applied to a fresh build (the timeline's "plan" curve)."""
    prepared = prepare_arm(loaded, PlanArm("plan", _eager(plan)))
    try:
        fresh = prepared.loaded
        ctx = TraceContext.capture(workload=fresh.spec, shape=fresh.shape, dtype=fresh.dtype, device=fresh.device,
                                   warmup=warmup, steps=steps)
        return trace_step(prepared.step, context=ctx, warmup=warmup, steps=steps, progress=progress)
    finally:
        prepared.close()


# -- per boundary ----------------------------------------------------------------------------------

def _fixture_passed(module: str, plan: Plan, verification: VerifyReport | None) -> bool | None:
    """Did verification pass for this boundary? (None: not run). A failure exonerates a boundary
    only when it is attributed to others."""
    if verification is None:
        return None
    if verification.passed:
        return True
    blamed = [x.module for x in plan.boundaries if verification.implicates(x.module)]
    return bool(blamed) and module not in blamed


def _fixture(loaded: LoadedWorkload, module: str, params: tuple[str, ...], plan: Plan,
             verification: VerifyReport | None, settings: RunSettings) -> Fixture:
    """The paired-step fixture covering one boundary, as ``remat check`` re-runs it."""
    table = tolerance_table(compiled=verification is not None and verification.compile is not None,
                            autocast=loaded.autocast)
    act = None if verification is None else next((a for a in verification.boundaries if a.module == module), None)
    rejected = () if verification is None else \
        tuple(n.name for n in verification.negative_controls if n.applicable and n.rejected)
    return Fixture(
        name=FIXTURE_NAME, seeds=tuple(range(settings.verify_seeds)), steps=settings.verify_steps,
        modes=(RunMode.TRAIN, RunMode.EVAL), dtype=loaded.dtype, tolerance=table.get(loaded.dtype, table["float32"]),
        parameters=params, passed=_fixture_passed(module, plan, verification),
        forward_calls_per_step=None if act is None else act.forward_calls.get("train"),
        replay_calls_per_step=None if act is None else act.replay_calls.get("train"),
        draws_rng=None if act is None else act.draws_rng, negative_controls=rejected)


def _boundary_records(loaded: LoadedWorkload, plan: Plan, report: ProfileReport, verification: VerifyReport | None,
                      savings: dict[str, int], settings: RunSettings) -> list[BoundaryRecord]:
    model = loaded.workload.model
    costs = {c.name: c for c in report.candidates}
    out = []
    for b in plan.boundaries:
        module = boundary_module(model, b.module)     # a segment: its members (NOTE [segments])
        params = tuple(f"{p}.{n}" for p, m in boundary_members(model, b.module) for n, _ in m.named_parameters())
        cost = costs.get(b.module)
        out.append(BoundaryRecord(
            module=b.module, class_name=cost.class_name if cost and cost.members else type(module).__qualname__,
            mode=b.mode, guarded=b.guarded, revision=module_revision(module),
            predicted_saving_bytes=b.saved_bytes, measured_saving_bytes=savings[b.module],
            saving_tolerance=settings.saving_tolerance,
            replay_ms=float(cost.replay_ms.get(b.mode, b.replay_ms)) if cost else float(b.replay_ms),
            fixture=_fixture(loaded, b.module, params, plan, verification, settings)))
    return out


# -- decision --------------------------------------------------------------------------------------

def _describe(plan: Plan | None) -> list[str]:
    return [] if plan is None else [f"{b.module}:{b.mode.value}" for b in plan.boundaries]


def _rejected(point: FrontierPoint) -> RejectedPlan:
    """A point the frontier did not ship, with the frontier's own decision and reason."""
    return RejectedPlan(plan=point.plan, decision=Rejection(point.decision.value), reason=point.reason,
                        peak_bytes=point.peak_bytes, p50_ms=point.p50_ms)


def _rejected_plans(frontier: FrontierReport, decision: ShipDecision) -> list[RejectedPlan]:
    """Every point that does not ship, with the frontier's decision and reason; a picked plan that
    failed verification first, as UNVERIFIED (NOTE [receipt decision])."""
    rejected = [_rejected(p) for p in frontier.points if p.plan != decision.picked]
    if decision.unverified is None or decision.picked is None:
        return rejected
    picked = frontier.point(decision.picked)
    return [RejectedPlan(plan=picked.plan, decision=Rejection.UNVERIFIED, reason="fits, but " + decision.unverified,
                         peak_bytes=picked.peak_bytes, p50_ms=picked.p50_ms), *rejected]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Bar:
    """What the receipt's sentences compare against: the frontier's budget and its control (bytes, ms)."""

    budget_bytes: int
    reserve: float
    limit: int                    # budget x (1 - reserve)
    control_peak: int | None      # the control point's measured peak, else the target trace's (None: blocked)
    control_p50: float | None
    measured: int                 # frontier points measured
    fitting: int                  # of which fit
    blocked: BlockedStep | None   # the control does not fit the device at the target (NOTE [blocked receipt])

    @classmethod
    def of(cls, frontier: FrontierReport, trace: StepTrace, blocked: BlockedStep | None) -> "_Bar":
        control = next((p for p in frontier.points if p.plan == frontier.control), None)
        peak = control.peak_bytes if control is not None and control.peak_bytes is not None else \
            None if blocked is not None else trace.peak_bytes   # the trace is then at the verified batch
        return cls(budget_bytes=frontier.budget_bytes, reserve=frontier.reserve,
                   limit=frontier.effective_budget_bytes, control_peak=peak,
                   control_p50=None if control is None else control.p50_ms,
                   measured=sum(1 for p in frontier.points if p.measured),
                   fitting=sum(1 for p in frontier.points if p.fits), blocked=blocked)

    def control_words(self, trace: StepTrace) -> str:
        """What the unmodified step does at the target, as a sentence."""
        if self.blocked is not None:
            return f"Without checkpointing {self.blocked.describe()}."
        phase = f" in {trace.peak_phase.value}" if trace.peak_phase else ""
        return f"Without checkpointing the step peaks at {mib(self.control_peak)}{phase}, over the {self.text}."

    @property
    def text(self) -> str:
        return f"{mib(self.limit)} (budget {mib(self.budget_bytes)} less {self.reserve:.0%} reserve)"


def _why_torch_budget(shipped: FrontierPoint, plan: Plan, bar: _Bar, verification: VerifyReport | None) -> list[str]:
    """A shipped torch-budget point: the unplanned model compiled at the ratio that fits."""
    assert plan.compile is not None
    why = [f"Ship {shipped.plan}: no checkpoint boundaries; {plan.compile.describe()}, the largest ratio "
           f"tried whose measured compiled peak ({mib(shipped.peak_bytes)}, {shipped.memory_source}) clears {bar.text} "
           "(NOTE [budget aimed at a peak])."]
    if verification is not None:
        why.append(f"Verified against the compiled control (torch's default budget): "
                   f"{'passed' if verification.passed else 'failed'}.")
    return why


def _why_verified(verification: VerifyReport, where: str = "") -> str:
    seeds, steps = len(verification.seeds), verification.steps
    bitwise = all(s.bitwise for s in verification.per_step)
    negs = [n.name for n in verification.negative_controls if n.applicable and n.rejected]
    return (f"Verified against the seeded {'compiled ' if verification.compile else ''}control{where}: "
            f"{_n(seeds, 'seed')} x "
            f"{_n(steps, 'step')} + an eval step {'match bitwise' if bitwise else 'match within tolerance'}; "
            "no replay hazards" + (f"; negative controls rejected: {', '.join(negs)}." if negs else "."))


def _why_plan(shipped: FrontierPoint, plan: Plan, bar: _Bar, trace: StepTrace,
              verification: VerifyReport | None) -> list[str]:
    """A shipped plan with boundaries: which family won, the peak it clears by, its cost, its proof."""
    mods = ", ".join(f"{b.module} ({b.mode.value})" for b in plan.boundaries)
    spec = shipped.planner
    kind = "remat's own plan" if spec.is_remats_own else "a baseline"
    why = [f"Ship {shipped.plan}: checkpoint {mods}"
           + (f", run compiled ({plan.compile.describe()})" if plan.compile is not None else "")
           + f". The {spec.family} family won ({kind})."]
    peak = shipped.peak_bytes or 0
    if bar.control_peak is None or bar.control_peak > bar.limit:
        why.append(bar.control_words(trace))
    why.append(f"With this plan the measured peak is {mib(shipped.peak_bytes)}: it clears by "
               f"{mib(bar.limit - peak)} ({1 - peak / bar.budget_bytes:.0%} of the budget left free).")
    if shipped.p50_ms is not None and bar.control_p50:
        why.append(f"It costs {(shipped.p50_ms - bar.control_p50) / bar.control_p50:+.0%} step time (warm p50 "
                   f"{shipped.p50_ms:.1f} ms vs {bar.control_p50:.1f} ms), the least of the {bar.fitting} of "
                   f"{bar.measured} measured plans that clear.")
    elif bar.blocked is not None and shipped.p50_ms is not None:
        why.append(f"It unlocks batch {bar.blocked.target_batch} on this device: of the {bar.fitting} of "
                   f"{bar.measured} measured plans that fit, the fewest boundaries that no plan beats by a resolved "
                   f"step time (warm p50 {shipped.p50_ms:.1f} ms; NOTE [ship decision]); there is no control step "
                   "at this batch to compare with.")
    if verification is not None:
        where = "" if bar.blocked is None else \
            f" at batch {bar.blocked.verified_batch}, the largest at which the control fits"
        why.append(_why_verified(verification, where))
    return why


def _why_nothing(bar: _Bar, first_rejected: str | None, unverified: str | None, closed_loop_note: str) -> list[str]:
    if unverified is not None:
        first = f"Nothing ships: {first_rejected} fits but {unverified}."
    elif closed_loop_note:
        first = f"Nothing ships: {closed_loop_note}"
    else:
        first = f"Nothing ships: no measured plan's peak clears {bar.text}."
    return [first, f"The unmodified step peaks at {mib(bar.control_peak)}." if bar.blocked is None
            else f"The unmodified step: {bar.blocked.describe()}."]


def _why(shipped: FrontierPoint, plan: Plan | None, bar: _Bar, trace: StepTrace,
         verification: VerifyReport | None) -> list[str]:
    """The sentences for a point that ships and its ``plan`` (the frontier's shipped plan)."""
    assert plan is not None
    if plan.boundaries:
        return _why_plan(shipped, plan, bar, trace, verification)
    if plan.compile is not None and plan.compile.memory_budget is not None:
        return _why_torch_budget(shipped, plan, bar, verification)
    return [f"Ship no checkpointing: the unmodified step's peak {mib(bar.control_peak)} already clears {bar.text}."]


def shipped_why(frontier: FrontierReport, plan: Plan, trace: StepTrace, verification: VerifyReport | None,
                blocked: BlockedStep | None, excluded_after_verify: dict[str, str]) -> list[str]:
    """The first sentences of a shipping receipt's ``decision.why``, as :func:`_decide` writes them from the
    receipt's own frontier, plan, target trace and verification (``remat check`` regenerates and compares
    them: NOTE [receipt statements] in workflow/consistency.py); the re-plan line ends with a note the
    receipt does not keep, so only its start up to the reason is given."""
    assert frontier.shipped is not None
    why = _why(frontier.shipped, plan, _Bar.of(frontier, trace, blocked), trace, verification)
    return why + [line.rstrip(".") for line in _why_replanned(excluded_after_verify, "")]


def context_memory_source(device: str) -> MemorySource:
    """The instrument a receipt's context (and its traces) names for ``device``: the CUDA caching allocator, else
    the CPU live-tensor tracker."""
    return MemorySource.CUDA_ALLOCATOR if device.startswith("cuda") else MemorySource.CPU_LIVE_TENSORS


def _why_replanned(excluded: dict[str, str], replan_note: str) -> list[str]:
    """What the rounds of NOTE [re-plan after verify] excluded, and why."""
    if not excluded:
        return []
    names = ", ".join(excluded)
    first = next(iter(excluded.values()))
    return [f"Re-planned without {names}, which verification found hazardous ({first})"
            + (f"; {replan_note}." if replan_note else ".")]


def _decide(*, frontier: FrontierReport, decision: ShipDecision, plan: Plan | None, trace: StepTrace,
            verification: VerifyReport | None, closed_loop_note: str, blocked: BlockedStep | None = None,
            excluded_after_verify: dict[str, str] | None = None, replan_note: str = "") -> ReceiptDecision:
    """The receipt's decision, as ``decision`` made it (NOTE [receipt decision]), in the receipt's words.

    ``frontier``: the points as ``decision`` judged them; ``plan``: the shipped point's plan (or, when
    nothing ships, the closed loop's, unshipped). ``excluded_after_verify``, ``replan_note``: what
    NOTE [re-plan after verify] excluded."""
    bar = _Bar.of(frontier, trace, blocked)
    shipped = None if decision.shipped is None else frontier.point(decision.shipped)
    rejected = _rejected_plans(frontier, decision)
    if shipped is None:
        why = _why_nothing(bar, decision.picked, decision.unverified, decision.sample_miss or closed_loop_note)
    else:
        why = _why(shipped, plan, bar, trace, verification)
    why += _why_replanned(excluded_after_verify or {}, replan_note)
    peak = None if shipped is None else shipped.peak_bytes
    return ReceiptDecision(
        status=ShipStatus.NO_PLAN if shipped is None else ShipStatus.SHIP,
        shipped=None if shipped is None else shipped.plan,
        boundaries=[] if shipped is None else _describe(plan), budget_bytes=bar.budget_bytes, reserve=bar.reserve,
        effective_budget_bytes=bar.limit, control_peak_bytes=bar.control_peak, shipped_peak_bytes=peak,
        clears=peak is not None and peak <= bar.limit,
        headroom_bytes=None if peak is None else bar.limit - peak,
        reserve_left=None if peak is None else 1.0 - peak / bar.budget_bytes,
        control_p50_ms=bar.control_p50, shipped_p50_ms=None if shipped is None else shipped.p50_ms,
        overhead_pct=None if shipped is None else shipped.overhead_pct,
        overhead_interval=None if shipped is None else shipped.overhead_interval,
        verified=None if verification is None else verification.passed,
        rejected=rejected, why=why)


# -- unsupported modes -----------------------------------------------------------------------------

def _autocast_modes(loaded: LoadedWorkload) -> list[UnsupportedMode]:
    """What the receipt says about mixed precision: not run, or run under one autocast dtype only."""
    if loaded.autocast is None:
        return [UnsupportedMode(mode="autocast / mixed precision", status=Coverage.NOT_RUN,
                                detail=f"the step ran as the workload defines it, in {loaded.dtype}, without autocast "
                                       "(remat receipt --autocast bf16 runs the forward under torch.autocast)")]
    other = "float16" if loaded.autocast == "bfloat16" else "bfloat16"
    return [UnsupportedMode(mode="without autocast", status=Coverage.NOT_RUN,
                            detail=f"every figure is from the step with its forward under torch.autocast("
                                   f"{loaded.autocast}); the plain {loaded.dtype} step was not measured or verified"),
            UnsupportedMode(mode=f"autocast {other}", status=Coverage.NOT_RUN,
                            detail=f"measured and verified under autocast {loaded.autocast} only")]


WORLD_SIZE_MODE = "world size > 1 (DDP, FSDP2)"   # replaced by the sizes not run (NOTE [receipt at a world size])


def unsupported_modes(loaded: LoadedWorkload, plan: Plan | None, boundary_shape: dict | None,
                      compiled: bool = False, blocked: BlockedStep | None = None) -> list[UnsupportedMode]:
    """What this receipt's evidence does not cover: the modes a reader must not assume.

    ``compiled``: the receipt was made with --compile (NOTE [compiled receipts]): torch.compile
    is covered when the shipped plan is compiled; eager execution then is what is not verified."""
    if not compiled:
        first = [UnsupportedMode(mode="torch.compile", status=Coverage.NOT_RUN,
                                 detail="every figure is from eager mode; torch.compile keeps checkpoint regions but "
                                        "plans memory itself (activation_memory_budget), so peaks and times would "
                                        "differ (remat receipt --compile measures both)")]
    elif plan is not None and plan.compile is not None:
        first = [UnsupportedMode(mode="eager execution", status=Coverage.NOT_RUN,
                                 detail=f"the shipped plan runs compiled ({plan.compile.describe()}) and was verified "
                                        "compiled against the compiled control; its eager twin was measured on the "
                                        "frontier but not verified")]
    else:
        first = [UnsupportedMode(mode="torch.compile", status=Coverage.NOT_RUN,
                                 detail="compiled plans were measured on the frontier (+compile points) but the "
                                        "shipped plan is eager and was verified eager only")]
    out = first + [
        UnsupportedMode(mode="reentrant checkpointing", status=Coverage.UNSUPPORTED,
                        detail="remat applies non-reentrant torch.utils.checkpoint only (use_reentrant=False); "
                               "reentrant replay checks nothing and can give silently wrong gradients"),
        *_autocast_modes(loaded),
    ]
    for dt in ("float32", "bfloat16", "float16"):
        if dt != loaded.dtype:
            out.append(UnsupportedMode(mode=f"dtype {dt}", status=Coverage.NOT_RUN,
                                       detail=f"peaks and equivalence were measured in {loaded.dtype} only "
                                              f"(tolerances differ per dtype)"))
    if loaded.device.startswith("cuda"):
        out.append(UnsupportedMode(mode="device cpu", status=Coverage.NOT_RUN, detail="measured on CUDA only"))
    else:
        out.append(UnsupportedMode(mode="device cuda", status=Coverage.NOT_RUN,
                                   detail="peaks are from the CPU live-tensor tracker; the CUDA caching allocator "
                                          "(fragmentation, workspaces, alloc retries) was not measured"))
    out.append(UnsupportedMode(mode=WORLD_SIZE_MODE, status=Coverage.NOT_RUN,
                               detail="one process only; `remat distributed` measures per-rank peaks and exposed "
                                      "communication at world size N"))
    shapes = f"the plan was measured and verified at {shape_text(loaded.shape)} only" if blocked is None else \
        (f"the plan was measured at {shape_text(loaded.shape)} and verified at {BATCH_KEY}={blocked.verified_batch} "
         f"(the unmodified control does not fit the device at {BATCH_KEY}={blocked.target_batch}) only")
    if boundary_shape:
        shapes += f"; the boundary shape {shape_text(boundary_shape)} was traced without it"
    out.append(UnsupportedMode(mode="other shapes", status=Coverage.NOT_RUN, detail=shapes))
    if plan is not None and plan.boundaries and plan.preserve_rng_state:
        out.append(UnsupportedMode(mode="preserve_rng_state=False", status=Coverage.UNSUPPORTED,
                                   detail="the plan replays with the forward's RNG state; without it dropout "
                                          "gradients differ (the rng_preservation_off negative control)"))
    return out


# -- the whole run ----------------------------------------------------------------------------------

def _stage(progress: ProgressFn, name: str) -> ProgressFn:
    """Prefix a stage's progress labels ("warm-up" -> "trace boundary shape: warm-up")."""
    def update(what: str, done: int, total: int) -> None:
        progress(f"{name}: {what}", done, total)
    return update


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _capacity_key(loaded: LoadedWorkload, key: str | None) -> str | None:
    if key is None:
        return None
    try:
        v = shape_value(loaded, key)
    except WorkloadError:
        return None
    return key if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Run:
    """The step the receipt plans, and where its proof runs (NOTE [blocked receipt])."""

    loaded: LoadedWorkload                # the step at the target shape
    proof: LoadedWorkload                 # where the unmodified control fits: the target, or the verified batch
    capacity_bytes: int | None = None     # the device's stated capacity (bytes), enforced on the CPU
    blocked: BlockedStep | None = None    # the target's unplanned step did not fit: its evidence

    @classmethod
    def at(cls, loaded: LoadedWorkload, capacity_bytes: int | None, blocked: BlockedStep | None) -> "_Run":
        proof = loaded if blocked is None else loaded.rebuild(**{BATCH_KEY: blocked.verified_batch})
        return cls(loaded=loaded, proof=proof, capacity_bytes=capacity_bytes, blocked=blocked)


@dataclasses.dataclass(kw_only=True)
class _Evidence:
    """What the receipt measured on the plan it shows (steps 5 and 6 of NOTE [receipt run])."""

    verification: VerifyReport | None = None
    note: str = ""                        # why verification did not run
    trace: StepTrace | None = None        # the step with the plan applied
    held: int | None = None               # the control's held bytes at backward
    savings: dict[str, int] = dataclasses.field(default_factory=dict)   # boundary -> measured saving, bytes


def _settings_and_compile(settings: RunSettings | None, compile: CompileSpec | None
                          ) -> tuple[RunSettings, CompileSpec | None]:
    """One CompileSpec for the run: the argument wins and is written into the settings."""
    settings = settings or RunSettings()
    if compile is not None:
        return dataclasses.replace(settings, compile=compile.to_json()), compile
    return settings, None if settings.compile is None else CompileSpec.from_json(settings.compile)


def _trace_unmodified(loaded: LoadedWorkload, boundary_shape: dict[str, Any] | None, settings: RunSettings,
                      progress: ProgressFn) -> tuple[StepTrace | None, StepTrace | None]:
    """Step 1: phase traces of the unmodified step at the target shape and the boundary shape; the target's
    is None when the step does not fit the device (NOTE [blocked receipt]: its refusal is then the evidence)."""
    try:
        target = trace_workload(loaded, warmup=settings.trace_warmup, steps=settings.trace_steps,
                                progress=_stage(progress, "trace"))
    except torch.OutOfMemoryError:
        if boundary_shape:
            raise WorkloadError("the unplanned step does not fit the device, and remat plans a blocked step from "
                                "smaller batches at one shape only (NOTE [blocked step])",
                                tip="drop --boundary-shape") from None
        return None, None
    if not boundary_shape:
        return target, None
    return target, trace_workload(loaded.rebuild(**boundary_shape), warmup=settings.trace_warmup,
                                  steps=settings.trace_steps, progress=_stage(progress, "trace boundary shape"))


def _closed_loop(run: "_Run", report: ProfileReport, budget_bytes: int, reserve: float,
                 sample: StepSample, progress: ProgressFn) -> tuple[ClosedLoopResult | None, str]:
    """Step 3: the optimal plan through the closed loop, or (None, why the measured loop missed).

    InfeasibleBudget propagates: bad input, as in ``remat plan`` (exit 2 naming the floor, and no
    receipt: no plan reaches the budget by the profile's own prediction); so does DeviceTooSmall, when
    the budget is the device's and no plan fits it (NOTE [blocked step])."""
    try:
        return plan_for_device(run.loaded, report, "optimal", budget_bytes=budget_bytes,
                               capacity_bytes=run.capacity_bytes, blocked=run.blocked, reserve=reserve,
                               sample=None if sample.is_single else sample, progress=progress), ""
    except (InfeasibleBudget, DeviceTooSmall):
        raise
    except BudgetError as exc:
        return None, exc.message


def _ship_decision(frontier: FrontierReport, sampled: dict[str, Plan], sample: StepSample,
                   verification: VerifyReport | None = None) -> ShipDecision:
    """The one ship decision (NOTE [ship decision] in frontier/pareto.py) on the frontier's points as
    measured, given each plan measured over the step sample and the verification of the picked plan."""
    verdict = None if verification is None else Verdict(passed=verification.passed,
                                                        failures=tuple(verification.failures))
    return ship_decision(frontier.points, budget_bytes=frontier.budget_bytes, reserve=frontier.reserve,
                         control=frontier.control, verdict=verdict,
                         sample_peaks={label: _sample_peak(plan, sample) for label, plan in sampled.items()})


def _sample_peak(plan: Plan, sample: StepSample) -> SamplePeak:
    """``plan``'s max over the step sample (bytes) and the point that reached it."""
    assert plan.sample is not None
    worst = max(plan.sample.point_peaks)
    return SamplePeak(peak_bytes=worst, at=sample.points()[plan.sample.point_peaks.index(worst)].label())


def _over_sample(loaded: LoadedWorkload, plan: Plan, point: FrontierPoint, sample: StepSample) -> Plan:
    """``plan`` measured at every point of the step sample: a copy carrying its SampleRecord (bytes);
    ``plan`` itself when it already carries one (the closed loop's)."""
    if plan.sample is not None:
        return plan
    copy = dataclasses.replace(plan, measured_peak_bytes=plan.measured_peak_bytes or point.peak_bytes)
    measure_sample_peaks(sample_workloads(loaded, sample), copy, sample)
    return copy


def _hold_over_sample(loaded: LoadedWorkload, frontier: FrontierReport, sample: StepSample
                      ) -> tuple[ShipDecision, dict[str, Plan]]:
    """(the decision, the plans measured over the step sample by label): measure the plan the decision
    picks over the sample and decide again with its max, until the pick was measured or nothing fits
    (NOTE [ship over the sample]). Only evidence is gathered here; ``_ship_decision`` decides."""
    sampled: dict[str, Plan] = {}
    while True:
        decision = _ship_decision(frontier, sampled, sample)
        label = decision.picked
        if sample.is_single or label is None or label in sampled:
            return decision, sampled
        sampled[label] = _over_sample(loaded, frontier.plans[label], frontier.point(label), sample)


def _decided_frontier(frontier: FrontierReport, decision: ShipDecision, sampled: dict[str, Plan],
                      blocked: BlockedStep | None) -> FrontierReport:
    """A new report, the frontier's as the receipt records it: every point as ``decision`` judged it
    (a sampled point's peak is its max over the sample), and the picked plan, with its sample record
    and, planned from a blocked step's profile, its evidence (NOTE [blocked receipt])."""
    plan = None if decision.picked is None else sampled.get(decision.picked) or frontier.plans[decision.picked]
    if plan is not None and blocked is not None:
        plan = dataclasses.replace(plan, blocked=blocked)
    return dataclasses.replace(frontier, points=decision.points(frontier.points),
                               shipped_plan=plan)


# NOTE [ship over the sample]
# The frontier measures and times every plan at the step sample's first point; what it ships is
# then measured at every point (the closed loop's plan already was). A shipped plan whose max
# over the sample misses the limit does not make the receipt ship nothing while another measured
# plan might hold: the decision (``ship_decision`` in frontier/pareto.py) judges that plan by its
# max (so it no longer fits, and its reason says why), picks again, and the next plan is measured
# over the sample, until the pick is one already measured or none fits. Each plan is measured
# over the sample once. The points never picked keep their first-point peaks, as the frontier
# table says. The frontier's own report is not changed: the receipt records a new one, its points
# as the decision judged them.


def _shown_plan(frontier: FrontierReport, closed: ClosedLoopResult | None) -> tuple[Plan | None, str | None]:
    """(plan, label) the receipt shows: the frontier's shipped plan, else the closed loop's, unshipped."""
    if frontier.shipped is not None and frontier.shipped_plan is not None:
        return frontier.shipped_plan, frontier.shipped.plan
    if closed is None:
        return None, None
    return closed.plan, "optimal"


def _gather_evidence(run: "_Run", plan: Plan | None, settings: RunSettings, progress: ProgressFn) -> _Evidence:
    """Steps 5 and 6: verify the plan, trace it, measure each boundary's saving; a plan with no
    boundaries and no torch budget is the control itself, and nothing is run. Verification and the
    savings run where the control fits (``run.proof``), the trace at the target (NOTE [blocked receipt])."""
    torch_budget = plan is not None and plan.compile is not None and plan.compile.memory_budget is not None
    if plan is None or not (plan.boundaries or torch_budget):
        return _Evidence(note="not run: the shipped plan checkpoints nothing, so the step is the control itself"
                         if plan is not None else "not run: no plan reaches the budget")
    verification = verify_plan(run.proof, plan, steps=settings.verify_steps, seeds=settings.verify_seeds,
                               timing_steps=settings.verify_timing_steps, progress=progress)
    trace = trace_planned(run.loaded, plan, warmup=settings.trace_warmup, steps=settings.trace_steps,
                          progress=_stage(progress, "trace with the plan"))
    held, savings = measure_savings(run.proof, plan, warmup=settings.saving_warmup, progress=progress)
    return _Evidence(verification=verification, trace=trace, held=held, savings=savings)


MAX_VERIFY_ROUNDS = 3   # NOTE [re-plan after verify]


@dataclasses.dataclass(kw_only=True)
class _Round:
    """Steps 3-6 of NOTE [receipt run] on one profile: the plan, its frontier and its evidence."""

    closed: ClosedLoopResult | None
    note: str                             # why the closed loop missed
    frontier: FrontierReport
    plan: Plan | None
    label: str | None
    evidence: _Evidence
    decision: ShipDecision                # the ship decision, given the evidence (NOTE [receipt decision])


@dataclasses.dataclass(kw_only=True)
class _Proved:
    """The last round, what the earlier ones excluded (module -> why), and why re-planning stopped."""

    last: _Round
    excluded: dict[str, str]
    note: str = ""


def _hazardous(plan: Plan | None, verification: VerifyReport | None) -> dict[str, str]:
    """The boundaries of ``plan`` a failed verification implicates, each with its cause."""
    if plan is None or verification is None or verification.passed:
        return {}
    out: dict[str, str] = {}
    for b in plan.boundaries:
        if verification.implicates(b.module):
            h = next((h for h in verification.hazards if b.module in h.modules), None)
            out[b.module] = f"{h.kind.value}: {h.detail}" if h is not None else verification.failures[0]
    return out


def _without(report: ProfileReport, hazardous: dict[str, str]) -> ProfileReport:
    """``report`` with each hazardous module, and every candidate containing one, excluded."""
    def contains(c_paths: tuple[str, ...], m: str) -> bool:
        return any(m == p or m.startswith(p + ".") for p in c_paths)
    more = {c.name: f"verification found {m} hazardous: {why}" for m, why in hazardous.items()
            for c in report.candidates if contains(c.covers, m)}
    return dataclasses.replace(report, excluded={**report.excluded, **more})


def _one_round(run: "_Run", report: ProfileReport, budget_bytes: int, reserve: float, settings: RunSettings,
               compile: CompileSpec | None, sample: StepSample, progress: ProgressFn) -> _Round:
    """Steps 3-6: closed loop, frontier, the plan shown (measured over the step sample), its evidence,
    and the ship decision given all of it."""
    loaded = run.loaded
    closed, note = _closed_loop(run, report, budget_bytes, reserve, sample, progress)              # 3.
    measured = run_frontier(loaded, FrontierSettings(                                              # 4.
        budget_bytes=budget_bytes, reserve=reserve, plans=settings.frontier_plans, steps=settings.frontier_steps,
        warmup=settings.frontier_warmup, capacity_key=_capacity_key(loaded, settings.capacity_key),
        capacity_tries=settings.capacity_tries, capacity_steps=settings.capacity_steps, compile=compile),
        report=report, progress=progress)
    picked, sampled = _hold_over_sample(loaded, measured, sample)   # NOTE [ship over the sample]
    frontier = _decided_frontier(measured, picked, sampled, run.blocked)
    plan, label = _shown_plan(frontier, closed)
    evidence = _gather_evidence(run, plan, settings, progress)                                     # 5., 6.
    return _Round(closed=closed, note=note, frontier=frontier, plan=plan, label=label, evidence=evidence,
                  decision=_ship_decision(measured, sampled, sample, evidence.verification))


def _plan_and_prove(run: "_Run", report: ProfileReport, budget_bytes: int, reserve: float,
                    settings: RunSettings, compile: CompileSpec | None, sample: StepSample,
                    progress: ProgressFn) -> _Proved:
    """Rounds of steps 3-6, re-planning without the boundaries verification implicates (NOTE [re-plan after verify])."""
    last = _one_round(run, report, budget_bytes, reserve, settings, compile, sample, progress)
    excluded: dict[str, str] = {}
    for _ in range(MAX_VERIFY_ROUNDS - 1):
        hazardous = _hazardous(last.plan, last.evidence.verification)
        if not hazardous:
            return _Proved(last=last, excluded=excluded)
        excluded.update(hazardous)
        report = _without(report, hazardous)
        try:
            last = _one_round(run, report, budget_bytes, reserve, settings, compile, sample, progress)
        except InfeasibleBudget as exc:   # the last plan stays UNVERIFIED; nothing else reaches the budget
            return _Proved(last=last, excluded=excluded, note=f"without them no plan reaches the budget ({exc.message})")
    stop = "" if not _hazardous(last.plan, last.evidence.verification) else \
        f"verification still fails after {MAX_VERIFY_ROUNDS} rounds"
    return _Proved(last=last, excluded=excluded, note=stop)


def make_receipt(loaded: LoadedWorkload, *, budget: str | int | None, reserve: float = 0.05,
                 boundary_shape: dict[str, Any] | None = None, settings: RunSettings | None = None,
                 candidates: list[str] | None = None, command: str = "",
                 compile: CompileSpec | None = None, boundary_in_sample: bool = False,
                 device_memory_bytes: int | None = None, progress: ProgressFn = no_progress) -> Receipt:
    """Run every stage on ``loaded`` and return the receipt (NOTE [receipt run]).

    ``budget``: whole-step peak budget as ``remat plan`` takes it (bytes, ``800MiB``, ``60%``
    of the unmodified peak); None: the device's capacity ``device_memory_bytes`` (NOTE [blocked
    receipt]); ``reserve``: share of the budget kept free. Raises the stages'
    typed errors for bad input (BudgetError, WorkloadError...), among them
    :class:`~remat.plan.InfeasibleBudget` naming the floor when no plan's predicted peak reaches
    the budget (as ``remat plan`` does), and :class:`~remat.errors.DeviceTooSmall` when the budget
    is the device's and no plan fits it. A plan predicted to fit whose *measured* peak misses a
    budget under the device is not an error: the receipt says nothing ships and why.

    ``boundary_in_sample`` (``remat receipt --boundary-shape``): the boundary shape's steps join the
    step sample (NOTE [step sample]), so the plan must hold there too; else it is only traced.
    """
    settings, compile = _settings_and_compile(settings, compile)
    if not 0.0 <= reserve < 1.0:
        raise BudgetError(f"reserve must lie in [0, 1), got {reserve}")
    if budget is None and device_memory_bytes is None:
        raise BudgetError("a receipt needs a budget or the device's memory",
                          tip="pass --budget 60%, or --device-memory 2GiB to fit the device")
    if isinstance(budget, str):
        check_budget_syntax(budget)  # syntax check before minutes of measuring
    if device_memory_bytes is not None and budget is not None and not str(budget).strip().endswith("%"):
        budget_on_device(budget, 0, device_memory_bytes)   # an amount above the device: refused before measuring
    # NOTE [device capacity]: on the CPU every step runs under the stated capacity, enforced
    with step_capacity(device_memory_bytes if loaded.device == "cpu" else None):
        return _make_receipt(loaded, budget=budget, reserve=reserve, boundary_shape=boundary_shape, settings=settings,
                             candidates=candidates, command=command, compile=compile,
                             boundary_in_sample=boundary_in_sample, device_memory_bytes=device_memory_bytes,
                             progress=progress)


def _make_receipt(loaded: LoadedWorkload, *, budget: str | int | None, reserve: float,
                  boundary_shape: dict[str, Any] | None, settings: RunSettings, candidates: list[str] | None,
                  command: str, compile: CompileSpec | None, boundary_in_sample: bool,
                  device_memory_bytes: int | None, progress: ProgressFn) -> Receipt:
    target, boundary_trace = _trace_unmodified(loaded, boundary_shape, settings, progress)        # 1.
    sample = StepSample.of(settings.sample_steps, [boundary_shape] if boundary_shape and boundary_in_sample else [])
    report, blocked = profile_on_device(loaded, sample, capacity_bytes=device_memory_bytes,      # 2.
                                        candidates=candidates, progress=progress)
    run = _Run.at(loaded, device_memory_bytes, blocked)
    if target is None:   # blocked: the control's timeline where it fits (NOTE [blocked receipt])
        target, _ = _trace_unmodified(run.proof, None, settings, _stage(progress, f"at {BATCH_KEY}="
                                                                             f"{run.proof.shape[BATCH_KEY]}"))
    budget_bytes = budget_on_device(budget, report.baseline_peak_bytes, device_memory_bytes)
    assert budget_bytes is not None and target is not None
    proved = _plan_and_prove(run, report, budget_bytes, reserve, settings, compile, sample, progress)  # 3.-6.
    last = proved.last
    closed, note, frontier, plan, label, evidence = (last.closed, last.note, last.frontier, last.plan, last.label,
                                                     last.evidence)
    records = [] if plan is None else _boundary_records(loaded, plan, report, evidence.verification,
                                                         evidence.savings, settings)
    return Receipt(   # the context's instrument: the one the unmodified step's trace names
        context=ReceiptContext.capture(loaded, boundary_shape=boundary_shape, memory_source=target.memory_source,
                                       command=command, device_memory_bytes=device_memory_bytes),
        settings=settings,
        traces=ReceiptTraces(target=target, boundary=boundary_trace, planned=evidence.trace),
        plan=ReceiptPlan(label=label, plan=plan, boundaries=records, control_held_bytes=evidence.held,
                         closed_loop=list(closed.attempts) if closed else [],
                         closed_loop_boundaries=_describe(closed.plan) if closed else [], note=note,
                         excluded_after_verify=proved.excluded),
        verification=evidence.verification, verification_note=evidence.note, frontier=frontier,
        decision=_decide(frontier=frontier, decision=last.decision, plan=plan, trace=target,
                         verification=evidence.verification, closed_loop_note=note, blocked=blocked,
                         excluded_after_verify=proved.excluded, replan_note=proved.note),
        unsupported=unsupported_modes(loaded, plan, boundary_shape, compiled=compile is not None, blocked=blocked))
