"""Instrumentation for one traced step: live bytes + module windows + saved tensors.

``StepRecorder`` stacks three instruments and restores every hook it installs on exit
(the mem_tracker.py style): the live-tensor tracker (bytes), global module forward hooks
(which module is running: attribution and forward windows), and saved-tensor hooks (which
storages autograd keeps for backward, packed by which module, and when backward unpacks
them: the backward window of each module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from contextlib import ExitStack
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..memory.measure import optimizer_state_tensors, track_step_state
from ..memory.tracker import LiveTensorTracker, StorageRecord
from ..types import MemCategory, Phase
from ..workload.contract import TrainingStep


# NOTE [saved-tensor hooks and identity]
# With any ``saved_tensors_hooks`` active, a tensor saved by a custom autograd Function comes
# back from ``ctx.saved_tensors`` as a *new* Python object, even when the hooks return it
# unchanged. Non-reentrant checkpoint saves its region's inputs that way and replays the
# region from them, so ``attn(h, h, h)`` is replayed as three distinct tensors and
# ``nn.MultiheadAttention`` takes its separate-projection branch: a CheckpointError (shapes
# differ), or SAC's "encountered during backward but not found in storage". remat's own
# recorder installs such hooks, so instrumentation would change the code path it measures.
# The recorder registers its pack hook here, and remat's checkpoint wrapper runs with
# remat's hooks (only remat's, only while they are on top of the stack) taken off:
# ``instrumentation_hooks_off``. What the recorder then does not see are the checkpoint's
# inputs being "saved" (they stay counted as live bytes, only not labelled activations).
_REMAT_PACK_HOOKS: list[Any] = []


@contextlib.contextmanager
def instrumentation_hooks_off() -> Iterator[None]:
    """Take remat's own saved-tensor hooks off the top of the stack for the block, then put them back."""
    popped: list[tuple[Any, Any]] = []
    while _REMAT_PACK_HOOKS:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or not any(top[0] is h or top[0] == h for h in _REMAT_PACK_HOOKS):
            break
        torch._C._autograd._pop_saved_tensors_default_hooks()
        popped.append(top)
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


@dataclasses.dataclass
class ModuleWindow:
    """Event indices (tracker events) of one module's forward call and of its backward."""

    name: str
    fwd_start: int
    fwd_end: int = -1
    fwd_start_ns: int = 0
    fwd_end_ns: int = 0
    fwd_peak: int = 0            # max live bytes during its forward (bytes)
    bwd_first_unpack: int | None = None
    bwd_last_unpack: int | None = None
    input_keys: tuple[int, ...] = ()   # storage keys of its positional tensor inputs
    in_backward: bool = False    # a forward run by autograd during backward (a checkpoint's replay)


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    key: int        # storage key (tracker record key)
    nbytes: int
    module: str     # innermost module running at pack time ("" outside any module)
    is_param: bool  # parameters are never freed by checkpointing
    event: int      # tracker event index at pack time
    record: StorageRecord  # the storage's record (keys are reused after a free; records are not)


class StepRecorder:
    """Context manager: instruments ``step`` for the steps run inside it."""

    def __init__(self, step: TrainingStep, *, names: dict[int, str] | None = None,
                 record_saved: bool = True) -> None:
        self.step = step
        model = step.workload.model
        self.names = names if names is not None else {id(m): n for n, m in model.named_modules()}
        self.tracker = LiveTensorTracker()
        self.record_saved = record_saved
        self.windows: list[ModuleWindow] = []
        self.saved: list[SavedTensor] = []
        self.param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
        self._stack: list[tuple[str, ModuleWindow | None]] = []
        self._open: dict[str, list[ModuleWindow]] = {}
        self._exit = ExitStack()

    # -- module scope ---------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        keys = tuple(a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor))
        win = ModuleWindow(name=name, fwd_start=self.tracker.events, fwd_start_ns=time.perf_counter_ns(),
                           fwd_peak=self.tracker.live_bytes, input_keys=keys,
                           in_backward=torch._C._current_graph_task_id() != -1)
        self.windows.append(win)
        self._stack.append((name, win))
        self.tracker.module = name

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None or not self._stack:
            return
        # pop to the matching frame (a module that raised leaves stale frames behind)
        while self._stack:
            top, win = self._stack.pop()
            if win is not None:
                win.fwd_end = self.tracker.events
                win.fwd_end_ns = time.perf_counter_ns()
                win.fwd_peak = max(win.fwd_peak, self._max_live_since(win.fwd_start))
            if top == name:
                break
        self.tracker.module = self._stack[-1][0] if self._stack else ""

    def _max_live_since(self, event: int) -> int:
        live = self.tracker.live_after
        return max(live[event:], default=self.tracker.live_bytes)

    # -- saved tensors --------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        rec = self.tracker._see(t, op="<saved>")
        if rec is not None:
            if rec.category is MemCategory.OTHER:
                rec.category = MemCategory.ACTIVATIONS
            module = self.tracker.module
            self.saved.append(SavedTensor(rec.key, rec.nbytes, module, rec.key in self.param_keys,
                                          self.tracker.events, rec))
            return (module, self._stack[-1][1] if self._stack else None, t)
        return ("", None, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        module, window, t = packed
        if module:
            ev = self.tracker.events
            # the forward call that packed it (a module called twice per step has two windows,
            # each with its own backward); a replay's pack falls back to every call of the module
            own = [window] if window is not None and not window.in_backward else self._open.get(module, ())
            for win in own:
                if win.bwd_first_unpack is None:
                    win.bwd_first_unpack = ev
                win.bwd_last_unpack = ev
        return t

    def marker(self, phase: Phase) -> None:
        """PhaseMarker for TrainingStep.run: labels phases and categories as they become known."""
        t = self.tracker
        if phase is Phase.BACKWARD:
            # backward unpacks attribute to the forward windows recorded so far
            self._open = {}
            for win in self.windows:
                self._open.setdefault(win.name, []).append(win)
        elif phase is Phase.OPTIMIZER:
            t.track((p.grad for p in self.step.workload.model.parameters()), MemCategory.GRADIENTS)
        t.mark(phase)

    def after_step(self) -> None:
        """Label optimizer state created in the first step (it is live now)."""
        self.tracker.track(optimizer_state_tensors(self.step.optimizer), MemCategory.OPTIMIZER_STATE)

    def __enter__(self) -> "StepRecorder":
        self._exit.enter_context(self.tracker)
        track_step_state(self.tracker, self.step)
        self._exit.callback(register_module_forward_pre_hook(self._pre).remove)
        self._exit.callback(register_module_forward_hook(self._post).remove)
        if self.record_saved:
            pack = self._pack
            _REMAT_PACK_HOOKS.append(pack)   # NOTE [saved-tensor hooks and identity]
            self._exit.callback(_REMAT_PACK_HOOKS.remove, pack)
            self._exit.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, self._unpack))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._exit.__exit__(*exc)

    def run(self, step_index: int) -> float:
        loss = self.step.run(step_index, marker=self.marker)
        self.after_step()
        return loss
