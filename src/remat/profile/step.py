"""``profile_workload``: per-candidate costs and peak rows from the real (unmodified) step.

NOTE [what one profiled step gives]
One warm baseline step runs under a StepRecorder (live bytes, module forward windows,
saved-tensor pack/unpack events) with a per-op observer (op time, device moves, in-place
writes into a candidate's inputs) and a hazard probe around each candidate's forward.
From it, per candidate j:
  saved_bytes[FULL]  storages packed for backward inside j's forward window, allocated in
                     that window, not parameters, and packed by nobody outside j (those
                     outlive j whatever we do), minus j's inputs that nobody saved (a
                     checkpoint keeps them alive until j's backward).
  saved_bytes[m]      for each op-level mode m (SELECTIVE, SAVE_ATTENTION, RECOMPUTE_POINTWISE;
                     NOTE [op-level policies] in remat.types): the same less what m's policy
                     keeps: outputs of the ops it keeps made in j (whether autograd saved them
                     or not: SAC caches them all).
  replay_ms[FULL]    first estimate: j's warm median forward time (separate, lightly
                     instrumented steps; CUDA events on a GPU, NOTE [device-correct timing]).
  replay_ms[m]       first estimate: that time less the share spent in the ops m keeps.
                     ``profile_workload`` then replaces both by direct measurements of each
                     (candidate, mode) alone (NOTE [measured replay costs] in replay.py),
                     bounded and snapped (NOTE [sane replay prices], NOTE [stable prices] in prices.py).
  replay_extra_bytes  how far j's forward rises above its entry level beyond what it saves:
                     the transients a replay re-creates during backward.
The rows follow NOTE [peak cost model] in profile/model.py.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..clock import RegionTimer
from ..measure import time_steps, warm_up
from ..memory.measure import PeakMeasurement, measure_step_peak, model_device, peak_costs_nothing
from ..memory.reference import tracker_error_bytes
from ..memory.tracker import StorageRecord
from ..percentile import percentile
from ..simulate.costs import flop_registry, has_tensor, op_record
from ..simulate.devices import DeviceModel, device_model_for
from ..simulate.runtime import op_ms
from ..trace.recorder import ModuleWindow, StepRecorder
from ..types import (MODULE_PATH_RE, OP_POLICY_MODES, CheckpointMode, HazardKind, MemorySource, Phase, ProgressFn,
                     is_cheap_op, no_progress, sac_saves)
from ..workload.contract import TrainingStep
from ..workload.loader import LoadedWorkload
from .candidates import parent_of, resolve_candidates, segment_search
from .confirm import confirm_hazards
from .dryrun import dry_run_modes
from .replay import ReplayEstimate, measure_replay_costs
from .fingerprint import fingerprint
from .hazards import HazardProbe, hook_detail, module_hooks
from .model import NOT_CALLED, CandidateCost, HazardRecord, PeakRow, ProfileReport
from .prices import sane_replay_prices
from .segments import ChainProbe, is_segment, parse_segment, run_segments

if TYPE_CHECKING:
    from ..simulate.runtime import RuntimePrediction

_T = TypeVar("_T")


def _packet(func: Any) -> str:
    return func._overloadpacket.__name__


_RNG_OPS = ("bernoulli", "native_dropout", "rand", "randn", "randint", "randperm", "normal", "uniform",
            "exponential", "geometric", "cauchy", "log_normal", "multinomial", "poisson")


def _draws_random(name: str, args: tuple) -> bool:
    """Ops that consume the RNG (fused attention kernels take dropout_p as an argument)."""
    base = name.rstrip("_")
    if base in _RNG_OPS or base.startswith("_fused_dropout"):
        return True
    if "attention" in name and len(args) > 3 and isinstance(args[3], float) and args[3] > 0.0:
        return True  # _scaled_dot_product_*_attention(q, k, v, dropout_p, ...)
    return False


class _OpLog:
    """Per-op observer for the profiled step: times, SAC-op share, device moves, in-place inputs."""

    def __init__(self, rec: StepRecorder, device: DeviceModel) -> None:
        self.rec = rec
        self.device = device                  # prices each op's work (NOTE [prices from counts] in prices.py)
        self.flop_registry = flop_registry()
        # Every entry carries the innermost module running when the op ran (NOTE [op attribution]).
        # (event index, module, op, pointwise, ns, work ms: the device model's time for its FLOPs and bytes,
        # whether it returned a tensor: metadata queries and remat's own probes (``equal``) return none)
        self.ops: list[tuple[int, str, str, bool, int, float, bool]] = []
        # storages produced by each op's tensor outputs: (record, op, pointwise), for the op-level modes
        self.out_records: list[tuple[StorageRecord, str, bool]] = []
        self.device_moves: list[tuple[int, str, str]] = []  # (event, module, "cpu -> cuda:0")
        self.inplace: list[tuple[int, str, int]] = []     # (event, module, storage key written in place)
        self.rng_ops: list[tuple[int, str, str]] = []     # (event, module, op) ops that draw random numbers
        self.chain: ChainProbe | None = None              # NOTE [single tensor passed along]

    def __call__(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any, ns: int, ev: int) -> None:
        name = _packet(func)
        mod = self.rec.tracker.module
        if self.chain is not None:
            self.chain.read(args, mod)
        pointwise = is_cheap_op(func)   # pointwise or a view (NOTE [op-level policies])
        self.ops.append((ev, mod, name, pointwise, ns, self._work(func, args, kwargs, out), has_tensor(out, func)))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                rec = self.rec.tracker.records.get(t.untyped_storage()._cdata)
                if rec is not None:
                    self.out_records.append((rec, name, pointwise))
        if name in ("_to_copy", "copy_") and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            src = args[1] if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0]
            if src.device != out.device:
                self.device_moves.append((ev, mod, f"{src.device} -> {out.device}"))
        if _draws_random(name, args):
            self.rng_ops.append((ev, mod, name))
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            self.inplace.append((ev, mod, args[0].untyped_storage()._cdata))

    def _work(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> float:
        """The device model's time of one op (ms; NOTE [prices from counts] in prices.py). Only a forward op can
        be replayed; counting the others would cost a FLOP formula each (about 20-90 us)."""
        if self.rec.tracker.phase is not Phase.FORWARD:
            return 0.0
        return op_ms(op_record(func, args, kwargs, out, self.flop_registry), self.device)


def _time_forwards(step: TrainingStep, names: dict[int, str], wanted: set[str], steps: int, start: int,
                   peak: list[PeakMeasurement] | None = None) -> tuple[dict[str, float], list[float]]:
    """Warm median forward ms per candidate (hooks only, no dispatch mode) and step times (ms).

    Device-correct (NOTE [device-correct timing] in remat.clock): on CUDA the hooks
    record events and each step's figures are read after it synchronises, so replay_ms is
    kernel time, not launch time; the step itself is timed by remat.measure's one loop.
    ``peak``: the first timed step also measures the whole-step peak, appended here (only
    where that instrument costs the step nothing measurable: NOTE [peak in a timed step]).
    """
    regions = RegionTimer(model_device(step))

    def pre(m: nn.Module, a: Any) -> None:
        if names.get(id(m)) in wanted:
            regions.start(id(m))

    def post(m: nn.Module, a: Any, o: Any) -> None:
        if names.get(id(m)) in wanted:
            regions.stop(id(m))

    def run(i: int) -> None:
        if peak is not None and i == start:
            peak.append(measure_step_peak(step, i))
        else:
            step.run(i)
        regions.collect()

    h1, h2 = register_module_forward_pre_hook(pre), register_module_forward_hook(post)
    try:
        step_ms = time_steps(step, range(start, start + steps), run=run)
    finally:
        h1.remove()
        h2.remove()
    return {names[k]: percentile(v, 50.0) for k, v in regions.samples.items()}, step_ms


def _phase_peaks(rec: StepRecorder, start_event: int) -> dict[str, int]:
    """Peak live bytes per phase of the recorded step (phase value -> bytes), entry level included."""
    t = rec.tracker
    marks = [m for m in t.marks if m.event >= start_event]
    out: dict[str, int] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].event if i + 1 < len(marks) else t.events
        entry = t.live_after[m.event - 1] if m.event > 0 else 0
        out[m.phase.value] = max(out.get(m.phase.value, 0), entry, *t.live_after[m.event:end])
    return out


def _bwd_window(name: str, windows: dict[str, ModuleWindow]) -> tuple[int | None, int | None]:
    first = last = None
    for n, w in windows.items():
        if (n == name or n.startswith(name + ".")) and w.bwd_first_unpack is not None:
            first = w.bwd_first_unpack if first is None else min(first, w.bwd_first_unpack)
            last = w.bwd_last_unpack if last is None else max(last, w.bwd_last_unpack)
    return first, last


def _rows(rec: StepRecorder, spans: dict[str, list[_Span]], start_event: int) -> list[PeakRow]:
    """Group the baseline's instants by (live, replaying) signature; keep each group's max.

    ``spans``: one span per forward call; a shared module is live once per call held (NOTE [shared modules])."""
    best: dict[tuple[tuple[str, ...], tuple[str, ...]], int] = {}
    live_after = rec.tracker.live_after
    items = [(n, s) for n, calls in sorted(spans.items(), key=lambda kv: kv[1][0][0]) for s in calls]
    for ev in range(start_event, rec.tracker.events):
        live = tuple(n for n, (fs, fe, bs, be) in items if bs is not None and fe <= ev < bs)
        repl = tuple(dict.fromkeys(n for n, (fs, fe, bs, be) in items
                                   if bs is not None and be is not None and bs <= ev <= be))
        key = (live, repl)
        b = live_after[ev]
        if b > best.get(key, -1):
            best[key] = b
    rows = [PeakRow(base_bytes=b, live=k[0], replaying=k[1],
                    label=("backward of " + ", ".join(k[1])) if k[1] else f"{len(k[0])} candidates held")
            for k, b in best.items()]
    return sorted(rows, key=lambda r: -r.base_bytes)  # the planner prunes dominated rows itself


def _inside(w: ModuleWindow, event: int, module: str) -> bool:
    """Did an op seen at tracker ``event`` while ``module`` ran belong to window ``w``?

    NOTE [op attribution]
    Event indices count allocations and frees only, so an op that allocates nothing (an
    in-place ``relu_`` *between* two modules: ``f = a(x).relu_(); b(f)``) carries the
    index of the next allocation, which may be the first event of ``b``'s window. The
    module stack is exact: the op belongs to ``w`` when it ran while ``w``'s module (or
    one nested in it) was the innermost module running, and inside ``w``'s event range.
    """
    paths = getattr(w, "members", None) or (w.name,)    # a segment's region covers its members
    in_module = any(module == p or module.startswith(p + ".") for p in paths)
    return in_module and w.fwd_start <= event <= w.fwd_end


@dataclasses.dataclass(kw_only=True)
class _SegmentRegion:
    """A segment's forward as one window (NOTE [segments]): from its first member's start to its last's end."""

    name: str
    members: tuple[str, ...]
    fwd_start: int
    fwd_end: int
    fwd_start_ns: int
    fwd_end_ns: int
    fwd_peak: int
    input_keys: tuple[int, ...]

    @classmethod
    def of(cls, name: str, members: list[str], windows: dict[str, ModuleWindow]) -> "_SegmentRegion":
        ws = [windows[m] for m in members]
        return cls(name=name, members=tuple(members), fwd_start=ws[0].fwd_start, fwd_end=ws[-1].fwd_end,
                   fwd_start_ns=ws[0].fwd_start_ns, fwd_end_ns=ws[-1].fwd_end_ns,
                   fwd_peak=max(w.fwd_peak for w in ws), input_keys=ws[0].input_keys)


