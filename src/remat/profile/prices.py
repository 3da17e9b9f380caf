"""Measured replay prices made sane and stable before any planner reads them (pure: no torch).

NOTE [sane replay prices]
Each (candidate, mode)'s replay is timed alone (NOTE [measured replay costs] in profile/replay.py),
and a few rounds of a tiny region can read nonsense: SD3's ``ff_context`` in block 0 was priced at
0.00014 ms against a 0.455 ms forward (the identical module in block 1 at 47.8 ms), Qwen3-MoE's
``mlp.experts`` at 152 ms under its parent ``mlp`` at 48 ms. A planner then takes the "free"
boundary. So, once the measurements are in (``sane_replay_prices``):
- a FULL replay runs the module's forward again, so it is never priced below that forward
  (``fwd_ms``; for a group of identical candidates, NOTE [shared replay measurements] in
  profile/shared.py, the group's median forward, so identical blocks get one price);
- a child's region lies inside its parent's, so a child's FULL replay is never priced above its
  parent's (parents are bounded first, outermost in);
- a selective (op-level) mode recomputes a subset of FULL's ops, so it is never priced above FULL;
- a composed segment (NOTE [composed segment replays] in profile/replay.py) stays its members'
  sum: it is bounded through its members and summed again afterwards, never bounded on its own.
  (Bounding it on its own, as a first attempt did, broke the rule "a composed segment is priced as
  its members' sum" that tests/test_profile.py checks: raising a member to its forward and not the
  sum made the segment cheaper than its members.)

NOTE [stable prices]
Two profiles of one step never read the same replay times, and an exact planner turns a 2% wobble
into another plan (7 boundaries in one run, 10 in the next, on one 6-layer GPT-2). The rule: each
module candidate's measured replay price is snapped to a log grid of ``PRICE_GRID`` (2^(1/4): cells
about 19% wide, so a price moves by at most 9% of itself) before composing segments; prices that
only noise tells apart then are *equal*, the planner breaks their ties by its fixed order, and two
runs give the same plan whenever each price's run-to-run noise keeps it in its grid cell (identical
blocks share one measurement and one forward bound, so they always price alike). A price sitting
within its noise of a cell's edge can still change cells; that is the rule's limit, and the time
race of the closed loop (NOTE [time race] in remat/closed_loop.py) is what then settles which of
two plans is faster, by measurement. Prices below the clock's resolution keep their floor
(NOTE [measured replay costs]): snapping rounds, it never makes a price zero.

NOTE [prices from counts]
Snapping holds a price that wobbles by a few percent; a replay timed alone moves far more. On
the diffusers UNet (one thread) 111 of 143 (candidate, mode) prices moved between two profiles
of the same step, a tenth of them by 4x or more, and optimal's plan at 70% moved with them (2
plans in 3 profiles on a quiet machine, 5 in 5 under load: benchmarks/RESULTS.md). Measured
rates per class of op (the step's own kernel times over the roofline's, attention, matmul,
convolution, norm, other) moved too: up to 4x between three profiles at a load of 4. What does
not move is the work. The recorded step lists every forward op inside each candidate with its
FLOPs (FlopCounterMode's formulas), bytes and, for attention, its query x key scores; the device
model (NOTE [roofline runtime model] in remat/simulate/runtime.py: ``cpu``, or the CUDA part torch
names; NOTE [attention scores], NOTE [SAC op cost] in remat/simulate/devices.py) gives the time
of what a replay in mode m adds: the ops it runs again, plus, for an op-level mode, SAC's cost
per op of the region. That is ``CandidateCost.replay_work[m]`` (ms), the same in every profile
of the same step on the same device.
The replays timed alone set only the scale (``calibrate_from_counts``): one factor for every
counted mode, the median over the arms timed on their own of measured ms / work ms, snapped
to ``PRICE_GRID`` (no such arm: the same median over the timed forwards). Left out of the
median: arms below the clock's resolution, copies of a shared measurement, composed segments,
regions with no work. A counted price is ``factor x replay_work[m]``; a selective mode is still
never priced above FULL, and a composed segment is still its members' sum.
One factor common to every counted price moves no plan (the least added time is the same plan
at any scale), so two profiles of one step give the same plan whatever their timings read;
what a timing can still change is a plan that mixes counted modes with measured ones (offload).
What that gives up: a region whose time the device model misjudges (a kernel far from its
roofline, Python-heavy code between ops) is priced by its counts, not by its own timing; the
closed loop's time race (NOTE [time race] in remat/closed_loop.py) measures the plan that ships
against a simple one, and feeds the measured error back per mode. Modes that are not a replay of
forward ops (offload, a segment's input on the host) keep their measured prices under the
rules above, as does a profile with no work recorded (one cached before prices came from counts)
and a simulated one (priced by its device model).
"""

from __future__ import annotations

import math

from ..percentile import p50
from ..types import OP_POLICY_MODES, CheckpointMode
from .model import CandidateCost, ProfileReport

