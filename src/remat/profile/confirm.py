"""Confirming suspected replay hazards by replaying the candidate: evidence, not suspicion.

NOTE [confirmed hazards]
The profiled step raises *suspicions*: an op wrote in place into a candidate's input, a
Python attribute (a tensor-valued one included) changed during its forward, a buffer that
no guard restores changed, a module global or closure cell its code names changed (NOTE
[code state] in hazards.py).
None of them is evidence that checkpointing the candidate changes training:
``ReLU(inplace=True)`` writes into its input, yet replaying it gives the same output; a
module that caches a shape in an attribute sets the same value again. What matters is
whether the *replay* (the forward that non-reentrant checkpoint re-runs during backward,
on the same argument objects, with the RNG state of the first forward) differs from the
first forward. So in one more step, right after each suspect's forward returns, remat
replays it exactly that way (torch's, Python's and numpy's generators rewound: NOTE [host
RNG]) and compares outputs (bitwise for integer tensors, 1e-5 relative for floating ones),
simple and tensor-valued Python attributes, buffers, globals and closure cells with what
the first forward left. A suspicion the replay reproduces is kept, with the difference as its
evidence; one the replay does not reproduce is dropped (a false alarm). Everything the
replay touches is put back (RNG state, buffers, Python attributes, globals, input values),
so the step goes on as it would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..host_rng import HostRng, rewound
from ..types import HazardKind
from ..workload.contract import TrainingStep
from .hazards import TensorValue, tensors_in, changed_code_state, code_state, python_state, restore_code_state
from .model import HazardRecord

# The suspicions a replay can confirm or refute (RNG is handled by preserving RNG state,
# guardable BatchNorm buffers by the guard, device moves are kept as reported).
CONFIRMABLE = (HazardKind.INPLACE_INPUT, HazardKind.PYTHON_STATE, HazardKind.BUFFER_MUTATION, HazardKind.GLOBAL_STATE)


def needs_confirmation(h: HazardRecord) -> bool:
    return h.kind in CONFIRMABLE and not (h.kind is HazardKind.BUFFER_MUTATION and h.guardable)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    """None when the two outputs agree; else what differs (for the hazard's evidence)."""
    if len(a) != len(b):
        return f"{len(a)} output tensors, replay gave {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"output {i}: {tuple(x.shape)} {x.dtype}, replay gave {tuple(y.shape)} {y.dtype}"
        if x.is_floating_point() or x.is_complex():
            if not torch.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True):
                return f"output {i} differs on replay (max |diff| {float((x - y).abs().max()):.3g})"
        elif not torch.equal(x, y):
            return f"output {i} differs on replay"
    return None


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


@dataclasses.dataclass
class _Frame:
    """What one suspect's first forward saw and left (filled by the pre/post hooks)."""

    rng_cpu: torch.Tensor
    rng_cuda: list[torch.Tensor] | None
    host_rng: HostRng                 # Python's and numpy's generators (NOTE [host RNG])
    python_before: dict[str, Any]


@dataclasses.dataclass(kw_only=True)
class _Observed:
    """What one forward of a suspect left: its output tensors, simple Python attributes, buffers."""

    out: list[torch.Tensor]
    python: dict[str, Any]
    buffers: dict[str, torch.Tensor]
    code: dict[str, Any]               # globals and closure cells (NOTE [code state])


def _output_verdict(first: _Observed, replay: _Observed) -> str | None:
    return _max_diff(first.out, replay.out)


def _python_verdict(first: _Observed, replay: _Observed) -> str | None:
    changed = [f"{k}: {first.python.get(k)!r} after the forward, {replay.python.get(k)!r} after a replay"
               for k in sorted(first.python.keys() | replay.python.keys())
               if first.python.get(k) != replay.python.get(k)]
    return "; ".join(changed[:3]) or None


def _buffer_verdict(first: _Observed, replay: _Observed) -> str | None:
    changed = [n for n, b in replay.buffers.items() if n in first.buffers and not torch.equal(b, first.buffers[n])]
    return f"{', '.join(changed[:3])} changed again on replay" if changed else None


def _code_verdict(first: _Observed, replay: _Observed) -> str | None:
    changed = changed_code_state(first.code, replay.code)
    return f"{'; '.join(changed[:3])} (after the forward -> after a replay)" if changed else None


# Per confirmable kind: the replay's difference from the first forward (evidence), None when it has none.
_VERDICTS = {HazardKind.INPLACE_INPUT: _output_verdict, HazardKind.PYTHON_STATE: _python_verdict,
             HazardKind.BUFFER_MUTATION: _buffer_verdict, HazardKind.GLOBAL_STATE: _code_verdict}


@contextlib.contextmanager
def _rng_rewound(frame: _Frame) -> Iterator[None]:
    """Generators as the first forward found them (``frame``) for the duration, then as it left them."""
    rng_after = torch.get_rng_state()
    cuda_after = torch.cuda.get_rng_state_all() if frame.rng_cuda is not None else None
    torch.set_rng_state(frame.rng_cpu)
    if frame.rng_cuda is not None:
        torch.cuda.set_rng_state_all(frame.rng_cuda)
    try:
        with rewound(frame.host_rng):
            yield
    finally:
        torch.set_rng_state(rng_after)
        if cuda_after is not None:
            torch.cuda.set_rng_state_all(cuda_after)


