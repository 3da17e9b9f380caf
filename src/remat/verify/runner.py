"""Paired control vs planned runs, negative controls, RNG policy and overhead: ``verify_plan``.

NOTE [paired runs]
Control and planned model are two fresh builds of the same workload
(``LoadedWorkload.rebuild``: the loader seeds model init, and we check the two builds
are bitwise equal before stepping). Each side has its own optimizer and its own copy of
every global generator (torch CPU/CUDA, Python ``random``, NumPy): both start from the
same seeded state, and before each step a side's generators are restored, after it
saved, so the two runs interleave step by step in one process yet each sees exactly the
random stream it would see alone. Step k of both sides is then compared: loss, the
root module's outputs, every parameter gradient, the global gradient norm, parameters
after ``optimizer.step()``, every buffer, every Python attribute of every module, and
the generators' states. After the training steps one eval-mode step (forward and
backward, no optimizer step) is compared the same way. The process's own generator
states are restored when verification ends.

NOTE [hazards vs divergence]
A difference inside a checkpointed region that survives the step (a buffer, a Python
attribute, a generator advanced by the replay) is a *hazard*, reported with the boundary
and the state that changed (``blocks.2.calls: 1 -> 2``,
``blocks.0.bn1.num_batches_tracked: +2 instead of +1``). Device moves inside a region are
hazards too. Any hazard, any out-of-tolerance step, a negative control that is not
rejected, or a control that does not repeat itself fails verification.

NOTE [verify under compile]
With ``compile`` both sides run compiled (remat.measure.compile_model): the control is the
compiled unplanned step, the plan the compiled planned step, compared with
COMPILED_TOLERANCES (NOTE [compiled tolerances] in model.py). Each role (control, plan, plan
with RNG preservation off) has one compiled function shared by every seed's build, so a role
compiles once, not once per pair. Nothing remat adds runs *inside* the compiled region: no
per-module forward hooks (output digests) and no region probe (a dispatch mode would make
Dynamo run the frame eagerly, and a hook is traced into the graph and changes it). What stays:
loss, every gradient, the global grad norm, parameters after the step, buffers, Python
attributes and generator states, all read outside the compiled code; the first divergent
module is then named from the gradients, in parameter order. The negative controls run
compiled too and must still be rejected, with one exception: a checkpoint traced into the
compiled graph (NOTE [wrapper under compile] in remat/wrap/wrapper.py) replays its random ops
from the forward's RNG state whatever ``preserve_rng_state`` says, so when that control matches
under compile it is reported as not applicable, not as a failure; the perturbed-gradient control
still has to be rejected. Verification under compile starts and ends with
``torch._dynamo.reset()``: Dynamo's guards do not cover inductor's config, so a graph compiled
earlier in the process (by the frontier, with inductor's own random kernels) would otherwise be
reused. Every compiled side runs under
``random_ops_in_program_order`` (NOTE [compiled arms], *Random numbers*): inductor's own
random kernels draw other masks in any two different graphs, so without it a dropout model's
compiled plan could never match its compiled control; the report's warnings say so.

NOTE [deterministic kernels]
On CUDA several backward kernels accumulate with atomics (embedding and index_add backward,
some cuBLAS reductions with a split workspace), so the *unmodified* step need not repeat
itself bitwise, and checkpointing could not be told apart from nondeterminism. ``verify_plan`` therefore runs every pair on a CUDA workload under
``torch.use_deterministic_algorithms(True, warn_only=True)`` with cuDNN's deterministic
algorithms and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set only when the user has not set it),
and restores all three afterwards. ``warn_only``: an op with no deterministic kernel still
runs, and the repeatability check then says so instead of a crash. On CPU nothing changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..wrap import ApplyHandle, apply, check_plan_fingerprint, load_plan
from ..errors import RematError, UserCodeError, WorkloadError
from ..measure import CompiledFunction, CompileSpec, compile_model, random_ops_in_program_order, time_round_robin
from ..plan.model import Plan
from ..profile.hazards import hook_detail, hooks_inside
from ..types import CheckpointMode, HazardKind, ProgressFn, no_progress
from ..workload import LoadedWorkload, TrainingStep
from .compare import (TensorDiff, boundary_of, changed_attributes, clone_tensors, diff_tensor, diff_tensors, largest_magnitude,
                      owner_module, python_state, short_repr, tolerance_for)
from .model import (PERTURBATION, TOLERANCES, BoundaryActivity, Hazard, NegativeControl, RngPolicy, RngTiming,
                    RngPolicyKind, RunMode, Site, StepComparison, Tolerance, VerifyReport, tolerance_table)
from ..host_rng import RngState, seed_everything
from .probe import RegionProbe, StepRecorder

__all__ = ["GradientPerturbation", "measure_rng_overhead", "verify_plan"]

Fault = Callable[[nn.Module], str | None]  # perturbs a model's grads after backward; returns what it did


# -- one side of a pair ----------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class _StepState:
    loss: torch.Tensor
    outputs: list[torch.Tensor]
    digests: list[Any]
    grad_order: list[str]
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor] | None
    buffers_before: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    pystate_before: dict[str, Any]
    pystate: dict[str, Any]
    rng: RngState
    calls: dict[str, tuple[int, int]]  # boundary -> (forward calls, replay calls) this step
    fault: str | None


class _Side:
    """A fresh build, optionally planned, stepped with its own generators (NOTE [paired runs])."""

    def __init__(self, loaded: LoadedWorkload, plan: Plan | None, *, fault: Fault | None = None,
                 probe: bool = False, stack: contextlib.ExitStack, compiled: CompiledFunction | None = None) -> None:
        self.workload = loaded.workload
        self.model = loaded.workload.model
        self.handle: ApplyHandle | None = None
        if plan is not None:
            self.handle = apply(self.model, plan, check_fingerprint=False)  # checked once in verify_plan
            stack.callback(self._remove)
        if compiled is not None:   # NOTE [verify under compile]: nothing of remat's inside the compiled region
            stack.callback(compile_model(self.model, compiled))
        self.trainer = TrainingStep(self.workload)
        self.fault = fault
        self.recorder = StepRecorder(self.model, record_grad_order=True)
        if compiled is None:
            stack.enter_context(self.recorder)
        self.probe = stack.enter_context(RegionProbe(self.handle)) if (probe and self.handle and compiled is None) else None
        self.rng: RngState | None = None
        self.buffers = clone_tensors(self.model.named_buffers())
        self.pystate = python_state(self.model)

    def _remove(self) -> None:
        if self.handle is not None and self.handle.active:
            self.handle.remove()

    def step(self, step: int, mode: RunMode) -> _StepState:
        assert self.rng is not None
        self.rng.restore()
        self.recorder.reset()
        if self.handle is not None:
            self.handle.reset_counts()
        training = {m: m.training for m in self.model.modules()}
        if mode is RunMode.EVAL:
            self.model.eval()
        try:
            batch = self.trainer.batch(step)
            loss = self.trainer.forward(batch)
            self.trainer.backward(loss)
            fault = self.fault(self.model) if self.fault is not None else None
            grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.model.named_parameters()}
            if mode is RunMode.TRAIN:
                self.trainer.optimizer_step()
            self.trainer.optimizer.zero_grad(set_to_none=True)
        finally:
            for m, flag in training.items():
                m.training = flag
        before, self.buffers = self.buffers, clone_tensors(self.model.named_buffers())
        py_before, self.pystate = self.pystate, python_state(self.model)
        self.rng = RngState.capture()
        calls = {w.path: (w.forward_calls, w.replay_calls) for w in self.handle.wrappers} if self.handle else {}
        return _StepState(
            loss=loss.detach().clone(), outputs=list(self.recorder.outputs),
            digests=list(self.recorder.digests), grad_order=list(self.recorder.grad_order), grads=grads,
            params=clone_tensors(self.model.named_parameters()) if mode is RunMode.TRAIN else None,
            buffers_before=before, buffers=self.buffers, pystate_before=py_before, pystate=self.pystate, rng=self.rng,
            calls=calls, fault=fault)


def _check_same_init(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        if name not in sb or not torch.equal(sa[name], sb[name]):
            raise WorkloadError(f"two builds of the workload differ at {name!r}: the control cannot be paired",
                                tip="make the factory deterministic (remat seeds torch before building; seed "
                                    "python random / numpy too if your init uses them)")


# -- comparing one step ----------------------------------------------------------------------------

def _model_tolerance(model: nn.Module, table: dict[str, Tolerance] = TOLERANCES) -> Tolerance:
    for p in model.parameters():
        tol = tolerance_for(p.dtype, table)
        if tol is not None:
            return tol
    return table["float32"]


def _param_tolerances(table: dict[str, Tolerance], optimizer: torch.optim.Optimizer) -> dict[str, Tolerance]:
    """Parameters after the optimizer step, under compile (NOTE [compiled tolerances]): atol 2 x the
    largest learning rate. Adam-family steps move each element by about lr x sign(grad) early on, so
    a gradient element within rounding of zero, whose sign the two compiled graphs disagree on, moves
    a parameter by up to 2 lr while every gradient agrees to 1e-5. Gradients are compared at the
    plain tolerance (the perturbed-gradient control is caught there)."""
    lrs = [float(g["lr"]) for g in optimizer.param_groups
           if isinstance(g.get("lr"), (int, float, torch.Tensor)) and not isinstance(g.get("lr"), bool)]
    step = 2.0 * max(lrs, default=0.0)
    return {k: dataclasses.replace(v, atol=max(v.atol, step)) for k, v in table.items()}


class _Compiled:
    """The compiled functions of one verification, one per role (NOTE [verify under compile]); None: eager."""

    def __init__(self, spec: CompileSpec | None, autocast: str | None = None) -> None:
        self.spec = spec
        self.functions: dict[str, CompiledFunction] = {}
        # the tolerances of this verification (NOTE [compiled tolerances], NOTE [autocast tolerances])
        self.table = tolerance_table(compiled=spec is not None, autocast=autocast)

    def role(self, name: str) -> CompiledFunction | None:
        """The control compiles at torch's default activation_memory_budget; the plan's roles at
        the plan's own (a torch-budget plan is the unplanned model compiled at another ratio)."""
        if self.spec is None:
            return None
        if name not in self.functions:
            spec = dataclasses.replace(self.spec, memory_budget=None) if name == "control" else self.spec
            self.functions[name] = CompiledFunction(spec)
        return self.functions[name]