class _EventIndex(Generic[_T]):
    """``items`` in event order (a stable sort: the op log is in event order already), so the items of an
    event range come by bisection."""

    def __init__(self, items: list[_T], event: Callable[[_T], int]) -> None:
        self.items = sorted(items, key=event)
        self.events = [event(x) for x in self.items]

    def between(self, lo: int, hi: int) -> list[_T]:
        """The items whose event is in ``[lo, hi]``, in event order."""
        return self.items[bisect.bisect_left(self.events, lo):bisect.bisect_right(self.events, hi)]


class _StepEvidence:
    """What one recorded baseline step says about any forward window (NOTE [what one profiled step gives])."""

    def __init__(self, rec: StepRecorder, oplog: _OpLog) -> None:
        self.rec = rec
        self.oplog = oplog
        self.packed_at: dict[int, list[int]] = defaultdict(list)   # record id -> pack events
        for s in rec.saved:
            self.packed_at[id(s.record)].append(s.event)
        self.saved_records = {id(s.record): s.record for s in rec.saved if not s.is_param}
        self.packed_keys = {s.key for s in rec.saved}
        self.packed_events: dict[int, list[tuple[int, int]]] = defaultdict(list)   # key -> (event, bytes) of each save
        for s in rec.saved:
            if not s.is_param:
                self.packed_events[s.key].append((s.event, s.nbytes))
        # the op log by event, so a window reads only its own range, not the whole log per window and
        # mode (what that scan cost: benchmarks/RESULTS.md, "Figures moved from docstrings")
        self.ops_by_event = _EventIndex(oplog.ops, lambda op: op[0])
        self.outputs_by_event = _EventIndex(oplog.out_records, lambda out: out[0].alloc_event)
        self._by_key: dict[int, list[StorageRecord]] | None = None   # storage key -> its records, on first use

    def full_saved_bytes(self, w: ModuleWindow) -> tuple[int, int]:
        """(bytes a FULL checkpoint frees until backward, bytes of inputs it keeps that nobody saved)."""
        fs, fe = w.fwd_start, w.fwd_end
        inside = sum(r.nbytes for rid, r in self.saved_records.items()
                     if fs <= r.alloc_event < fe and all(fs <= ev < fe for ev in self.packed_at[rid]))
        live = self.rec.tracker.records
        unsaved_inputs = sum(live[k].nbytes for k in set(w.input_keys) if k in live and k not in self.packed_keys)
        return inside - unsaved_inputs, unsaved_inputs

    def saved_input_bytes(self, w: ModuleWindow) -> int:
        """Bytes of the window's inputs an op inside it saves for backward (an offload copies them too)."""
        fs, fe = w.fwd_start, w.fwd_end
        return sum(max((n for ev, n in self.packed_events.get(k, ()) if fs <= ev <= fe), default=0)
                   for k in set(w.input_keys))

    def host_input_bytes(self, w: ModuleWindow | _SegmentRegion, bwd_end: int | None) -> int:
        """Bytes a FULL_HOST_INPUT segment frees by moving its input to the host: the input's storage when the
        recorded step shows nothing else holds it, else 0 (NOTE [segment input freed]).

        NOTE [segment input freed]
        A segment whose input waits in host memory (NOTE [segment input on the host] in
        remat/wrap/offload.py) drops only its own reference to the input; the device bytes go only
        if nothing else holds them. The recorded baseline step says whether anything does: the
        input (one tensor, the first member's one positional tensor input) counts as freed, its
        whole storage, only when its storage
        - was allocated by the forward (not the batch, not a parameter or buffer, nothing made
          before the step),
        - is saved for backward by no op outside the segment's forward (ReLU saves its output: the
          segment after it frees nothing), and
        - died in the baseline no later than the segment's own backward: before any module's
          backward unpacked a saved tensor after the segment's last one (before the optimizer
          step when none did). A storage something else holds (a module attribute, a list the loss
          keeps) outlives that, and is not counted.
        Otherwise 0, and the planner does not offer the mode (a copy that frees nothing is pure
        cost). Conservative, both ways it can be wrong: the count is made once, on the unplanned
        step, so a holder that a plan would itself remove (the ReLU before the segment, inside
        another checkpointed segment, saves nothing) still makes it 0; a holder the trace cannot
        see (a Python attribute) keeps the storage past the segment's backward, which makes it 0
        too, never larger. What a plan really frees the closed loop measures, as for any plan
        (``tests/test_offload_segment.py`` has both cases against a hand count).
        """
        keys = set(w.input_keys)
        if len(keys) != 1 or bwd_end is None:
            return 0
        rec = self._record_at(w.input_keys[0], w.fwd_start)
        if rec is None or rec.alloc_event < 0 or rec.phase is not Phase.FORWARD or rec.free_event is None:
            return 0
        if any(not (w.fwd_start <= ev <= w.fwd_end) for ev in self.packed_at[id(rec)]):
            return 0   # an op outside the segment saved it: it stays until that op's backward
        later = [e for win in self.rec.windows for e in (win.bwd_first_unpack, win.bwd_last_unpack)
                 if e is not None and e > bwd_end]
        t = self.rec.tracker   # no later unpack: the backward's end (the optimizer's mark), else the step's
        limit = min(later) if later else next((m.event for m in t.marks if m.phase is Phase.OPTIMIZER
                                               and m.event > bwd_end), t.events)
        return rec.nbytes if rec.free_event < limit else 0

    def _record_at(self, key: int, event: int) -> StorageRecord | None:
        """The record of storage ``key`` alive at ``event`` (keys are reused after a free; records are not)."""
        if self._by_key is None:
            self._by_key = defaultdict(list)
            for r in self.rec.tracker.history:
                self._by_key[r.key].append(r)
        return next((r for r in self._by_key.get(key, ())
                     if r.alloc_event <= event and (r.free_event is None or r.free_event > event)), None)

    def policy_figures(self, w: ModuleWindow, mode: CheckpointMode) -> tuple[int, float, int]:
        """(bytes op-level ``mode`` keeps, share of forward time in the ops it keeps, number of ops)
        in the window (NOTE [op-level policies]): SAC caches every kept op's output, saved or not."""
        fs, fe = w.fwd_start, w.fwd_end
        kept = sum({id(r): r.nbytes for r, name, pw in self.outputs_by_event.between(fs, fe - 1)
                    if sac_saves(mode, name, pw)}.values())
        ops = [(sac_saves(mode, name, pw), ns) for ev, mod, name, pw, ns, *_ in self.ops_by_event.between(fs, fe)
               if _inside(w, ev, mod)]
        total_ns = sum(ns for _, ns in ops) or 1
        return kept, sum(ns for keep, ns in ops if keep) / total_ns, len(ops)

    def replay_work(self, w: ModuleWindow | _SegmentRegion, mode: CheckpointMode) -> float:
        """The device model's time (ms) of what a replay of ``w`` in ``mode`` adds: the forward ops it runs again
        (every op for FULL, those an op-level mode does not keep otherwise), and for an op-level mode SAC's
        own cost per op of the region (NOTE [prices from counts] in prices.py, NOTE [SAC op cost])."""
        ops = [(name, pw, work) for ev, mod, name, pw, _, work, tensor_out
               in self.ops_by_event.between(w.fwd_start, w.fwd_end) if tensor_out and _inside(w, ev, mod)]  # type: ignore[arg-type]
        if mode is CheckpointMode.FULL:
            return sum(work for *_, work in ops)
        return (sum(work for name, pw, work in ops if not sac_saves(mode, name, pw))
                + len(ops) * self.oplog.device.sac_op_s * 1e3)

    def forward_rise(self, w: ModuleWindow) -> int:
        """How far live bytes rose above the window's entry level during its forward (bytes)."""
        entry = self.rec.tracker.live_after[w.fwd_start - 1] if w.fwd_start > 0 else 0
        return max(0, w.fwd_peak - entry)

    def hazards(self, w: ModuleWindow, probed: list[HazardRecord]) -> list[HazardRecord]:
        """The probe's findings plus what the op log saw inside the window."""
        out = list(probed)
        moves = [d for ev, mod, d in self.oplog.device_moves if _inside(w, ev, mod)]
        if moves:
            out.append(HazardRecord(kind=HazardKind.DEVICE_MOVE, detail=f"tensor moved inside the region: {moves[0]}"))
        rng = [op for ev, mod, op in self.oplog.rng_ops if _inside(w, ev, mod)]
        if rng and not any(h.kind is HazardKind.RNG for h in out):
            out.append(HazardRecord(kind=HazardKind.RNG, detail=f"draws random numbers in forward ({rng[0]}): "
                                                                "safe while RNG state is preserved"))
        inputs = set(w.input_keys)
        written = [op_mod for ev, op_mod, key in self.oplog.inplace if key in inputs and _inside(w, ev, op_mod)]
        if written:
            where = f" (in {written[0]})" if written[0] != w.name else ""
            out.append(HazardRecord(kind=HazardKind.INPLACE_INPUT,
                                    detail=f"writes in place into one of its inputs{where}"))
        return out