class ReplayConfirmer:
    """Replays each suspect right after its forward in one step (NOTE [confirmed hazards])."""

    def __init__(self, modules: dict[str, nn.Module], suspects: dict[str, list[HazardRecord]]) -> None:
        self.modules = {n: modules[n] for n in suspects}
        self.suspects = suspects
        self.verdicts: dict[str, dict[HazardKind, str | None]] = {n: {} for n in suspects}
        self._frames: dict[str, _Frame] = {}
        self._replaying = False
        self._handles: list[Any] = []

    def __enter__(self) -> "ReplayConfirmer":
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post_hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, name: str):  # noqa: ANN202
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._replaying or name in self._frames:
                return None
            cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
            self._frames[name] = _Frame(rng_cpu=torch.get_rng_state(), rng_cuda=cuda, host_rng=HostRng.capture(),
                                        python_before=python_state(module))
            return None
        return pre

    def _post_hook(self, name: str):  # noqa: ANN202
        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            frame = self._frames.get(name)
            if self._replaying or frame is None or self.verdicts[name]:
                return None
            self._replaying = True
            try:
                self.verdicts[name] = self._replay(name, module, args, kwargs, output, frame)
            finally:
                self._replaying = False
            return None
        return post

    def _replay(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any,
                frame: _Frame) -> dict[HazardKind, str | None]:
        """Run ``module``'s forward again as a checkpoint would and judge each suspicion of ``name``."""
        first = _Observed(out=[t.detach().clone() for t in tensors_in(output)], python=python_state(module),
                          buffers=_buffers(module), code=code_state(module))
        inputs = [t for t in tensors_in((args, kwargs))]
        with _rng_rewound(frame):
            replay = self._rerun(module, args, kwargs, first, inputs)
        return {h.kind: _VERDICTS[h.kind](first, replay) for h in self.suspects[name] if h.kind in _VERDICTS}

    def _rerun(self, module: nn.Module, args: tuple, kwargs: dict, first: _Observed,
               inputs: list[torch.Tensor]) -> _Observed:
        """The replay's output, Python attributes and buffers; everything it touched is put back to ``first``."""
        inputs_after = [t.detach().clone() for t in inputs]
        # The replay sees the same storages (an in-place write by the first forward is visible,
        # as it is to checkpoint's recompute) through detached aliases, so an in-place op of the
        # replay cannot rewrite the step's autograd graph; version counters are put back so no
        # tensor the step saved looks modified.
        detached = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        with contextlib.ExitStack() as versions:
            for t in [*inputs, *module.buffers()]:
                versions.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
            try:
                with torch.enable_grad():
                    out = [t.detach() for t in tensors_in(module.forward(*detached[0], **detached[1]))]
                return _Observed(out=out, python=python_state(module), buffers=_buffers(module),
                                 code=code_state(module))
            finally:
                self._put_back(module, first.python, first.buffers, inputs, inputs_after)
                restore_code_state(module, first.code)

    @staticmethod
    def _put_back(module: nn.Module, python_after: dict[str, Any], buffers_after: dict[str, torch.Tensor],
                  inputs: list[torch.Tensor], inputs_after: list[torch.Tensor]) -> None:
        with torch.no_grad():   # version counters: see the caller's ExitStack
            for n, b in module.named_buffers():
                if n in buffers_after and not torch.equal(b, buffers_after[n]):
                    b.detach().copy_(buffers_after[n])
            for t, v in zip(inputs, inputs_after):
                if not torch.equal(t, v):
                    t.detach().copy_(v)
        _put_back_attributes(module, python_after)


def _put_back_attributes(module: nn.Module, python_after: dict[str, Any]) -> None:
    """Simple and tensor-valued attributes as ``python_after`` (python_state's snapshot) has them."""
    for key, value in python_after.items():
        if isinstance(value, tuple):   # a container's length: not restorable
            continue
        owner_path, _, attr = key.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        now = getattr(owner, attr, value)
        if (TensorValue.of(now) if isinstance(now, torch.Tensor) else now) != value:
            setattr(owner, attr, value.tensor if isinstance(value, TensorValue) else value)


def confirm_hazards(step: TrainingStep, modules: dict[str, nn.Module], candidates: dict[str, list[HazardRecord]],
                    step_index: int) -> tuple[dict[str, list[HazardRecord]], dict[str, list[HazardRecord]]]:
    """Replay every candidate with a confirmable suspicion once (NOTE [confirmed hazards]).

    ``candidates``: name -> hazards found by the profiled step. Returns ``(kept, dropped)``:
    per candidate, the hazards to keep (confirmed ones with the replay's evidence appended,
    plus those that need no confirmation) and the suspicions the replay refuted.
    """
    suspects = {n: [h for h in hs if needs_confirmation(h)] for n, hs in candidates.items()}
    suspects = {n: hs for n, hs in suspects.items() if hs}
    if not suspects:
        return dict(candidates), {}
    with ReplayConfirmer(modules, suspects) as confirmer:
        step.run(step_index)
    kept: dict[str, list[HazardRecord]] = {}
    dropped: dict[str, list[HazardRecord]] = {}
    for name, hazards in candidates.items():
        verdict = confirmer.verdicts.get(name, {})
        for h in hazards:
            if not needs_confirmation(h):
                kept.setdefault(name, []).append(h)
            elif h.kind not in verdict:   # never ran in the confirming step: keep the suspicion
                kept.setdefault(name, []).append(h)
            elif verdict[h.kind] is None:
                dropped.setdefault(name, []).append(h)
            else:
                kept.setdefault(name, []).append(dataclasses.replace(
                    h, detail=f"{h.detail}; confirmed by a replay: {verdict[h.kind]}"))
    return kept, dropped