_EAGER = _Compiled(None)


def _grad_norm(grads: dict[str, torch.Tensor | None]) -> float:
    norms = [g.detach().double().norm() for g in grads.values() if g is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms)).cpu()) if norms else 0.0


def _max(diffs: list[TensorDiff], attr: str) -> float:
    return max((getattr(d, attr) for d in diffs), default=0.0)


def _buffer_hazard(name: str, d: TensorDiff, c: _StepState, p: _StepState) -> str | None:
    """What a replay did to buffer ``name`` *in this step*, or None if it only carries an earlier difference.

    NOTE [hazards vs divergence]: once a buffer differs, later steps differ too; a hazard is
    reported at the step where the planned run's change first departs from the control's.
    """
    ca, pa, cb, pb = c.buffers[name], p.buffers[name], c.buffers_before.get(name), p.buffers_before.get(name)
    if cb is None or pb is None or cb.shape != ca.shape or pb.shape != pa.shape:
        return f"{name}: replaced with a different tensor ({list(ca.shape)} -> {list(pa.shape)})"
    equal_before = torch.equal(cb, pb)
    if not ca.is_floating_point() and not ca.is_complex():
        dc, dp = ca - cb, pa - pb
        if not equal_before and torch.equal(dc, dp):
            return None
        if dc.numel() == 1:
            return f"{name}: {int(dp):+d} instead of {int(dc):+d}"
        return f"{name}: changed by up to {int(dp.abs().max()):+d} instead of {int(dc.abs().max()):+d}"
    if equal_before:
        return f"{name}: differs from the control by up to {d.max_abs:.3g} (rel {d.max_rel:.2g})"
    c_changed, p_changed = not torch.equal(ca, cb), not torch.equal(pa, pb)
    if c_changed == p_changed:
        return None
    return f"{name}: changed in the {'planned run' if p_changed else 'control'} only"