_Span = tuple[int, int, int | None, int | None]   # (fwd start, fwd end, bwd first unpack, bwd last unpack) events


def _chain_probe(model: nn.Module, asked_segments: list[str], *, search: bool) -> ChainProbe | None:
    """The probe that finds chains (NOTE [single tensor passed along]); None when no segment is wanted."""
    if not (search or asked_segments):
        return None
    containers, ends = segment_search(model)
    containers = sorted(set(containers if search else []) | {parse_segment(n).container for n in asked_segments})
    return ChainProbe(model, containers, ends)


# timed steps of the profile (forward ms per module, the baseline step's p50): a median of 3. Each is a
# step of the user's planning time; replays are timed alone after, and what decides between measured
# plans is the frontier's interleaved rounds (NOTE [resolved differences])
PROFILE_REPEATS = 3
# untimed steps before the profile's tracked step: 1, as every measured plan (measure_plan) and every
# later sampled point has: the first step creates the optimizer state and every lazy buffer, so the
# tracked step 1 holds what step 2,000 holds; the profile and the plans it predicts are then measured
# at the same step index. A second warm-up step cost about 1 step-equivalent of a first remat.auto
# (benchmarks/plan_speed.py) and changed no figure the planner reads: on the built-in gpt, cnn and
# mlp, the zoo's hf_llama and timm_convnext and the layerdrop fixture at p = 0, the baseline peak,
# every saved-byte count, the exclusions and `all`'s predicted peak were identical at 1 and 2.
PROFILE_WARMUP = 1


