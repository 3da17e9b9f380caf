"""Plan a step that does not fit: its refusal as evidence, a profile from smaller batches that fit.

NOTE [blocked step]
People checkpoint because the step does not fit the device. When the unplanned step at the
target batch runs out of memory (a CPU capacity's refusal, NOTE [CPU device capacity] in
memory/capacity.py, or CUDA's ``torch.OutOfMemoryError``), remat records where (``Refusal``: the
phase, the refused allocation, the bytes live by kind) and plans without ever running that step
unplanned again (``remat.auto``, ``remat plan --device-memory``):

1. **Smaller batches that fit.** The batch B (remat.auto: the example batch's leading dimension,
   shared by every tensor leaf of rank >= 1, sliced; the command: the ``batch_size`` shape
   keyword) is halved until the unplanned step fits: k2 = B/2, B/4, ...; then k1 = k2/2. k2 is
   profiled in full (every candidate's saved bytes, replay cost, hazards; NOTE [what one profiled
   step gives]), k1 for its bytes (its replays not timed alone: about a third of a profile's
   time), both under the capacity.
2. **The rule: affine in the batch.** Every byte figure of the profile (each candidate's saved,
   input and replay-extra bytes; each peak row's base bytes; the unplanned peak and its phases)
   is x(k) = a + b*k through (k1, x1) and (k2, x2), read at B: x(B) = x2 + (x2 - x1) * (B - k2) /
   (k2 - k1). The constant part is what does not grow with the batch (parameters, gradients,
   optimizer state), the slope what does (activations, their temporaries). Bytes live are clamped
   at 0 (a candidate's saved bytes may be negative, and are not). Times (forward, replay, the
   step) are k2's scaled by B / k2 (a time's fixed part read as per-sample errs high, never low).
   Structure (which candidates, hazards, exclusions, which rows) is k2's; peak rows are matched by
   what they hold (they are ordered by bytes, which change with the batch). When the two profiles
   differ in structure, or only k2 = 1 fits, k2 is scaled alone above its least-live row
   (``_proportional``). Measured error: 0% on the gpt's unplanned peak and every candidate's saved
   bytes at batch 32 read from 8 and 16 (tests/test_blocked.py bounds it at 3%; benchmarks/RESULTS.md,
   "Unlock the blocked shape").
3. **Measured at the target.** The closed loop (NOTE [closed loop]) measures each plan at B under
   the capacity: a plan that still does not fit is refused and counts as a miss whose peak is at
   least what was live plus the refused allocation (``closed_loop._measure_into``), so the loop
   corrects its margin and falls back as for any miss.
4. **Proof where the control fits.** ``verify="quick"`` compares the plan with the unmodified
   control at k2, the largest batch at which the control fits (``verified_batch``); the planned
   step at B is the closed loop's measurement.
When no halving fits, or no plan fits at B, ``remat.DeviceTooSmall`` (exit 2) says so with the
capacity, the floor plan's peak measured at B under the capacity (at least what was live plus the
refused allocation, when the capacity refuses it too), and the levers left.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import AutoError, DeviceTooSmall, WorkloadError
from ..types import CheckpointMode, ProgressFn, Refusal, no_progress
from ..workload.loader import LoadedWorkload
from ..units import fmt_bytes
from .model import BlockedStep, CandidateCost, PeakRow, ProfileReport, StepSample, describe_refusal

T = TypeVar("T")
BATCH_KEY = "batch_size"   # the shape keyword the command line halves (NOTE [blocked step])

def leading_size(batch: Any) -> int:
    """B: the leading dimension every tensor leaf of rank >= 1 shares (remat.auto's example batch);
    AutoError when they do not."""
    sizes = {t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 1}
    if len(sizes) != 1:
        raise AutoError(f"the step does not fit, and remat finds no batch dimension to plan it from smaller batches: "
                        f"the example batch's tensors have leading sizes {sorted(sizes) or 'none'}",
                        tip="give an example batch whose tensors share their first (batch) dimension")
    return sizes.pop()


def slice_batch(batch: Any, k: int) -> Any:
    """The first ``k`` samples of every tensor leaf of rank >= 1 (a copy: the user's batch is left alone)."""
    return tree_map(lambda t: t[:k].clone() if isinstance(t, torch.Tensor) and t.dim() >= 1 else t, batch)


def halvings(target: int) -> list[int]:
    """k = B/2, B/4, ..., 1: the smaller batches tried, largest first."""
    out, k = [], target // 2
    while k >= 1:
        out.append(k)
        k //= 2
    return out


def extrapolate(small: ProfileReport, k1: int, large: ProfileReport, k2: int, target: int,
                state_bytes: int) -> tuple[ProfileReport, str]:
    """``large`` (at batch ``k2``) read at batch ``target`` by the rule of NOTE [blocked step]; returns the
    report and the rule used ("affine", or "proportional" when the two profiles differ in structure)."""
    if _same_structure(small, large):
        t = (target - k2) / (k2 - k1)

        def at(kind: str, x2: float, x1: float) -> float:
            if kind == "ms":   # times from k2 alone: k1's replays are not timed (its profile is for bytes)
                return x2 * target / k2
            x = x2 + (x2 - x1) * t
            return max(0.0, x) if kind in _NON_NEGATIVE else x   # a candidate's saved bytes may be < 0
        return _scaled(large, at, small), "affine"
    return _proportional(large, k2, target, state_bytes), "proportional"


# figures that cannot be negative: times, and bytes live (a candidate's saved bytes can be: a selective
# policy's saved outputs can outweigh the intermediates it frees)
_NON_NEGATIVE = frozenset({"ms", "row", "baseline_peak", "phase_peak", "untracked"})


def _same_structure(a: ProfileReport, b: ProfileReport) -> bool:
    return ([(c.name, sorted(m.value for m in c.saved_bytes)) for c in a.candidates]
            == [(c.name, sorted(m.value for m in c.saved_bytes)) for c in b.candidates]
            and sorted(_row_key(r) for r in a.rows) == sorted(_row_key(r) for r in b.rows)
            and set(a.phase_peak_bytes) == set(b.phase_peak_bytes))


def _row_key(row: PeakRow) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """A peak row by what it holds (rows are ordered by their bytes, which differ between batches)."""
    return row.live, row.replaying, row.label


def _proportional(report: ProfileReport, k: int, target: int, state_bytes: int) -> ProfileReport:
    """Every figure scaled by target / k, row bytes above the state (which does not grow) only."""
    f = target / k

    def scale(name: str, x: float, _: float) -> float:
        if name in ("row", "baseline_peak", "phase_peak"):
            return state_bytes + max(0.0, x - state_bytes) * f
        return x * f
    return _scaled(report, scale, report)


# (figure's kind: "candidate" bytes, "ms", "row", "baseline_peak", "phase_peak", "untracked";
#  its value in ``report``; in ``other``) -> its value at the target batch
Rule = Callable[[str, float, float], float]


def _scaled(report: ProfileReport, rule: Rule, other: ProfileReport) -> ProfileReport:
    """``report`` with every byte and time figure replaced by ``rule`` of it and of ``other``'s same figure."""
    by_name = {c.name: c for c in other.candidates}

    def cand(c: CandidateCost) -> CandidateCost:
        o = by_name[c.name]

        def per_mode(a: dict[CheckpointMode, Any], b: dict[CheckpointMode, Any], as_int: bool) -> dict:
            kind = "candidate" if as_int else "ms"
            return {m: (round if as_int else float)(rule(kind, v, b.get(m, v))) for m, v in a.items()}
        return dataclasses.replace(
            c, fwd_ms=rule("ms", c.fwd_ms, o.fwd_ms),
            input_bytes=round(rule("candidate", c.input_bytes, o.input_bytes)),
            saved_input_bytes=round(rule("candidate", c.saved_input_bytes, o.saved_input_bytes)),
            # freed in both profiles, or not counted (NOTE [segment input freed] in profile/step.py)
            host_input_bytes=round(rule("candidate", c.host_input_bytes, o.host_input_bytes))
            if c.host_input_bytes and o.host_input_bytes else 0,
            saved_bytes=per_mode(c.saved_bytes, o.saved_bytes, True),
            replay_ms=per_mode(c.replay_ms, o.replay_ms, False),
            replay_extra_bytes=per_mode(c.replay_extra_bytes, o.replay_extra_bytes, True),
            replay_spread_ms=per_mode(c.replay_spread_ms, o.replay_spread_ms, False),
            replay_work=per_mode(c.replay_work, o.replay_work, False))

    other_rows = {_row_key(r): r for r in other.rows}
    rows = sorted((dataclasses.replace(r, base_bytes=round(rule("row", r.base_bytes,
                                                                other_rows.get(_row_key(r), r).base_bytes)))
                   for r in report.rows), key=lambda r: -r.base_bytes)
    return dataclasses.replace(
        report, candidates=[cand(c) for c in report.candidates], rows=rows,
        baseline_peak_bytes=round(rule("baseline_peak", report.baseline_peak_bytes, other.baseline_peak_bytes)),
        baseline_step_ms=rule("ms", report.baseline_step_ms, other.baseline_step_ms),
        phase_peak_bytes={p: round(rule("phase_peak", v, other.phase_peak_bytes.get(p, v)))
                          for p, v in report.phase_peak_bytes.items()},
        untracked_bytes=round(rule("untracked", report.untracked_bytes, other.untracked_bytes)))


def profile_smaller(target: int, build: Callable[[int], T], profile: Callable[[T, bool], ProfileReport],
                    refusal: Refusal | None, capacity_bytes: int,
                    progress: ProgressFn) -> tuple[ProfileReport, BlockedStep, T]:
    """The profile at batch ``target`` from smaller batches that fit unplanned (NOTE [blocked step]).

    ``build(k)``: the step at batch ``k`` (a workload, a source); ``profile(step, bytes_only)``: its profile,
    raising ``torch.OutOfMemoryError`` when it does not fit. Returns the extrapolated profile, the evidence,
    and the step at k2 (the largest batch at which the unplanned control fits: where it is verified)."""
    profiles: list[tuple[int, ProfileReport, T]] = []
    tried: list[int] = []
    for k in halvings(target):
        progress(f"blocked: the step at batch {target} does not fit; profiling batch {k}", 0, 1)
        step = build(k)
        try:
            profiles.append((k, profile(step, bool(profiles)), step))
        except torch.OutOfMemoryError:
            tried.append(k)
            continue
        if len(profiles) == 2 or k == 1:
            break
    if not profiles:
        raise no_smaller_fit(target, refusal, capacity_bytes, tried)
    k2, large, at_k2 = profiles[0]
    state = min((r.base_bytes for r in large.rows), default=0)   # the least live: roughly the step's state
    if len(profiles) == 2:
        k1, small, _ = profiles[1]
        report, rule = extrapolate(small, k1, large, k2, target, state)
    else:
        report, rule = _proportional(large, k2, target, state), "proportional"   # only k2 fits: nothing to fit a line to
    blocked = BlockedStep(refusal=refusal, target_batch=target, profiled_batches=tuple(sorted(p[0] for p in profiles)),
                          verified_batch=k2, rule=rule)
    return report, blocked, at_k2


def profile_on_device(loaded: LoadedWorkload, sample: StepSample, *, capacity_bytes: int | None,
                      batch_key: str = BATCH_KEY, candidates: list[str] | None = None,
                      progress: ProgressFn = no_progress) -> tuple[ProfileReport, BlockedStep | None]:
    """``profile_sample`` of ``loaded``; when its unplanned step does not fit the device (NOTE [blocked step]),
    the profile read from smaller values of the shape keyword ``batch_key`` instead, with the evidence.
    Call it under the capacity (``remat.memory.capacity.step_capacity``) on the CPU."""
    from ..measure.run import shape_value
    from ..memory.capacity import clear_refusal, last_refusal
    from .sample import profile_sample
    clear_refusal()
    try:
        return profile_sample(loaded, sample, candidates=candidates, progress=progress), None
    except torch.OutOfMemoryError:
        refusal = last_refusal()
    if sample.boundary_shapes:
        raise WorkloadError("the unplanned step does not fit the device, and remat plans a blocked step from smaller "
                            "batches at one shape only", tip="drop --boundary-shape")
    target = shape_value(loaded, batch_key)
    if isinstance(target, bool) or not isinstance(target, int) or target < 2:
        raise no_smaller_fit(target if isinstance(target, int) else 1, refusal, capacity_bytes or 0, [])
    steps = StepSample.of(sample.steps, [])   # the same sampled steps, at each smaller batch
    report, blocked, _ = profile_smaller(
        target, lambda k: loaded.rebuild(**{batch_key: k}),
        lambda w, bytes_only: profile_sample(w, steps, candidates=candidates, measure_replays=not bytes_only,
                                             progress=progress),
        refusal, capacity_bytes or (refusal.capacity_bytes if refusal else 0), progress)
    return report, blocked


def no_smaller_fit(target: int, refusal: Refusal | None, capacity_bytes: int, tried: list[int]) -> DeviceTooSmall:
    evidence = f" ({describe_refusal(refusal)})" if refusal is not None else ""
    if target < 2 or not tried:
        why = f"the example batch has {target} sample(s): there is no smaller batch to profile from"
    else:
        why = f"neither does the unplanned step at batch {', '.join(map(str, tried))}"
    return DeviceTooSmall(f"the unplanned step at batch {target} does not fit the device capacity of "
                          f"{fmt_bytes(capacity_bytes)}{evidence}, and {why}, so remat has no measured step "
                          "to plan it from", capacity_bytes=capacity_bytes, floor_bytes=None)