def _attribute_hazard(key: str, ca: Any, pa: Any, c: _StepState, p: _StepState) -> str | None:
    """Like :func:`_buffer_hazard` for a Python attribute: ``blocks.2.calls: 1 -> 2``."""
    cb, pb = c.pystate_before.get(key, "<absent>"), p.pystate_before.get(key, "<absent>")
    if cb == pb:
        return f"{key}: {short_repr(ca)} -> {short_repr(pa)}"
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ca, pa, cb, pb))
    if numbers:
        dc, dp = ca - cb, pa - pb
        return None if dc == dp else f"{key}: {dp:+g} instead of {dc:+g} this step ({ca} -> {pa})"
    if (ca != cb) == (pa != pb):
        return None
    return f"{key}: {short_repr(ca)} -> {short_repr(pa)}"


@dataclasses.dataclass(kw_only=True)
class _Compared:
    step: StepComparison
    hazards: list[Hazard]


@dataclasses.dataclass(kw_only=True)
class _StepDiffs:
    """Every difference between a control step and a planned step (NOTE [paired runs])."""

    loss: TensorDiff
    outputs: list[TensorDiff]
    grads: list[TensorDiff]
    params: list[TensorDiff]
    buffers: list[TensorDiff]
    grad_norm: tuple[float, float]            # (control, planned)
    grad_norm_ok: bool
    changed: list[tuple[str, Any, Any]]       # Python attributes: (key, control value, planned value)
    rng: list[str]                            # generators whose state differs

    @property
    def tensors(self) -> list[TensorDiff]:
        return [self.loss, *self.outputs, *self.grads, *self.params, *self.buffers]

    def divergent(self) -> list[str]:
        """Names of what is out of tolerance, in report order."""
        out = [d.name for d in self.tensors if not d.ok]
        out += [] if self.grad_norm_ok else ["grad_norm"]
        out += [f"python {k}: {short_repr(a)} -> {short_repr(b)}" for k, a, b in self.changed]
        return out + [f"rng {g}" for g in self.rng]


def _grad_norm_ok(norm_c: float, norm_p: float, tol: Tolerance) -> bool:
    """Do the global gradient norms agree (both NaN counts as agreeing)?"""
    return (norm_c == norm_p or (math.isnan(norm_c) and math.isnan(norm_p))
            or (math.isfinite(norm_p) and tol.allows(abs(norm_p - norm_c), abs(norm_c))))


def _diff_step(c: _StepState, p: _StepState, tol: Tolerance, table: dict[str, Tolerance],
               param_table: dict[str, Tolerance] | None) -> _StepDiffs:
    """Compare everything one step leaves behind; ``param_table`` is set under compile only."""
    if len(c.outputs) == len(p.outputs):
        outputs = [diff_tensor(f"output[{i}]", a, b, table) for i, (a, b) in enumerate(zip(c.outputs, p.outputs))]
    else:
        outputs = [diff_tensor("outputs", None, torch.zeros(()))]
    # NOTE [cancelled gradients]: under compile a gradient that cancels to ~0 is compared at the model's scale
    grads = diff_tensors("grad", c.grads, p.grads, table,
                         scale=largest_magnitude(c.grads) if param_table is not None else None)
    params = diff_tensors("param", c.params, p.params, param_table or table) \
        if c.params is not None and p.params is not None else []
    norm = (_grad_norm(c.grads), _grad_norm(p.grads))
    return _StepDiffs(loss=diff_tensor("loss", c.loss, p.loss, table), outputs=outputs, grads=grads, params=params,
                      buffers=diff_tensors("buffer", c.buffers, p.buffers, table), grad_norm=norm,
                      grad_norm_ok=_grad_norm_ok(*norm, tol), changed=changed_attributes(c.pystate, p.pystate),
                      rng=c.rng.differences(p.rng))


@dataclasses.dataclass(kw_only=True)
class _HazardSite:
    """Where hazards of one compared step are reported: its seed, step and mode, and the plan's boundaries."""

    seed: int
    step: int
    mode: RunMode
    boundaries: list[str]

    def hazard(self, module: str, kind: HazardKind, state: str, detail: str) -> Hazard:
        return Hazard(module=module, kind=kind, detail=detail, mode=self.mode, seed=self.seed, step=self.step,
                      state=state)