def _forward_times(step: TrainingStep, names: dict[int, str], wanted: set[str], candidate_names: list[str], *,
                   warmup: int, repeats: int,
                   predicted: RuntimePrediction | None) -> tuple[dict[str, float], list[float], PeakMeasurement, int]:
    """(forward ms per module, step times in ms, the baseline's whole-step peak, steps run): measured, or
    the device model's ``predicted`` times.

    NOTE [peak in a timed step]
    The baseline peak is one warm step (index ``warmup``). Where the peak's instrument costs the step
    nothing measurable (the CUDA allocator's counters, or the CPU allocator counter, NOTE [CPU
    allocator counter]: about +1-4% of a step, where the live-tensor tracker costs +10-60%), that
    step is also the first timed one, so the profile runs one step fewer, and so does every arm that
    ``remat.measure.measure_arm`` measures. Under the tracker the peak is a step of its own, as the
    tracker's dispatch mode would slow a timed step. The profile's timed steps are then ``warmup`` ..
    ``warmup + repeats - 1``, else ``warmup + 1`` .. ``warmup + repeats``; either way its recorded
    step is ``warmup + 1 + repeats``.
    """
    if predicted is not None:
        return ({n: predicted.replay_ms(n, CheckpointMode.FULL) for n in candidate_names}, [predicted.step_ms],
                measure_step_peak(step, warmup), 1)
    if repeats >= 1 and peak_costs_nothing(step):
        peak: list[PeakMeasurement] = []
        fwd_ms, step_ms = _time_forwards(step, names, wanted, repeats, warmup, peak=peak)
        return fwd_ms, step_ms, peak[0], repeats
    base = measure_step_peak(step, warmup)
    return (*_time_forwards(step, names, wanted, repeats, warmup + 1), base, repeats + 1)


def _chain_children(chain: ChainProbe | None) -> set[str]:
    """Paths of the children of every container the chain probe watches (none without a probe)."""
    return {p for kids in (chain.children.values() if chain else ()) for p in kids}


def _hazard_probes(modules: dict[str, nn.Module], paths: list[str], *, compare_rng_state: bool) -> dict[str, HazardProbe]:
    """One hazard probe per module path in ``paths`` that names a module."""
    return {n: HazardProbe(modules[n], compare_rng_state=compare_rng_state) for n in paths if n in modules}


def _record_step(step: TrainingStep, names: dict[int, str], probes: dict[str, HazardProbe],
                 chain: ChainProbe | None, steps: int) -> tuple[StepRecorder, _OpLog, int]:
    """Run ``steps`` under a StepRecorder with the op log, hazard probes and chain probe installed.

    Returns (recorder, op log, first tracker event of the recorded step); every hook is removed."""
    pre_h = register_module_forward_pre_hook(lambda m, a: probes[names[id(m)]].before() if names.get(id(m)) in probes else None)
    post_h = register_module_forward_hook(lambda m, a, o: probes[names[id(m)]].after(o) if names.get(id(m)) in probes else None)
    try:
        with StepRecorder(step, names=names) as rec:
            oplog = _OpLog(rec, device_model_for(model_device(step)))
            if chain is not None:
                chain.install(rec.tracker.records)
                oplog.chain = chain
            rec.tracker.op_observer = oplog
            start_event = rec.tracker.events
            rec.run(steps)
            rec.tracker.op_observer = None
    finally:
        pre_h.remove()
        post_h.remove()
        if chain is not None:
            chain.remove()
    return rec, oplog, start_event


@dataclasses.dataclass(kw_only=True)
class _Recorded:
    """The recorded baseline step, read for every candidate (NOTE [what one profiled step gives])."""

    modules: dict[str, nn.Module]
    cand_set: set[str]                       # the module candidates asked for
    fwd_ms: dict[str, float]                 # warm median forward time per module (ms)
    predicted: RuntimePrediction | None      # the device model's times (simulated profiles)
    probes: dict[str, HazardProbe]
    calls: dict[str, int]                    # forward calls per module in the step (replays not counted)
    last_window: dict[str, ModuleWindow]     # each module's last forward call
    windows: dict[str, list[ModuleWindow]]   # each module's forward calls, in order
    evidence: _StepEvidence

    @classmethod
    def of(cls, rec: StepRecorder, oplog: _OpLog, *, modules: dict[str, nn.Module], cand_set: set[str],
           fwd_ms: dict[str, float], predicted: RuntimePrediction | None,
           probes: dict[str, HazardProbe]) -> "_Recorded":
        windows_by_name: dict[str, list[ModuleWindow]] = defaultdict(list)
        for w in rec.windows:
            if not w.in_backward:   # a replay of the model's own checkpoint is not a second call
                windows_by_name[w.name].append(w)
        return cls(modules=modules, cand_set=cand_set, fwd_ms=fwd_ms, predicted=predicted, probes=probes,
                   calls={n: len(ws) for n, ws in windows_by_name.items()},
                   last_window={n: ws[-1] for n, ws in windows_by_name.items()},
                   windows=dict(windows_by_name),
                   evidence=_StepEvidence(rec, oplog))

    def forward_ms(self, name: str) -> float:
        """Module ``name``'s forward time (ms): timed, else its window's wall time in the recorded step."""
        w = self.last_window[name]
        return self.fwd_ms.get(name, (w.fwd_end_ns - w.fwd_start_ns) / 1e6)

    def hazards(self, name: str) -> list[HazardRecord]:
        return self.evidence.hazards(self.last_window[name], self.probes[name].found)


