"""The workload contract (docs/DESIGN.md) and the one training step every stage runs."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import sysconfig
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..errors import RematError, UserCodeError, WorkloadError
from ..host_rng import seed_everything
from ..types import Phase

T = TypeVar("T")

# NOTE [user code errors]
# Every call into the workload's own code (factory, ``batch``, ``loss`` with the model's forward,
# ``backward``, the optimizer) goes through :func:`call_user`. An exception from it is the
# user's to fix: it becomes a :class:`UserCodeError` (exit 2) carrying the user's traceback,
# and so does a ``SystemExit`` (``sys.exit(0)`` included, and argparse's exit on a usage error:
# the workload must not end remat's process, nor pass for remat's own usage error) and any other
# ``BaseException`` but KeyboardInterrupt (Ctrl-C, and the CLI's SIGTERM ``Terminated``), except
# - remat's own typed errors (a RematError raised by a tracker inside the forward, e.g. the
#   frontier's PeakLimitExceeded) and out-of-memory errors, which callers measure, pass as they are;
# - an exception raised *by remat's code* running inside the user's step (a dispatch mode, a
#   checkpoint wrapper, a verify probe): the innermost frame of its traceback outside torch and
#   the standard library is in remat's package (not in the built-in workloads, which are
#   workload code), so it is a remat bug and passes on untyped, for the CLI to report as exit 3.
# A call that closes ``sys.stdout`` or ``sys.stderr`` is the user's too: remat's next print would
# fail (ValueError: I/O operation on closed file) far from the cause, and read as a remat bug. So
# ``call_user`` notes which streams were open before the call, reopens any closed after it on its
# file descriptor (Python's std streams never own fds 1 and 2), and raises a UserCodeError naming it.
_REMAT_DIR = Path(__file__).resolve().parents[1]
_BUILTINS_DIR = _REMAT_DIR / "workload" / "builtins"
_LIBRARY_DIRS = tuple(str(Path(p).resolve()) + os.sep for p in
                      {os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]})


def is_allocation_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text))


def raised_by_remat(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback outside torch and the standard library
    is remat's own code (NOTE [user code errors]). The first frame (the catcher's) is skipped."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]
    for frame in reversed(frames):
        path = os.path.realpath(frame.filename)
        if path.startswith(_LIBRARY_DIRS):
            continue
        p = Path(path)
        return p.is_relative_to(_REMAT_DIR) and not p.is_relative_to(_BUILTINS_DIR)
    return False


def user_traceback(exc: BaseException, max_frames: int = 12) -> str:
    """The exception's traceback without the catcher's frame, its last ``max_frames`` frames."""
    frames = traceback.extract_tb(exc.__traceback__)[1:][-max_frames:]
    return ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
            + "".join(traceback.format_exception_only(type(exc), exc))).rstrip()


_STD_STREAMS = (("stdout", 1), ("stderr", 2))


def _open_streams() -> list[str]:
    return [name for name, _ in _STD_STREAMS if not getattr(getattr(sys, name, None), "closed", True)]


def _reopen_closed(names: list[str]) -> list[str]:
    """Of the streams ``names`` (open before the user's call), those closed now, each replaced by a new
    text stream on its file descriptor: Python's own ``sys.stdout`` never owns fd 1 (``closefd=False``),
    so the descriptor is still open and remat can still print its error, and its report."""
    closed = []
    for name, fd in _STD_STREAMS:
        stream = getattr(sys, name, None)
        if name in names and getattr(stream, "closed", False):
            closed.append(f"sys.{name}")
            with contextlib.suppress(OSError, ValueError):
                setattr(sys, name, open(fd, "w", buffering=1, closefd=False, errors="backslashreplace",
                                        encoding=getattr(stream, "encoding", None) or "utf-8"))
    return closed


def call_user(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call the workload's own code ``fn``; NOTE [user code errors] says what it raises. A call that
    closes ``sys.stdout`` or ``sys.stderr`` is the user's fault too (remat writes its results there):
    a UserCodeError naming the stream, which is reopened first so that the error can be shown."""
    streams = _open_streams()
    try:
        result = _call_user(what, fn, *args, **kwargs)
    except KeyboardInterrupt:
        _reopen_closed(streams)
        raise
    except BaseException:   # whatever failed after a stream was closed failed because of it (a write to it)
        closed = _reopen_closed(streams)
        if closed:
            raise _closed_streams(what, closed) from None
        raise
    closed = _reopen_closed(streams)
    if closed:
        raise _closed_streams(what, closed)
    return result


def _closed_streams(what: str, closed: list[str]) -> UserCodeError:
    return UserCodeError(f"{what} closed {' and '.join(closed)}, where remat writes its results and errors",
                         tip="do not close sys.stdout or sys.stderr in the workload; to silence output, redirect "
                             "it (contextlib.redirect_stdout) inside your own code and let it restore the stream")


def _call_user(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    except (RematError, KeyboardInterrupt):
        raise
    except SystemExit as exc:
        raise UserCodeError(f"{what} called sys.exit({exc.code!r}): remat's process is not the workload's to end "
                            "(argparse exits so on a usage error, and any lines above it printed are the workload's)",
                            traceback_text=user_traceback(exc),
                            tip="do not exit, nor parse sys.argv, in the workload: take settings as shape keywords") from None
    except BaseException as exc:
        if is_allocation_failure(exc) or raised_by_remat(exc):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UserCodeError(f"{what} raised {type(exc).__name__}: {first}", traceback_text=user_traceback(exc),
                            tip="the traceback above is your workload's code: fix it there") from exc

PhaseMarker = Callable[[Phase], None]


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclasses.dataclass
class Workload:
    """A training step: a model, a deterministic batch per step, a loss, an optimizer.

    ``batch(step)`` must return the same data for the same ``step``; ``loss(model, batch)``
    is the forward phase and must return a scalar tensor; ``optimizer(params)`` builds the
    optimizer (AdamW, lr 1e-3 when omitted). ``accumulation_steps``: micro-batches per optimizer
    step; above 1, each step runs as the last micro-batch of an accumulated step, with the earlier
    micro-batches' gradients alive (NOTE [accumulated step]).
    """

    model: nn.Module
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    accumulation_steps: int = 1   # micro-batches per optimizer step (units: micro-batches)

    def __post_init__(self) -> None:
        n = self.accumulation_steps
        if not is_accumulation_count(n):
            raise WorkloadError(f"Workload.accumulation_steps must be an integer >= 1, got {n!r}",
                                tip="the micro-batches per optimizer step: 1 when every batch steps the optimizer")
        if not isinstance(self.model, nn.Module):
            raise WorkloadError(f"Workload.model must be a torch.nn.Module, got {type(self.model).__name__}")
        for name in ("batch", "loss"):
            if not callable(getattr(self, name)):
                raise WorkloadError(f"Workload.{name} must be callable, got {type(getattr(self, name)).__name__}")
        if self.optimizer is not None and not callable(self.optimizer):
            raise WorkloadError("Workload.optimizer must be callable(params) -> torch.optim.Optimizer or None")

    def make_optimizer(self) -> torch.optim.Optimizer:
        factory = self.optimizer or _default_optimizer
        opt = call_user("the workload's optimizer factory", factory, self.model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise WorkloadError(f"the workload's optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt


# NOTE [autocast steps]
# Mixed precision is a property of the step, not of the model: ``--autocast bf16`` (or
# ``remat.auto(..., autocast="bf16")``) runs the workload's forward phase (its ``loss``: the
# model call and the loss) under ``torch.autocast(device_type, dtype)``, as a mixed-precision
# training loop does, and the backward and optimizer step outside it. The wrapping is done once,
# on the Workload (:class:`AutocastLoss`), so every stage that runs the step (profile, replays,
# closed loop, frontier, verify, check) runs the same autocast step. Non-reentrant checkpointing
# records the autocast state at the forward and replays under it, so a replay recomputes in the
# same precision. Parameters, gradients and optimizer state stay in the workload's dtype; verify
# compares them with the autocast dtype's tolerance (NOTE [autocast tolerances] in
# remat/verify/model.py), and every report made so says so.
AUTOCAST_DTYPES: dict[str, str] = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def parse_autocast(name: str | None) -> str | None:
    """``"bf16"``/``"bfloat16"`` -> ``"bfloat16"``, ``"fp16"``/``"float16"`` -> ``"float16"``; None stays None."""
    if name is None:
        return None
    if not isinstance(name, str) or name.lower() not in AUTOCAST_DTYPES:
        raise WorkloadError(f"autocast {str(name)[:40]!r} is not an autocast dtype",
                            tip="use bf16 or fp16 (torch.autocast's bfloat16 or float16), or leave it out")
    return AUTOCAST_DTYPES[name.lower()]


class AutocastLoss:
    """The workload's loss run under ``torch.autocast(device_type, dtype)`` (NOTE [autocast steps])."""

    def __init__(self, loss: Callable[[nn.Module, Any], torch.Tensor], device_type: str, dtype: str) -> None:
        self.loss, self.device_type, self.dtype = loss, device_type, dtype

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=getattr(torch, self.dtype)):
            return self.loss(model, batch)

    def __repr__(self) -> str:
        return f"AutocastLoss({self.loss!r}, {self.device_type}, {self.dtype})"


def with_autocast(workload: Workload, device: str, autocast: str | None) -> Workload:
    """``workload`` whose forward runs under autocast ``autocast`` (a parse_autocast name; None: as it is)."""
    if autocast is None:
        return workload
    return dataclasses.replace(workload, loss=AutocastLoss(workload.loss, torch.device(device).type, autocast))


def _noop(_: Phase) -> None:
    return None


# NOTE [first step watch]
# A first step can take minutes (lazy initialisation, a slow data source, a download in
# ``batch()``) or hang; the CLI says so with a line every few seconds until it returns
# (remat.cli.common.load_from_args). The library prints nothing: it only sets the events
# asked for here when a training step of this process ends, returned or raised.
_step_watches: list[threading.Event] = []


# NOTE [step guards]
# A context that every training step of this process runs inside while it is pushed: remat's
# CPU device capacity (NOTE [CPU device capacity] in remat/memory/capacity.py) charges each step
# to a ledger that refuses an allocation past the capacity. The guard is called with the step and
# the step's phase marker and yields the marker the step calls (so it knows the phase a refused
# allocation came in). Pushed and popped by the layer that owns it; the step knows nothing of it.
StepGuard = Callable[["TrainingStep", "PhaseMarker"], ContextManager["PhaseMarker"]]
_step_guards: list[StepGuard] = []


def push_step_guard(guard: StepGuard) -> None:
    _step_guards.append(guard)


def pop_step_guard(guard: StepGuard) -> None:
    if _step_guards and _step_guards[-1] is guard:
        _step_guards.pop()
    elif guard in _step_guards:
        _step_guards.remove(guard)


def watch_first_step() -> threading.Event:
    """An event set when the next ``TrainingStep.run`` of this process ends (NOTE [first step watch])."""
    done = threading.Event()
    _step_watches.append(done)
    return done


def _step_ended() -> None:
    while _step_watches:
        _step_watches.pop().set()


def is_accumulation_count(n: object) -> bool:
    """Whether ``n`` is a number of micro-batches per optimizer step: an int >= 1 (not a bool)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


# NOTE [accumulated step]
# With gradient accumulation over N micro-batches, micro-batch 1 runs its forward and backward
# with no gradients allocated, as a plain step does; micro-batches 2..N run theirs with the
# gradients of the earlier ones alive (every trainable parameter's ``.grad``, the parameters'
# bytes again), and each backward adds into them in place, a transient gradient at a time.
# So the accumulated step peaks in a micro-batch after the first, at up to the gradients' bytes
# above a plain step of the same micro-batch. A workload with ``accumulation_steps > 1``
# therefore runs each step as that worst micro-batch:
# the step ends with ``zero_grad(set_to_none=False)``, so from the second step on (every
# measurement warms up first) the forward and backward run with the gradients allocated and
# zeroed, as the earlier micro-batches leave them (same bytes; ``0 + g`` is ``g`` exactly, so the
# optimizer sees the gradient it would), then the optimizer steps with them. The step's batch is
# the micro-batch planned for: the longest, measured in the last position. Parameters that got
# no gradient keep none, as in the user's loop. One micro-batch per step keeps the time of a
# step the time of a micro-batch plus the optimizer's, not N micro-batches'.


class TrainingStep:
    """Runs whole training steps of a workload: batch, forward, backward, optimizer.

    One optimizer per ``TrainingStep``; ``run(step)`` is the step every measurement times.
    ``marker(phase)`` is called as each phase starts (and ``marker(None)``-free: the end of
    the step is the return), so tracers can label what happens in between.
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.optimizer = workload.make_optimizer()
        # when set, step i first seeds every global generator with seed + i, so two builds run
        # the same random draws at each step (NOTE [solo peaks] in remat/measure/run.py)
        self.seed: int | None = None

    def run(self, step: int, marker: PhaseMarker = _noop) -> float:
        if self.seed is not None:
            seed_everything(self.seed + step)
        try:
            if not _step_guards:
                return self._run(step, marker)
            with _step_guards[-1](self, marker) as guarded:
                return self._run(step, guarded)
        finally:
            if _step_watches:
                _step_ended()

    def _run(self, step: int, marker: PhaseMarker) -> float:
        marker(Phase.BATCH)
        batch = self.batch(step)
        marker(Phase.FORWARD)
        loss = self.forward(batch)
        marker(Phase.BACKWARD)
        self.backward(loss)
        marker(Phase.OPTIMIZER)
        self.optimizer_step()
        # accumulating: the next step starts with the gradients allocated (NOTE [accumulated step])
        self.optimizer.zero_grad(set_to_none=self.workload.accumulation_steps == 1)
        value = float(loss.detach())   # syncs the device once per step
        if not math.isfinite(value):
            raise WorkloadError(
                f"the workload's loss is {value} at step {step}: there is nothing to plan or verify on a step "
                "that does not train", tip="check the batch (an empty batch, e.g. batch_size=0, gives a NaN mean) "
                                           "and the learning rate")
        return value

    def batch(self, step: int) -> Any:
        """``workload.batch(step)``, with the contract checked: no empty tensor (``batch_size=0``)."""
        batch = call_user(f"the workload's batch({step})", self.workload.batch, step)
        for leaf in tree_leaves(batch):
            if isinstance(leaf, torch.Tensor) and leaf.numel() == 0:
                raise WorkloadError(f"the workload's batch({step}) holds an empty tensor of shape {tuple(leaf.shape)}",
                                    tip="a shape keyword is 0 (batch_size=0?): a step on no data measures nothing")
        return batch

    def backward(self, loss: torch.Tensor) -> None:
        call_user("the backward pass", loss.backward)

    def optimizer_step(self) -> None:
        call_user("the optimizer's step()", self.optimizer.step)

    def forward(self, batch: Any) -> torch.Tensor:
        """The forward phase with the contract checked: a scalar, differentiable loss."""
        loss = call_user("the workload's loss (the forward phase)", self.workload.loss, self.workload.model, batch)
        if not isinstance(loss, torch.Tensor):
            raise WorkloadError(f"the workload's loss returned {type(loss).__name__}, not a tensor")
        if loss.numel() != 1 or loss.dim() != 0:
            raise WorkloadError(
                f"the workload's loss must be a scalar tensor, got shape {tuple(loss.shape)}",
                tip="reduce it, e.g. with .mean()",
            )
        if not loss.requires_grad:
            raise WorkloadError("the workload's loss does not require grad: nothing to train")
        return loss