def _buffer_hazards(diffs: _StepDiffs, c: _StepState, p: _StepState, site: _HazardSite,
                    probe: RegionProbe | None) -> list[Hazard]:
    """Buffers inside a boundary that the planned step changed differently (NOTE [hazards vs divergence])."""
    replay_mut = set().union(*(s.replay_mutations for s in probe.stats.values())) if probe else set()
    out: list[Hazard] = []
    for d in diffs.buffers:
        name = d.tensor
        b = boundary_of(owner_module(name), site.boundaries)
        detail = None if (d.ok or b is None or name not in p.buffers) else _buffer_hazard(name, d, c, p)
        if detail is None:
            continue
        if name in replay_mut:
            detail += " (changed again by the replay)"
        out.append(site.hazard(b, HazardKind.BUFFER_MUTATION, name, detail))
    return out


def _attribute_hazards(diffs: _StepDiffs, c: _StepState, p: _StepState, site: _HazardSite) -> list[Hazard]:
    """Python attributes inside a boundary that the planned step changed differently."""
    out: list[Hazard] = []
    for key, ca, pa in diffs.changed:
        b = boundary_of(owner_module(key), site.boundaries)
        detail = None if b is None else _attribute_hazard(key, ca, pa, c, p)
        if detail is not None:
            out.append(site.hazard(b, HazardKind.PYTHON_STATE, key, detail))
    return out


def _rng_hazards(rng: list[str], site: _HazardSite, probe: RegionProbe | None) -> list[Hazard]:
    """Generators left in another state than the control's, with the boundaries whose replay drew."""
    if not rng:
        return []
    drawers = sorted(k for k, s in (probe.stats.items() if probe else []) if s.rng_draws_replay)
    states = " and ".join(rng)
    return [site.hazard(", ".join(drawers) or "(not attributed)", HazardKind.RNG, states,
                        f"{states} generator state after the step differs from the control"
                        + (f": the replay of {', '.join(drawers)} drew from the live generator" if drawers else ""))]


def _step_comparison(diffs: _StepDiffs, c: _StepState, p: _StepState, site: _HazardSite,
                     first: tuple[str | None, Site | None]) -> StepComparison:
    """The report's record of one compared step; ``first``: (first divergent module, where), or Nones."""
    divergent = diffs.divergent()
    return StepComparison(
        seed=site.seed, step=site.step, mode=site.mode, loss=(float(c.loss), float(p.loss)),
        outputs_max_abs=_max(diffs.outputs, "max_abs") if diffs.outputs else None,
        grad_max_abs=_max(diffs.grads, "max_abs"), grad_max_rel=_max(diffs.grads, "max_rel"),
        grads_bitwise=all(d.bitwise for d in diffs.grads), grad_norm=diffs.grad_norm,
        params_max_abs=_max(diffs.params, "max_abs") if c.params is not None else None,
        buffers_max_abs=_max(diffs.buffers, "max_abs"),
        bitwise=all(d.bitwise for d in diffs.tensors), divergent=divergent,
        first_divergent_module=first[0], first_divergence=first[1], passed=not divergent)


def _compare(c: _StepState, p: _StepState, *, seed: int, step: int, mode: RunMode, boundaries: list[str],
             tol: Tolerance, probe: RegionProbe | None, table: dict[str, Tolerance] = TOLERANCES,
             param_table: dict[str, Tolerance] | None = None) -> _Compared:
    diffs = _diff_step(c, p, tol, table, param_table)
    first: tuple[str | None, Site | None] = (None, None)
    if diffs.divergent():
        first = _first_divergence(c, p, diffs, tol)
    site = _HazardSite(seed=seed, step=step, mode=mode, boundaries=boundaries)
    hazards = [*_buffer_hazards(diffs, c, p, site, probe), *_attribute_hazards(diffs, c, p, site),
               *_rng_hazards(diffs.rng, site, probe)]
    return _Compared(step=_step_comparison(diffs, c, p, site, first), hazards=hazards)


def _forward_divergence(c: _StepState, p: _StepState, tol: Tolerance) -> tuple[str, Site] | None:
    """The first module whose forward call order or output digest differs, or None."""
    for (path_c, dc), (path_p, dp) in zip(c.digests, p.digests):
        if path_c != path_p:
            return path_c or "(root)", Site.CALL_ORDER
        if not dc.close_to(dp, tol.rtol, tol.atol):
            return path_c or "(root)", Site.FORWARD_OUTPUT
    if len(c.digests) != len(p.digests):
        return "(root)", Site.CALL_ORDER
    return None


def _failing(diffs: list[TensorDiff]) -> list[str]:
    return [d.tensor for d in diffs if not d.ok]


def _first_divergence(c: _StepState, p: _StepState, diffs: _StepDiffs, tol: Tolerance) -> tuple[str | None, Site]:
    """NOTE [first divergent module] in remat.verify.probe."""
    forward = _forward_divergence(c, p, tol)
    if forward is not None:
        return forward
    bad_grads = set(_failing(diffs.grads))
    order = c.grad_order + [n for n in c.grads if n not in c.grad_order]   # backward order, then the rest
    for names, site in (([n for n in order if n in bad_grads], Site.GRADIENT), (_failing(diffs.buffers), Site.BUFFER),
                        ([k for k, _, _ in diffs.changed], Site.PYTHON_ATTRIBUTE),
                        (_failing(diffs.params), Site.PARAMETER)):
        if names:
            return owner_module(names[0]) or "(root)", site
    return None, Site.GENERATOR if diffs.rng else Site.LOSS_OR_OUTPUTS