@dataclasses.dataclass(kw_only=True)
class _Offers:
    """What profile_step has decided so far: candidates offered (with their spans) and names excluded."""

    costs: list[CandidateCost] = dataclasses.field(default_factory=list)
    spans: dict[str, list[_Span]] = dataclasses.field(default_factory=dict)   # one per forward call
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)   # name -> reason
    idle: list[str] = dataclasses.field(default_factory=list)           # excluded because they free nothing

    def offer(self, cost: CandidateCost, *spans: _Span) -> None:
        self.costs.append(cost)
        self.spans[cost.name] = list(spans)

    def exclude(self, name: str, reason: str, *, idle: bool = False) -> None:
        self.excluded[name] = reason
        if idle:
            self.idle.append(name)


def _module_exclusion(name: str, calls: int) -> str | None:
    """Why module ``name`` (called ``calls`` times per step) cannot be a candidate, or None."""
    if not re.fullmatch(MODULE_PATH_RE, name):
        return "its name cannot be written in a plan (NOTE [module names]: word characters and - + : @ # ~ = only)"
    if calls == 0:
        return NOT_CALLED   # dynamic control flow across a step sample (NOTE [step sample])
    return None


def _op_policy_costs(seen: _Recorded, name: str, w: ModuleWindow, full_saved: int, t_fwd: float, extra: int,
                     cost: CandidateCost) -> None:
    """Add to ``cost`` the op-level modes that keep something new (NOTE [op-level policies])."""
    offered_kept: set[int] = set()
    for mode in OP_POLICY_MODES:
        if seen.predicted is not None and mode is not CheckpointMode.SELECTIVE:
            continue   # the device model predicts SELECTIVE only
        kept_bytes, save_share, n_ops = seen.evidence.policy_figures(w, mode)
        if kept_bytes <= 0 or not n_ops or kept_bytes in offered_kept:
            continue
        if mode is not CheckpointMode.SELECTIVE and full_saved - kept_bytes <= 0:
            continue
        offered_kept.add(kept_bytes)
        cost.saved_bytes[mode] = full_saved - kept_bytes
        cost.replay_ms[mode] = (t_fwd * (1.0 - save_share)     # first estimate; profile_workload measures it
                                if seen.predicted is None else seen.predicted.replay_ms(name, mode))
        cost.replay_extra_bytes[mode] = extra
        cost.replay_work[mode] = seen.evidence.replay_work(w, mode)


def _offer_module(seen: _Recorded, offers: _Offers, name: str) -> None:
    """Offer module ``name`` with its per-mode costs, or exclude it with the reason."""
    reason = _module_exclusion(name, seen.calls.get(name, 0))
    if reason is not None:
        offers.exclude(name, reason)
        return
    if seen.calls[name] > 1:
        _offer_shared(seen, offers, name)
        return
    w = seen.last_window[name]
    full_saved, unsaved_inputs = seen.evidence.full_saved_bytes(w)
    if full_saved <= 0:
        # checkpointing it can only keep its inputs alive longer: never offer it (
        # single Conv/BN/ReLU layers whose checkpoints raised the measured peak)
        offers.exclude(name, f"frees nothing until backward: it saves {full_saved + unsaved_inputs} bytes of its "
                             f"own for backward, and a checkpoint would keep {unsaved_inputs} bytes of inputs", idle=True)
        return
    extra = max(0, seen.evidence.forward_rise(w) - max(full_saved, 0))
    t_fwd = seen.forward_ms(name)
    cost = CandidateCost(name=name, class_name=type(seen.modules[name]).__name__, order=w.fwd_start,
                         parent=parent_of(name, seen.cand_set), fwd_ms=t_fwd, input_bytes=unsaved_inputs,
                         saved_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: full_saved},
                         replay_ms={CheckpointMode.KEEP: 0.0, CheckpointMode.FULL: t_fwd},
                         replay_extra_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: extra},
                         hazards=seen.hazards(name), saved_input_bytes=seen.evidence.saved_input_bytes(w),
                         replay_work={CheckpointMode.FULL: seen.evidence.replay_work(w, CheckpointMode.FULL)})
    _op_policy_costs(seen, name, w, full_saved, t_fwd, extra, cost)
    offers.offer(cost, (w.fwd_start, w.fwd_end, *_bwd_window(name, seen.last_window)))


def _call_bwd_window(name: str, call: ModuleWindow, windows: dict[str, list[ModuleWindow]]) -> tuple[int | None, int | None]:
    """(first, last) backward unpack event of one forward ``call`` of ``name``, its nested calls included."""
    inside = [w for n, ws in windows.items() if n == name or n.startswith(name + ".") for w in ws
              if call.fwd_start <= w.fwd_start and w.fwd_end <= call.fwd_end and w.bwd_first_unpack is not None]
    if not inside:
        return None, None
    return min(w.bwd_first_unpack for w in inside), max(w.bwd_last_unpack for w in inside)  # type: ignore[type-var]


def _offer_shared(seen: _Recorded, offers: _Offers, name: str) -> None:
    """Offer module ``name``, called N > 1 times per step, costed over all N calls (NOTE [shared modules]).

    NOTE [shared modules]
    A wrapper checkpoints every call of the module it wraps (a block reused N times, a
    siamese encoder run on both inputs, a model called twice per step), so the candidate is
    its N calls together, in FULL mode only (the op-level figures are per call window):
    - each call frees what a one-call checkpoint of its window frees (its own saved tensors,
      less its inputs nobody saved); the candidate's ``saved_bytes`` is N x the *least* of
      them, so that any share of it is never more than the calls it stands for free;
    - each call is held from its forward's end to its own backward (the recorder ties each
      unpack to the call that packed it), so a row lists the candidate once per call held
      there and the cost model subtracts that share of ``saved_bytes`` (NOTE [peak cost
      model] in profile/model.py): at the end of a siamese forward both calls are held,
      during the second tower's backward only the first;
    - replay: N x one call's forward time (``CandidateCost.calls``; a measured replay of one
      call is multiplied the same way), and the largest transient of one call's replay
      (calls replay one at a time, each in its own backward).
    """
    ws = seen.windows[name]
    figures = [seen.evidence.full_saved_bytes(w) for w in ws]
    per_call = min(f for f, _ in figures)
    unsaved_inputs = sum(u for _, u in figures)
    if per_call <= 0:
        offers.exclude(name, f"frees nothing until backward in one of its {len(ws)} calls per step: a checkpoint "
                             f"would keep {unsaved_inputs} bytes of inputs", idle=True)
        return
    extra = max(max(0, seen.evidence.forward_rise(w) - f) for w, (f, _) in zip(ws, figures))
    t_call = (seen.predicted.replay_ms(name, CheckpointMode.FULL) if seen.predicted is not None else
              seen.fwd_ms.get(name, sum(w.fwd_end_ns - w.fwd_start_ns for w in ws) / 1e6 / len(ws)))
    t_fwd = t_call * len(ws)
    once: set[tuple[HazardKind, str]] = set()
    hazards = [h for w in ws for h in seen.evidence.hazards(w, seen.probes[name].found)
               if not ((h.kind, h.detail) in once or once.add((h.kind, h.detail)))]
    cost = CandidateCost(name=name, class_name=type(seen.modules[name]).__name__, order=ws[0].fwd_start,
                         parent=parent_of(name, seen.cand_set), fwd_ms=t_fwd, input_bytes=unsaved_inputs,
                         saved_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: per_call * len(ws)},
                         replay_ms={CheckpointMode.KEEP: 0.0, CheckpointMode.FULL: t_fwd},
                         replay_extra_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: extra},
                         hazards=hazards, calls=len(ws),
                         saved_input_bytes=sum(seen.evidence.saved_input_bytes(w) for w in ws),
                         replay_work={CheckpointMode.FULL: sum(seen.evidence.replay_work(w, CheckpointMode.FULL)
                                                               for w in ws)})
    offers.offer(cost, *[(w.fwd_start, w.fwd_end, *_call_bwd_window(name, w, seen.windows)) for w in ws])