PRICE_GRID = 2 ** 0.25   # NOTE [stable prices]: one grid step, a ratio (about 1.19)
COUNTED_MODES = (CheckpointMode.FULL, *OP_POLICY_MODES)   # modes that replay forward ops: priced from counts

_F = CheckpointMode.FULL


def snap_price(ms: float) -> float:
    """``ms`` on the log grid of NOTE [stable prices] (the nearest grid point; 0 and negatives unchanged)."""
    if ms <= 0.0 or not math.isfinite(ms):
        return ms
    return PRICE_GRID ** round(math.log(ms, PRICE_GRID))


def sane_replay_prices(report: ProfileReport) -> None:
    """NOTE [prices from counts], [sane replay prices] and [stable prices], in place on ``report``'s replay prices (ms)."""
    by_name = {c.name: c for c in report.candidates}
    forward = _group_forward_ms(report)
    composed = report.replay_composed
    factor = report.replay_calibration = calibrate_from_counts(report)
    # parents before children; at one depth, composed segments after the members they sum
    for c in sorted(report.candidates, key=lambda c: (_depth(c, by_name), c.name in composed, c.order)):
        if c.name in composed:
            if all(m in by_name and _F in by_name[m].replay_ms for m in composed[c.name]) and _F in c.replay_ms:
                c.replay_ms[_F] = sum(by_name[m].replay_ms[_F] for m in composed[c.name])
                _cap_selective(c)
            continue
        counted = {m for m in COUNTED_MODES if factor and c.replay_work.get(m, 0.0) > 0.0 and m in c.replay_ms}
        for mode in counted:
            c.replay_ms[mode] = factor * c.replay_work[mode]
        _bound_measured(c, by_name, forward[c.name], counted)
        _cap_selective(c)


def _bound_measured(c: CandidateCost, by_name: dict[str, CandidateCost], forward_ms: float,
                    counted: set[CheckpointMode]) -> None:
    """The measured prices of ``c`` that did not come from counts, bounded and snapped (NOTE [sane replay prices],
    NOTE [stable prices])."""
    if _F in c.replay_ms and _F not in counted:
        full = snap_price(max(c.replay_ms[_F], forward_ms))
        parent = by_name.get(c.parent) if c.parent else None
        if parent is not None and _F in parent.replay_ms:
            full = min(full, parent.replay_ms[_F])
        c.replay_ms[_F] = full
    for mode in c.replay_ms:
        if mode is not CheckpointMode.KEEP and mode is not _F and mode not in counted:
            c.replay_ms[mode] = snap_price(c.replay_ms[mode])


def calibrate_from_counts(report: ProfileReport) -> float:
    """The factor (measured ms per work ms) every counted price is ``replay_work`` times (NOTE [prices from
    counts]); 0.0 when no candidate has work recorded, and for a simulated profile (priced by its device model)."""
    if report.simulated:
        return 0.0
    ratios = _measured_ratios(report)
    if not ratios:   # no replay measured: the timed forwards give the scale (all calls: both)
        ratios = [c.fwd_ms / c.replay_work[_F] for c in report.candidates
                  if c.replay_work.get(_F, 0.0) > 0.0 and c.fwd_ms > 0.0 and not c.members]
    return snap_price(p50(ratios)) if ratios else 0.0


def _measured_ratios(report: ProfileReport) -> list[float]:
    """Measured ms / work ms over every counted arm timed on its own (NOTE [prices from counts])."""
    below = {(n, m) for n, modes in report.replay_below_resolution.items() for m in modes}
    skipped = report.replay_shared.keys() | report.replay_composed.keys() | report.replay_unmeasured.keys()
    return [c.replay_ms[m] / c.replay_work[m] for c in report.candidates if c.name not in skipped
            for m in COUNTED_MODES
            if c.replay_work.get(m, 0.0) > 0.0 and c.replay_ms.get(m, 0.0) > 0.0 and m in c.replay_spread_ms
            and (c.name, m.value) not in below]


def _cap_selective(c: CandidateCost) -> None:
    """A selective mode never above FULL (NOTE [sane replay prices])."""
    if _F not in c.replay_ms:
        return
    for mode in c.replay_ms:
        if mode is not CheckpointMode.KEEP and mode is not _F:
            c.replay_ms[mode] = min(c.replay_ms[mode], c.replay_ms[_F])


def _group_forward_ms(report: ProfileReport) -> dict[str, float]:
    """Per candidate, the median forward time (ms) of its group of identical candidates (the one measured
    and those that took its measurement, ``report.replay_shared``); a candidate alone keeps its own."""
    leader = {c.name: report.replay_shared.get(c.name, c.name) for c in report.candidates}
    groups: dict[str, list[float]] = {}
    for c in report.candidates:
        groups.setdefault(leader[c.name], []).append(c.fwd_ms)
    return {c.name: p50(groups[leader[c.name]]) for c in report.candidates}


def _depth(c: CandidateCost, by_name: dict[str, CandidateCost]) -> int:
    """How many candidates enclose ``c`` (0: top level)."""
    depth, parent = 0, c.parent
    while parent is not None and parent in by_name and depth < len(by_name):
        depth, parent = depth + 1, by_name[parent].parent
    return depth