# -- a pair of runs --------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class _PairResult:
    comparisons: list[StepComparison]
    hazards: list[Hazard]
    activity: list[BoundaryActivity]
    error: str | None             # the planned side raised (message), else None
    faults: list[str]             # what the fault did, per step

    @property
    def rejected(self) -> bool:
        return self.error is not None or bool(self.hazards) or any(not s.passed for s in self.comparisons)

    def reason(self) -> str:
        if self.error is not None:
            return f"the planned step raised {self.error}"
        bad = [s for s in self.comparisons if not s.passed]
        if bad:
            s = bad[0]
            return f"seed {s.seed} step {s.step} ({s.mode}): {', '.join(s.divergent[:3])} out of tolerance{_where(s)}"
        if self.hazards:
            return f"hazard in {self.hazards[0].module}: {self.hazards[0].detail}"
        return "no difference from the control"


# NOTE [a planned step that raises]
# The control just ran the same step of the same seed without raising, so when the planned
# side raises, checkpointing made the difference (torch's CheckpointError: the replay saved
# other tensors than the forward; a replay that took another branch): a finding, counted
# like a divergence (a negative control that raises is *rejected*), never a crash of verify.
# The workload's code raising surfaces as UserCodeError (call_user); remat's own errors
# (RematError otherwise: a bad plan, a fingerprint) still propagate.


def _failure_text(exc: BaseException) -> str:
    """``Type: first line`` of what the planned step raised: the workload code's exception, not remat's wrapper."""
    cause = exc.__cause__ if isinstance(exc, UserCodeError) and exc.__cause__ is not None else exc
    first = str(cause).splitlines()[0] if str(cause) else ""
    return f"{type(cause).__name__}: {first}"


def _run_pair(loaded: LoadedWorkload, plan: Plan | None, *, seed: int, steps: int, eval_pass: bool,
              fault: Fault | None = None, tick: Callable[[], None] = lambda: None,
              compiled: _Compiled = _EAGER, role: str = "plan") -> _PairResult:
    """Control vs ``plan`` (None: the control again) for ``steps`` steps of ``seed`` (NOTE [paired runs])."""
    comparisons: list[StepComparison] = []
    hazards: list[Hazard] = []
    faults: list[str] = []
    calls: dict[str, dict[str, tuple[int, int]]] = {}
    error: str | None = None
    boundaries = [b.module for b in plan.boundaries] if plan is not None else []
    with contextlib.ExitStack() as stack:
        control = _Side(loaded.rebuild(), None, stack=stack, compiled=compiled.role("control"))
        planned = _Side(loaded.rebuild(), plan, fault=fault, probe=True, stack=stack,
                        compiled=compiled.role(role if plan is not None else "control"))
        _check_same_init(control.model, planned.model)
        tol = _model_tolerance(control.model, compiled.table)
        param_table = _param_tolerances(compiled.table, control.trainer.optimizer) if compiled.spec else None
        seed_everything(seed)
        control.rng = planned.rng = RngState.capture()
        schedule = [(k, RunMode.TRAIN) for k in range(steps)] + ([(steps, RunMode.EVAL)] if eval_pass else [])
        for k, mode in schedule:
            c = control.step(k, mode)
            try:
                p = planned.step(k, mode)
            except UserCodeError as exc:   # NOTE [a planned step that raises]
                error = _failure_text(exc)
                break
            except RematError:
                raise
            except Exception as exc:
                error = _failure_text(exc)
                break
            if p.fault:
                faults.append(p.fault)
            calls.setdefault(mode.value, p.calls)
            res = _compare(c, p, seed=seed, step=k, mode=mode, boundaries=boundaries, tol=tol, probe=planned.probe,
                           table=compiled.table, param_table=param_table)
            comparisons.append(res.step)
            hazards += res.hazards
            tick()
        activity = _activity(plan, planned.probe, calls) if plan is not None else []
        for a in activity:
            hazards += [Hazard(module=a.module, kind=HazardKind.DEVICE_MOVE, detail=f"{m} inside the region", seed=seed,
                               state=m.partition(":")[0])   # the op, from RegionProbe's own "op: src -> dst (phase)"
                        for m in a.device_moves]
    return _PairResult(comparisons=comparisons, hazards=hazards, activity=activity, error=error, faults=faults)


def _activity(plan: Plan, probe: RegionProbe | None, calls: dict[str, dict[str, tuple[int, int]]]) -> list[BoundaryActivity]:
    out = []
    for b in plan.boundaries:
        st = probe.stats.get(b.module) if probe is not None else None
        out.append(BoundaryActivity(
            module=b.module, mode=b.mode, guarded=b.guarded,
            forward_calls={m: c[b.module][0] for m, c in calls.items() if b.module in c},
            replay_calls={m: c[b.module][1] for m, c in calls.items() if b.module in c},
            draws_rng=bool(st and st.rng_draws_forward), replay_mutations=sorted(st.replay_mutations) if st else [],
            device_moves=list(st.device_moves) if st else []))
    return out


# -- negative controls, RNG ------------------------------------------------------------------------

class GradientPerturbation:
    """Fault for the perturbed-gradient control: scale the largest gradient by ``1 + rel``."""

    def __init__(self, rel: float) -> None:
        self.rel = rel
        self.param: str | None = None

    def __call__(self, model: nn.Module) -> str | None:
        best, best_max = None, 0.0
        for name, p in model.named_parameters():
            if p.grad is not None and p.grad.is_floating_point():
                m = float(p.grad.detach().abs().max())
                if m > best_max:
                    best, best_max = (name, p), m
        if best is None:
            return None
        self.param = best[0]
        with torch.no_grad():
            best[1].grad.mul_(1.0 + self.rel)
        return f"grad {best[0]} x (1 + {self.rel:g})"