def _segment_members(chain: ChainProbe, asked_segments: list[str], *, search: bool, seen: _Recorded,
                     offers: _Offers) -> dict[str, list[str]]:
    """Segment name -> member paths for the segments to cost (NOTE [segments]): runs of linked
    children, tiled when ``search``, plus the asked ones the step shows are chains (others excluded)."""
    runs = chain.runs()
    offered = [s for c, first, n in runs
               for s in run_segments(c, first, n, children=len(chain.children[c]))] if search else []
    for name in asked_segments:
        seg = parse_segment(name)
        inside = any(c == seg.container and first <= seg.start and seg.stop <= first + n for c, first, n in runs)
        if not inside:
            offers.exclude(name, "not a chain in the profiled step: its modules do not pass one tensor along "
                                 "(NOTE [single tensor passed along])")
        elif seg not in offered:
            offered.append(seg)
    members: dict[str, list[str]] = {}
    for seg in offered:
        kids = chain.children[seg.container][seg.start:seg.stop]
        if str(seg) not in offers.excluded and all(k in seen.last_window for k in kids):
            members[str(seg)] = kids
    return members


def _member_hazards(seen: _Recorded, seg_members: dict[str, list[str]], cost_names: set[str]) -> dict[str, list[HazardRecord]]:
    """Hazards of the segment members that are not candidates themselves (probed members only)."""
    return {m: seen.hazards(m) for ms in seg_members.values() for m in ms if m not in cost_names and m in seen.probes}


def _confirm_suspects(step: TrainingStep, seen: _Recorded, costs: list[CandidateCost],
                      member_hazards: dict[str, list[HazardRecord]], start: int,
                      progress: ProgressFn) -> dict[str, list[str]]:
    """Replay each suspected hazard to confirm it (remat.profile.confirm): keep the confirmed ones on
    ``costs`` and ``member_hazards`` (in place); returns the refuted ones as name -> ["kind: detail"]."""
    progress("profile: confirming hazards", 0, 1)
    suspects = {c.name: c.hazards for c in costs if c.hazards}
    suspects.update({m: hs for m, hs in member_hazards.items() if hs})
    kept, dropped = confirm_hazards(step, seen.modules, suspects, start)
    for c in costs:
        if c.hazards:
            c.hazards = kept.get(c.name, [])
    for m in member_hazards:
        member_hazards[m] = kept.get(m, [])
    progress("profile: confirming hazards", 1, 1)
    return {n: [f"{h.kind.value}: {h.detail}" for h in hs] for n, hs in dropped.items()}


def _members_hooks(kids: list[str], modules: dict[str, nn.Module]) -> list[HazardRecord]:
    """The HOOK hazard of a segment whose members carry user hooks: inside the segment (NOTE [replayed hooks])."""
    found = [h for k in kids for h in module_hooks(modules[k], k)]
    return [HazardRecord(kind=HazardKind.HOOK, detail=hook_detail(found))] if found else []


def _segment_hazards(kids: list[str], modules: dict[str, nn.Module],
                     hazards_of: Callable[[str], list[HazardRecord]]) -> list[HazardRecord]:
    """A segment's hazards: its members', each (kind, detail) once, and the members' own hooks.

    A member's in-place write into its input writes an intermediate of the segment, which the
    segment's replay recreates: only the first member's counts (as for nested candidates)."""
    hazards = [h for i, k in enumerate(kids) for h in hazards_of(k)
               if i == 0 or h.kind is not HazardKind.INPLACE_INPUT]
    hazards += _members_hooks(kids, modules)
    once: set[tuple[HazardKind, str]] = set()
    return [h for h in hazards if not ((h.kind, h.detail) in once or once.add((h.kind, h.detail)))]


def _segment_bwd_span(kids: list[str], last_window: dict[str, ModuleWindow]) -> tuple[int | None, int | None]:
    """(first, last) backward unpack event over a segment's members (None where none unpacked)."""
    firsts = [_bwd_window(k, last_window) for k in kids]
    starts = [a for a, _ in firsts if a is not None]
    ends = [b for _, b in firsts if b is not None]
    return min(starts) if starts else None, max(ends) if ends else None


def _offer_segment(seen: _Recorded, offers: _Offers, name: str, kids: list[str],
                   hazards_of: Callable[[str], list[HazardRecord]]) -> None:
    """Offer segment ``name`` (members ``kids``) with its FULL costs, or exclude it when it frees nothing."""
    region = _SegmentRegion.of(name, kids, seen.last_window)
    full_saved, unsaved_inputs = seen.evidence.full_saved_bytes(region)   # type: ignore[arg-type]
    if full_saved <= 0:
        offers.exclude(name, f"frees nothing until backward: it would keep {unsaved_inputs} bytes of inputs", idle=True)
        return
    t_fwd = sum(seen.forward_ms(k) for k in kids)
    extra = max(0, seen.evidence.forward_rise(region) - full_saved)   # type: ignore[arg-type]
    bwd_start, bwd_end = _segment_bwd_span(kids, seen.last_window)
    offers.offer(CandidateCost(
        name=name, class_name=f"segment of {len(kids)} ({type(seen.modules[kids[0]]).__name__})",
        order=region.fwd_start, parent=parent_of(kids[0], seen.cand_set), fwd_ms=t_fwd, input_bytes=unsaved_inputs,
        saved_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: full_saved},
        replay_ms={CheckpointMode.KEEP: 0.0, CheckpointMode.FULL: t_fwd},
        replay_extra_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: extra},
        hazards=_segment_hazards(kids, seen.modules, hazards_of), members=tuple(kids),
        host_input_bytes=seen.evidence.host_input_bytes(region, bwd_end),   # NOTE [segment input freed]
        replay_work={CheckpointMode.FULL: seen.evidence.replay_work(region, CheckpointMode.FULL)}),
        (region.fwd_start, region.fwd_end, bwd_start, bwd_end))