def _perturbation_for(model_tol: Tolerance) -> float:
    return max(PERTURBATION, 4.0 * model_tol.rtol)  # NOTE [tolerances]


def _rng_policy(plan: Plan, drawers: list[str]) -> RngPolicy:
    if plan.preserve_rng_state:
        why = ("RNG state is stashed at each boundary's forward and restored for its replay, so dropout masks "
               f"repeat exactly ({', '.join(drawers)} draw random numbers)" if drawers else
               "RNG state is stashed and restored around each replay; no planned boundary draws random numbers")
        return RngPolicy(preserve_rng_state=True, policy=RngPolicyKind.PRESERVE, justification=why,
                         boundaries_drawing_rng=tuple(drawers))
    why = (f"preservation is off, but {', '.join(drawers)} draw random numbers: replays see other masks" if drawers
           else "preservation is off; no planned boundary draws random numbers, so replays need no RNG state")
    return RngPolicy(preserve_rng_state=False, policy=RngPolicyKind.OFF, justification=why, boundaries_drawing_rng=tuple(drawers))


class _RngVariant:
    """The planned step on one shared build, applied with or without RNG preservation for each step
    (a remat.measure Runner: the round-robin scheduler alternates the two, so drift hits both alike)."""

    def __init__(self, trainer: TrainingStep, plan: Plan, preserve: bool, tick: Callable[[], None]) -> None:
        self.label = "preserve" if preserve else "off"
        self.trainer = trainer
        self.plan = dataclasses.replace(plan, preserve_rng_state=preserve)
        self.tick = tick if preserve else (lambda: None)   # one tick per round

    @property
    def device(self) -> torch.device:
        return next((p.device for p in self.trainer.workload.model.parameters()), torch.device("cpu"))

    def run(self, index: int) -> float:
        with apply(self.trainer.workload.model, self.plan, check_fingerprint=False):
            loss = self.trainer.run(index)
        self.tick()
        return loss


def measure_rng_overhead(loaded: LoadedWorkload, plan: Plan, *, steps: int = 10, warmup: int = 2,
                         tick: Callable[[], None] = lambda: None) -> RngTiming:
    """Warm whole-step time of the planned step with and without ``preserve_rng_state`` (ms, p50/p95).

    One fresh build; remat.measure's round-robin scheduler times one step per variant per
    round (batch, forward, backward, optimizer), alternating which variant goes first.
    """
    lw = loaded.rebuild()
    trainer = TrainingStep(lw.workload)
    variants = [_RngVariant(trainer, plan, True, tick), _RngVariant(trainer, plan, False, tick)]
    t = time_round_robin(variants, warmup=warmup, steps=steps, what="verify: RNG timing")
    return RngTiming(with_ms=t.p50("preserve"), without_ms=t.p50("off"), with_p95_ms=t.p95("preserve"),
                     without_p95_ms=t.p95("off"), steps=steps)


# -- the entry point -------------------------------------------------------------------------------

@contextlib.contextmanager
def deterministic_kernels(device: str | torch.device):
    """Deterministic CUDA kernels for the duration (NOTE [deterministic kernels]); a no-op on CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    old_alg, old_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    old_cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    set_env = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    if set_env:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_alg, warn_only=old_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old_cudnn
        if set_env:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


class _Progress:
    """Ticks of one verification: one per compared step, control repeat, negative-control step and timing."""

    def __init__(self, progress: ProgressFn, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0

    def tick(self) -> None:
        self.done += 1
        self.progress("verify", min(self.done, self.total), self.total)

    def finish(self) -> None:
        self.progress("verify", self.total, self.total)


@dataclasses.dataclass(kw_only=True)
class _PairedRuns:
    """What every seed's control/planned pair found (NOTE [paired runs])."""

    per_step: list[StepComparison]
    hazards: list[Hazard]
    activity: list[BoundaryActivity]
    failures: list[str]        # the planned step raised, per seed


def _paired_runs(loaded: LoadedWorkload, plan: Plan, seeds: list[int], steps: int, tick: Callable[[], None],
                 compiled: _Compiled) -> _PairedRuns:
    """Every seed's pair, plus one eager pair for boundary activity under compile."""
    out = _PairedRuns(per_step=[], hazards=[], activity=[], failures=[])
    for seed in seeds:
        res = _run_pair(loaded, plan, seed=seed, steps=steps, eval_pass=True, tick=tick, compiled=compiled)
        out.per_step += res.comparisons
        out.hazards += res.hazards
        out.activity = out.activity or res.activity
        if res.error is not None:
            out.failures.append(f"seed {seed}: the planned step raised {res.error}")
    if compiled.spec is not None and plan.boundaries:
        # NOTE [verify under compile]: the region probe cannot run inside compiled code, so which
        # boundaries draw random numbers, replay, or move devices is observed on one eager pair
        eager = _run_pair(loaded, plan, seed=seeds[0], steps=1, eval_pass=False)
        out.activity = eager.activity
        out.hazards += [h for h in eager.hazards if h.kind is HazardKind.DEVICE_MOVE]
    return out


def _where(s: StepComparison) -> str:
    """``"; first divergent module m (site)"``, or "" when none was named."""
    return f"; first divergent module {s.first_divergent_module} ({s.first_divergence})" \
        if s.first_divergent_module else ""