def _renumber(costs: list[CandidateCost]) -> None:
    """Sort ``costs`` by forward order, number them 0.., and re-parent children of excluded parents."""
    costs.sort(key=lambda c: c.order)
    for i, c in enumerate(costs):
        c.order = i
    kept = {c.name for c in costs}
    for c in costs:  # a parent that was excluded no longer constrains its children
        if c.parent is not None and c.parent not in kept:
            c.parent = parent_of(c.parent, kept - {n for n in kept if is_segment(n)})


def profile_step(step: TrainingStep, candidate_names: list[str], *, warmup: int = PROFILE_WARMUP,
                 repeats: int = PROFILE_REPEATS,
                 runtime: Callable[[int], RuntimePrediction] | None = None, segments: bool = False,
                 progress: ProgressFn = no_progress) -> ProfileReport:
    """Profile ``candidate_names`` on ``step`` (NOTE [what one profiled step gives]).

    ``runtime``: a simulated step's predicted times (remat.simulate): under FakeTensorMode
    wall clocks mean nothing, so forward/replay ms come from the device model instead.
    ``segments``: also search for segment candidates (NOTE [segments]); segment names among
    ``candidate_names`` (``blocks[2:5]``) are offered when the step shows they are chains.
    Simulated profiles offer no segments.
    """
    model = step.workload.model
    names = {id(m): n for n, m in model.named_modules()}
    modules = dict(model.named_modules())
    asked_segments = [n for n in candidate_names if is_segment(n)]
    candidate_names = [n for n in candidate_names if not is_segment(n)]
    cand_set = set(candidate_names)
    chain = _chain_probe(model, asked_segments, search=segments) if runtime is None else None
    chain_children = _chain_children(chain)
    warm_up(step, warmup, progress=progress, what=f"profile: warm-up ({warmup} steps)")
    predicted = runtime(warmup + 1) if runtime is not None else None
    fwd_ms, step_ms, base, steps_run = _forward_times(step, names, cand_set | chain_children, candidate_names,
                                                      warmup=warmup, repeats=repeats, predicted=predicted)
    progress(f"profile: peak and timing ({steps_run} steps)", 1, 1)

    probes = _hazard_probes(modules, [*candidate_names, *sorted(chain_children - cand_set)],
                            compare_rng_state=runtime is None)
    rec, oplog, start_event = _record_step(step, names, probes, chain, warmup + 1 + repeats)
    progress("profile: saved tensors (1 recorded step)", 1, 1)

    seen = _Recorded.of(rec, oplog, modules=modules, cand_set=cand_set, fwd_ms=fwd_ms, predicted=predicted,
                        probes=probes)
    offers = _Offers()
    for name in candidate_names:
        _offer_module(seen, offers, name)
    seg_members = (_segment_members(chain, asked_segments, search=segments, seen=seen, offers=offers)
                   if chain is not None else {})
    member_hazards = _member_hazards(seen, seg_members, {c.name for c in offers.costs})
    refuted: dict[str, list[str]] = {}
    if runtime is None:   # fake tensors cannot be compared: simulated profiles keep suspicions
        refuted = _confirm_suspects(step, seen, offers.costs, member_hazards, warmup + 1 + repeats + 1, progress)
    final_hazards = {c.name: c.hazards for c in offers.costs}
    for name, kids in seg_members.items():
        _offer_segment(seen, offers, name, kids, lambda k: final_hazards.get(k, member_hazards.get(k, [])))
    _renumber(offers.costs)
    kept = {c.name for c in offers.costs}
    rows, untracked = _with_untracked(_rows(rec, {n: s for n, s in offers.spans.items() if n in kept}, start_event),
                                      base)
    return ProfileReport(candidates=offers.costs, rows=rows, excluded=offers.excluded,
                         baseline_peak_bytes=base.peak_bytes, baseline_step_ms=percentile(step_ms, 50.0),
                         memory_source=base.source, fingerprint=fingerprint(model), refuted_hazards=refuted,
                         phase_peak_bytes=_phase_peaks(rec, start_event), idle=offers.idle, untracked_bytes=untracked)


def _with_untracked(rows: list[PeakRow], base: PeakMeasurement) -> tuple[list[PeakRow], int]:
    """``rows`` with the baseline's untracked bytes added to each base, and those bytes.

    NOTE [untracked bytes]
    The rows come from the recorded step's live-tensor tracker: tensor bytes. The CPU allocator
    counter (NOTE [CPU allocator counter]) measures the baseline and every plan, and also sees what
    never becomes a tensor: a oneDNN convolution's workspace, a kernel's temporaries, the RNG state
    a checkpoint keeps. On the tiny test cnn that is 10% of the step (a plan predicted 1171704 B
    measured 1289464 B), on gpt and mlp a few bytes. So the gap at the baseline's peak (the counter's
    peak less the rows' largest base, never negative) is added to every row: the unplanned step is
    then predicted exactly, and every plan carries the same allowance, which is what a workspace
    needed wherever the peak falls costs. It is a first-order correction (a plan whose peak moves to
    another kernel meets another workspace; each checkpointed region also keeps an RNG state): on
    that cnn it took the predictions of ``all``, ``uniform:2`` and a 90% plan from 0.878, 0.898 and
    0.948 of their measured peaks to 0.928, 0.941 and 0.993. The closed loop still measures every
    plan it ships.
    The baseline's peak step and the recorded step are two steps (indices ``warmup`` and
    ``warmup + 1 + repeats``; the recorded step cannot be the counted one, its hazard probes
    allocate output snapshots: on that cnn the recorded step counted 258672 B over its tensors). On
    a model whose steps differ (layerdrop) the gap is then another step's work, not an instrument's:
    the zoo's Wav2Vec2 took a skipped layer's activations for untracked bytes, its floor rose over
    its budget and it was refused. So a gap larger than the tracker's known error (NOTE [peaks at
    the edge]: 3% of the baseline, at least 2 MiB) is not added; the closed loop measures as before.
    On CUDA the allocator and the tracker differ as well (block rounding, library workspaces); no
    allowance is added there (not measured on a GPU in this change), and the closed loop's margin
    takes up the difference as before.
    """
    if base.source is not MemorySource.CPU_ALLOCATOR or not rows:
        return rows, 0
    untracked = max(0, base.peak_bytes - max(r.base_bytes for r in rows))
    if untracked > tracker_error_bytes(base.peak_bytes):   # another step's work, not the instrument's
        return rows, 0
    return [dataclasses.replace(r, base_bytes=r.base_bytes + untracked) for r in rows], untracked