def _divergence_failure(per_step: list[StepComparison]) -> list[str]:
    """The failure line for the compared steps out of tolerance (none when all passed)."""
    bad = [s for s in per_step if not s.passed]
    if not bad:
        return []
    s = bad[0]
    more = f" and {len(s.divergent) - 4} more" if len(s.divergent) > 4 else ""
    return [f"{len(bad)} of {len(per_step)} compared steps differ from the control; first: seed "
            f"{s.seed} step {s.step} ({s.mode}): {', '.join(s.divergent[:4])}{more} out of tolerance{_where(s)}"]


def _control_repeats(loaded: LoadedWorkload, seed: int, steps: int, tick: Callable[[], None],
                     compiled: _Compiled) -> tuple[bool, list[str]]:
    """Positive control: the unmodified step must repeat itself, or no difference means anything.

    Returns (repeatable, its failure line if not)."""
    repeat = _run_pair(loaded, None, seed=seed, steps=steps, eval_pass=False, tick=tick, compiled=compiled)
    if not repeat.rejected:
        return True, []
    return False, [f"the control does not repeat itself with the same seed ({repeat.reason()}): "
                   "checkpointing cannot be told apart from nondeterminism"]


def _negative_controls(loaded: LoadedWorkload, plan: Plan, drawers: list[str], seed: int, steps: int, rel: float,
                       tick: Callable[[], None], compiled: _Compiled) -> tuple[list[NegativeControl], list[str]]:
    """(the negative controls, a failure line for each that applied and was not rejected)."""
    negative = [_rng_off_control(loaded, plan, drawers, seed, steps, tick, compiled),
                _perturbed_control(loaded, plan, seed, rel, tick, compiled)]
    return negative, [f"negative control {n.name} was not rejected: {n.detail}" for n in negative
                      if n.applicable and not n.rejected]


def _first_divergent_module(per_step: list[StepComparison], hazards: list[Hazard]) -> str | None:
    """The first failing step's divergent module, else the first hazard's boundary."""
    first = next((s.first_divergent_module for s in per_step if not s.passed and s.first_divergent_module), None)
    if first is None and hazards:
        first = hazards[0].module
    return first


def _verify_warnings(loaded: LoadedWorkload, compiled: bool, per_step: list[StepComparison]) -> list[str]:
    """What the report cannot vouch for: compiled-code blind spots, and non-finite control gradients."""
    warnings = [] if not compiled else [
        "compiled: per-module output digests and the region probe do not run inside compiled code; boundary "
        "activity (replays, RNG draws, device moves) was observed on one eager pair",
        "compiled: random ops ran torch's eager kernels (inductor fallback_random), drawing from the generator "
        "in program order on both sides; the timed compiled arms keep inductor's own random kernels"]
    return warnings + [f"the control's global gradient norm is {s.grad_norm[0]} from seed {s.seed} step {s.step} "
                       f"({s.mode}, {loaded.dtype}): comparisons after that point agree vacuously"
                       for s in _first_non_finite_per_seed(per_step)]


def _hook_hazards(model: nn.Module, plan: Plan) -> list[Hazard]:
    """The user's hooks a boundary's replay fires again (NOTE [replayed hooks] in profile/hazards.py): a
    double count is invisible to the paired comparison, so verify looks for the hooks themselves."""
    named = dict(model.named_modules())
    found = {b.module: hooks_inside(named[b.module]) for b in plan.boundaries
             if b.module in named and b.mode is not CheckpointMode.OFFLOAD}   # offload replays nothing
    return [Hazard(module=name, kind=HazardKind.HOOK, detail=hook_detail(hooks), state="hooks")
            for name, hooks in found.items() if hooks]


def _verify(loaded: LoadedWorkload, plan: Plan, *, steps: int, seeds: int, timing_steps: int, compiled: _Compiled,
            ticks: _Progress) -> VerifyReport:
    """verify_plan's runs and report, inside its kernel and RNG settings."""
    seed_values = list(range(seeds))
    pairs = _paired_runs(loaded, plan, seed_values, steps, ticks.tick, compiled)
    hazards = _dedupe(pairs.hazards + _hook_hazards(loaded.workload.model, plan))
    failures = pairs.failures + _divergence_failure(pairs.per_step)
    failures += [f"hazard in {h.module} ({h.kind.value}, {h.mode}): {h.detail}" for h in hazards]
    repeatable, not_repeated = _control_repeats(loaded, seed_values[0], steps, ticks.tick, compiled)
    failures += not_repeated
    # an offloaded boundary never replays (NOTE [activation offload]): its draws need no preserved RNG
    drawers = sorted(a.module for a in pairs.activity if a.draws_rng and a.mode is not CheckpointMode.OFFLOAD)
    tol = _model_tolerance(loaded.workload.model, compiled.table)
    negative, not_rejected = _negative_controls(loaded, plan, drawers, seed_values[0], min(steps, 2),
                                                _perturbation_for(tol), ticks.tick, compiled)
    failures += not_rejected
    # the RNG-preservation timing re-applies the plan around each step on one build: eager only
    timing = measure_rng_overhead(loaded, plan, steps=timing_steps, tick=ticks.tick) \
        if timing_steps and compiled.spec is None else None
    ticks.finish()
    return VerifyReport(
        passed=not failures, workload=loaded.spec, shape=dict(loaded.shape), device=loaded.device,
        dtype=loaded.dtype, planner=plan.planner, plan_digest=plan.fingerprint.digest, steps=steps,
        seeds=seed_values, tolerances=dict(compiled.table), perturbation=_perturbation_for(tol),
        per_step=pairs.per_step, first_divergent_module=_first_divergent_module(pairs.per_step, hazards),
        rng_policy=_rng_policy(plan, drawers), rng_timing=timing, hazards=hazards, negative_controls=negative,
        boundaries=pairs.activity, repeatable=repeatable, failures=failures,
        warnings=_verify_warnings(loaded, compiled.spec is not None, pairs.per_step),
        compile=None if compiled.spec is None else compiled.spec.to_json(), autocast=loaded.autocast)