def profile_simulated(spec: str | LoadedWorkload, shape: dict | None = None, *, dtype: str = "float32",
                      target_device: str = "cpu", candidates: list[str] | None = None, warmup: int = 2,
                      progress: ProgressFn = no_progress) -> ProfileReport:
    """Profile under FakeTensorMode at any shape, times from a device model.

    Bytes are exact storage bytes of the same step (remat.simulate); ms are roofline
    predictions for ``target_device``. Nothing is allocated, so a 1B-parameter model at a
    long sequence plans on a laptop.
    """
    from ..simulate import estimate_step_runtime, load_simulated
    sim = load_simulated(spec, shape, dtype=dtype, target_device=target_device)
    step = sim.training_step()
    with sim.session():
        names = resolve_candidates(sim.loaded.workload.model, candidates)
        report = profile_step(step, names, warmup=warmup, progress=progress,
                              runtime=lambda k: estimate_step_runtime(step, sim.device_model, k))
    report.simulated = True
    report.device_model = sim.device_model.name
    report.memory_source = MemorySource.SIMULATED
    return report


def replay_step_index(warmup: int, repeats: int) -> int:
    """The step whose forward the replay stage captures its inputs from: the one after
    ``profile_workload``'s recorded step (``warmup + 1 + repeats``), hazard confirmation and dry runs
    (``warmup + repeats + 3``), on the same build."""
    return warmup + repeats + 4


def profile_workload(loaded: LoadedWorkload, *, candidates: list[str] | None = None, warmup: int = PROFILE_WARMUP,
                     repeats: int = PROFILE_REPEATS, measure_replays: bool = True, segments: bool = True,
                     dry_run_settled: frozenset[str] = frozenset(), step: TrainingStep | None = None,
                     progress: ProgressFn = no_progress) -> ProfileReport:
    """Profile every candidate of ``loaded`` (auto-discovered unless named) on its real step.

    ``segments``: search for segment candidates when none are named (NOTE [segments]); False
    offers per-module boundaries only (what torch's per-module checkpoint_wrapper can express).

    ``measure_replays``: measure each (candidate, mode)'s replay cost alone (NOTE [measured
    replay costs]); False prices every counted mode from its work scaled by the timed forwards (NOTE [prices
    from counts]), faster and blind to what a replay costs beyond its ops.

    ``dry_run_settled``: candidates an earlier sampled step's dry runs already settled (NOTE [step
    sample]); only the others are dry-run here.

    ``step``: the training step to profile on (``loaded``'s model, its optimizer and its state as an
    earlier sampled step left them: NOTE [one build per shape]); None: a new one on ``loaded``.
    """
    step = step if step is not None else TrainingStep(loaded.workload)
    names = resolve_candidates(loaded.workload.model, candidates)
    report = profile_step(step, names, warmup=warmup, repeats=repeats, segments=segments and not candidates,
                          progress=progress)
    if loaded.ranks is not None:
        _full_only(report)
    unsettled = [c for c in report.candidates if c.name not in dry_run_settled]
    label = f"profile: dry runs of each mode ({len(unsettled)} candidates, identical ones in one step)"
    progress(label, 0, 1)
    exclude_failing_modes(report, dry_run_modes(step, unsettled, warmup + repeats + 3, ranks=loaded.ranks)
                          if unsettled else {})
    progress(label, 1, 1)
    if measure_replays:
        offered = [c for c in report.candidates if c.name not in report.excluded]
        label = f"profile: replay costs ({len(offered)} candidates, identical regions timed once)"
        apply_replay_measurements(report, *measure_replay_costs(
            step, offered, replay_step_index(warmup, repeats),
            progress=lambda done, total: progress(label, done, total)))
    # NOTE [prices from counts], [sane replay prices], [stable prices] in profile/prices.py: unmeasured, the
    # timed forwards set the counted prices' scale
    sane_replay_prices(report)
    return report


def apply_replay_measurements(report: ProfileReport, measured: dict[str, dict[CheckpointMode, ReplayEstimate]],
                              unmeasured: dict[str, str]) -> None:
    """Replace the first estimates by measured replay costs (NOTE [measured replay costs]), with spreads."""
    for c in report.candidates:
        for mode, est in measured.get(c.name, {}).items():
            if mode in c.replay_ms:
                c.replay_ms[mode] = est.ms * c.calls      # one call's replay, each call (NOTE [shared modules])
                c.replay_spread_ms[mode] = est.spread_ms * c.calls
            if est.extra_bytes is not None and mode in c.replay_extra_bytes:
                c.replay_extra_bytes[mode] = est.extra_bytes     # NOTE [measured replay bytes]
            if est.below_resolution:
                report.replay_below_resolution.setdefault(c.name, []).append(mode.value)
            if est.shared_from is not None:
                report.replay_shared[c.name] = est.shared_from
            if est.composed_from:
                report.replay_composed[c.name] = list(est.composed_from)
            if est.extra_between:
                report.replay_extra_between[c.name] = list(est.extra_between)
    report.replay_unmeasured = dict(unmeasured)


def _full_only(report: ProfileReport) -> None:
    """In a torchrun job (remat.auto on a model wrapped by DDP/FSDP2, profiled in place: NOTE [wrapped
    models in place]) only FULL is offered. An op-level (SAC) mode that fails does so in backward, and a
    backward that raises on the job's own model leaves DDP's reducer waiting and FSDP2's reduce-scatters
    half issued, so the ranks' next collectives no longer match (measured: a gloo size mismatch)."""
    why = "not offered in a torchrun job: an op-level mode failing its dry run mid-backward desynchronises the ranks"
    for c in report.candidates:
        for mode in [m for m in c.saved_bytes if m is not CheckpointMode.KEEP and m is not CheckpointMode.FULL]:
            _drop_mode(report, c, mode, why)


def _drop_mode(report: ProfileReport, c: CandidateCost, mode: CheckpointMode, why: str) -> None:
    """Take ``mode`` out of candidate ``c`` (its bytes and times), recording why in ``report.mode_excluded``."""
    for table in (c.saved_bytes, c.replay_ms, c.replay_extra_bytes):
        table.pop(mode, None)
    report.mode_excluded.setdefault(c.name, {})[mode.value] = why


DRY_RUN_FAILED = "checkpointing it fails in a dry run"   # the exclusion's reason, then the error


def exclude_failing_modes(report: ProfileReport, failures: dict[str, dict[CheckpointMode, str]]) -> None:
    """Take the modes that failed a dry run out of ``report`` (NOTE [mode dry runs]), with reasons."""
    for c in report.candidates:
        failed = failures.get(c.name, {})
        if CheckpointMode.FULL in failed:
            report.excluded[c.name] = f"{DRY_RUN_FAILED}: {failed[CheckpointMode.FULL]}"
        else:
            for mode, error in failed.items():
                _drop_mode(report, c, mode, f"{mode.value} mode fails in a dry run: {error}")