def verify_plan(loaded: LoadedWorkload, plan: Plan | str | Path, *, steps: int = 3, seeds: int = 3,
                timing_steps: int = 10, compile: CompileSpec | None = None,
                progress: ProgressFn = no_progress) -> VerifyReport:
    """Prove (or refute) that ``plan`` applied to ``loaded`` is the same training procedure as the control.

    Runs ``seeds`` paired control/planned runs of ``steps`` steps plus an eval step each
    (NOTE [paired runs]), a repeatability check of the control, the negative controls
    (RNG preservation off; one gradient perturbed), and times RNG preservation
    (``timing_steps`` per variant, 0 to skip). Returns the report; call
    ``report.raise_if_failed()`` to turn a failure into :class:`VerificationFailed`.
    ``compile``: both sides compiled, compared with COMPILED_TOLERANCES (NOTE [verify under
    compile]); a plan made with ``--compile`` (``plan.compile``) is verified compiled.
    """
    plan = load_plan(plan)
    if compile is None:
        compile = plan.compile
    compiled = _Compiled(compile, loaded.autocast)
    if steps < 1 or seeds < 1 or timing_steps < 0:
        raise RematError(f"steps and seeds must be >= 1 and timing_steps >= 0 (got {steps}, {seeds}, {timing_steps})")
    check_plan_fingerprint(loaded.workload.model, plan)
    total = seeds * (steps + 1) + steps + min(steps, 2) + 1 + (timing_steps + 2 if timing_steps else 0)
    outer_rng = RngState.capture()
    if compile is not None:
        torch._dynamo.reset()   # NOTE [verify under compile]: nothing compiled under other settings is reused
    try:
        with deterministic_kernels(loaded.device), \
                (random_ops_in_program_order() if compile is not None else contextlib.nullcontext()):
            return _verify(loaded, plan, steps=steps, seeds=seeds, timing_steps=timing_steps, compiled=compiled,
                           ticks=_Progress(progress, total))
    finally:
        outer_rng.restore()
        if compile is not None:
            torch._dynamo.reset()   # and nothing compiled with eager random kernels outlives it


def _rng_off_control(loaded: LoadedWorkload, plan: Plan, drawers: list[str], seed: int, steps: int,
                     tick: Callable[[], None], compiled: _Compiled = _EAGER) -> NegativeControl:
    name = "rng_preservation_off"
    if not drawers:
        return NegativeControl(name=name, applicable=False, rejected=None,
                               detail="not applicable: no planned boundary draws random numbers in its forward "
                                      "(every generator's state was unchanged across each boundary's forward)")
    res = _run_pair(loaded, dataclasses.replace(plan, preserve_rng_state=False), seed=seed, steps=steps,
                    eval_pass=False, tick=tick, compiled=compiled, role="plan-rng-off")
    if compiled.spec is not None and not res.rejected:
        # NOTE [verify under compile]: a checkpoint traced into the compiled graph replays its random
        # ops from the forward's RNG state whatever preserve_rng_state says, so this control cannot
        # fail there: it ran, matched, and is reported as not applicable rather than as a failure
        return NegativeControl(name=name, applicable=False, rejected=None,
                               detail="not applicable under compile: the plan with preserve_rng_state=False "
                                      "matched the control (torch.compile's checkpoint regions replay random ops "
                                      "from the forward's RNG state, whatever preserve_rng_state says)")
    return NegativeControl(name=name, applicable=True, rejected=res.rejected,
                           detail=f"same plan with preserve_rng_state=False: {res.reason()}")


def _perturbed_control(loaded: LoadedWorkload, plan: Plan, seed: int, rel: float,
                       tick: Callable[[], None], compiled: _Compiled = _EAGER) -> NegativeControl:
    name = "perturbed_gradient"
    fault = GradientPerturbation(rel)
    res = _run_pair(loaded, plan, seed=seed, steps=1, eval_pass=False, fault=fault, tick=tick, compiled=compiled)
    if fault.param is None:
        return NegativeControl(name=name, applicable=False, rejected=None,
                               detail="not applicable: every gradient is zero or missing")
    caught = any(f"grad {fault.param}" in s.divergent for s in res.comparisons)
    return NegativeControl(name=name, applicable=True, rejected=caught and res.rejected,
                           detail=f"{res.faults[0] if res.faults else fault.param}: {res.reason()}")


def _first_non_finite_per_seed(per_step: list[StepComparison]) -> list[StepComparison]:
    out: dict[int, StepComparison] = {}
    for s in per_step:
        if s.seed not in out and not math.isfinite(s.grad_norm[0]):
            out[s.seed] = s
    return list(out.values())


def _dedupe(hazards: list[Hazard]) -> list[Hazard]:
    """One hazard per (module, kind, state, mode): the first occurrence."""
    seen: set[tuple[str, HazardKind, str, RunMode]] = set()
    out = []
    for h in hazards:
        key = (h.module, h.kind, h.state, h.mode)
        if key not in seen:
            seen.add(key)
            out.append(h)
    return out

