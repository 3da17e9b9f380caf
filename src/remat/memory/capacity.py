"""A device capacity on the CPU, enforced: past it an allocation raises ``torch.OutOfMemoryError``.

NOTE [CPU device capacity]
People checkpoint because a step does not fit the device. On CUDA the device says so: the
caching allocator raises ``torch.OutOfMemoryError`` when an allocation does not fit. A CPU has
tens of GiB and no such edge, so a capacity the user states (``device_memory="2GiB"``) would be
a number nobody enforces, and a blocked step could not be shown, tested or planned in CI. So the
CPU allocator counter (NOTE [CPU allocator counter] in memory/allocator.py) keeps *ledgers*: a
ledger has a limit (bytes) and a base (bytes already live when it opens: the step's parameters,
buffers, gradients and optimizer state, counted as the live-tensor tracker counts them, each
storage once); every CPU allocation made while it is the active ledger is charged to it and
every such allocation freed is credited back; an allocation that would take it past the limit
is refused in C++ before it is made, with ``c10::OutOfMemoryError``, which torch raises in
Python as ``torch.OutOfMemoryError``, as CUDA's allocator does. The ledger records the refused
allocation's bytes and the live bytes at the refusal.

What a CPU capacity counts is what remat's measured CPU peak counts (NOTE [CPU allocator
counter]): the step's state live at its start plus what the step allocates, so a step is refused
exactly when its measured peak would cross the capacity. A state tensor freed mid-step (a
gradient set to None) is not credited (it reads high, never low, as the peak does); tensors of the
process that are not the step's state (another model, the user's own copy while remat plans a
copy) are not charged, as on CUDA the user's tensors are parked while remat measures.

Two ways in:
- :func:`step_capacity` (remat's own measurements: ``remat.auto(device_memory=...)``, ``remat plan
  --device-memory``): every training step of the process (``TrainingStep.run``, NOTE [step
  guards]) runs under a fresh ledger with the step's state as its base;
- :class:`CpuCapacity` (the user's own loop, the demo): one ledger over a block of code, its base
  the tensors of the objects the caller names (a model, an optimizer, a batch).
A refused step leaves :class:`Refusal`, the blocked step's evidence: the phase, the request, and
the bytes live by kind (NOTE [blocked step] in profile/blocked.py reads it).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..errors import RematError
from ..types import LiveByKind, Phase, Refusal
from ..units import fmt_bytes
from ..workload.contract import PhaseMarker, TrainingStep, pop_step_guard, push_step_guard
from .allocator import _build, counter_status
from .measure import optimizer_state_tensors, step_state_bytes

if TYPE_CHECKING:
    from types import ModuleType, TracebackType


class CapacityError(RematError):
    """A CPU capacity cannot be enforced here, or is not a capacity (exit 2)."""


def _counter() -> "ModuleType":
    status = counter_status()
    if not status.available:
        raise CapacityError(f"a CPU device capacity is enforced by remat's CPU allocator counter, which is not "
                            f"available here: {status.reason}",
                            tip="install a C++ compiler and ninja (pip install ninja), unset REMAT_CPU_PEAK, or "
                                "plan on a CUDA device")
    built = _build()
    assert not isinstance(built, str)
    return built


def _check_capacity(capacity_bytes: int) -> None:
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
        raise CapacityError(f"a device capacity must be a positive number of bytes, got {capacity_bytes!r}")


class _Ledger:
    """One ledger of the counter (bytes), active while entered; ``state()`` after exit still reads it."""

    def __init__(self, limit_bytes: int, base_bytes: int) -> None:
        self._m = _counter()
        self.limit_bytes, self.base_bytes = limit_bytes, base_bytes
        self._n = 0
        self._before = 0
        self.peak_bytes = base_bytes
        self.refused: tuple[int, int] | None = None   # (requested, live) of the refused allocation

    def __enter__(self) -> "_Ledger":
        self._n = int(self._m.ledger_open(self.limit_bytes, self.base_bytes))
        self._before = int(self._m.ledger_activate(self._n))
        return self

    def read(self) -> None:
        _, _, peak, failed, failed_live = self._m.ledger_state(self._n)
        self.peak_bytes = int(peak)
        self.refused = (int(failed), int(failed_live)) if failed >= 0 else None

    @property
    def live_bytes(self) -> int:
        return int(self._m.ledger_state(self._n)[1])

    def __exit__(self, *exc: object) -> None:
        self.read()
        self._m.ledger_activate(self._before)
        self._m.ledger_close(self._n)


def storage_bytes(tensors: Iterable[Any], seen: set[int], *, device_type: str = "cpu") -> int:
    """Bytes of the storages on ``device_type`` of ``tensors`` not in ``seen`` (data pointers), each once;
    ``seen`` grows."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type or t.is_meta:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # a tensor subclass without storage
            continue
        ptr = storage.data_ptr()
        if ptr in seen or ptr == 0:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def _saved_tensor_bytes(tb: "TracebackType | None", seen: set[int], max_nodes: int = 200_000) -> int:
    """Bytes saved for backward by the autograd graph reachable from tensors in the failing frames' locals
    (each storage once, not in ``seen``). At the refused allocation those frames still hold the forward's
    outputs, and through their ``grad_fn`` every tensor saved so far (``_saved_*`` attributes)."""
    roots: list[Any] = []
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            for leaf in _tensors_in(value):
                if leaf.grad_fn is not None:
                    roots.append(leaf.grad_fn)
        tb = tb.tb_next
    total, visited, stack = 0, set(), roots
    while stack and len(visited) < max_nodes:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:   # freed already (after a backward) or not a tensor
                    continue
                total += storage_bytes(_tensors_in(value), seen)
        stack.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    return total


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple, dict)):
        try:
            return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        except Exception:  # noqa: BLE001  a container pytree cannot flatten: nothing to count
            return []
    return []


def live_by_kind(model: nn.Module | None, optimizer: Any, live_bytes: int,
                 tb: "TracebackType | None") -> LiveByKind:
    """What holds the ``live_bytes`` of a refused allocation: the model's parameters and buffers, their
    gradients, the optimizer's state, the saved activations reachable from ``tb``; the rest is other."""
    seen: set[int] = set()
    params = storage_bytes(list(model.parameters()) + list(model.buffers()), seen) if model is not None else 0
    grads = storage_bytes([p.grad for p in model.parameters()], seen) if model is not None else 0
    opt = storage_bytes(optimizer_state_tensors(optimizer), seen)
    saved = _saved_tensor_bytes(tb, seen)
    return LiveByKind(parameters=params, gradients=grads, optimizer_state=opt, saved_activations=saved,
                      other=max(0, live_bytes - params - grads - opt - saved))


# -- remat's own measurements: every step under a fresh ledger -------------------------------------

_refusals = threading.local()


def last_refusal() -> Refusal | None:
    """The evidence of the last step a :func:`step_capacity` refused in this thread (None: none yet)."""
    return getattr(_refusals, "last", None)


def clear_refusal() -> None:
    _refusals.last = None


@contextlib.contextmanager
def step_capacity(capacity_bytes: int | None) -> Iterator[None]:
    """Run every CPU training step of this process under ``capacity_bytes`` (NOTE [CPU device capacity]);
    ``None``: nothing enforced. A CUDA step is left to its own allocator. Nested: the inner one holds."""
    if capacity_bytes is None:
        yield
        return
    _check_capacity(capacity_bytes)
    _counter()

    @contextlib.contextmanager
    def guard(step: TrainingStep, marker: PhaseMarker) -> Iterator[PhaseMarker]:
        model = step.workload.model
        if _on_cuda_or_fake(model):
            yield marker
            return
        base = step_state_bytes(step)   # as the measured peak counts it: refused exactly when it would cross
        phase: list[Phase | None] = [None]

        def mark(p: Phase) -> None:
            phase[0] = p
            marker(p)

        ledger = _Ledger(capacity_bytes, base)
        try:
            with ledger:
                yield mark
        except torch.OutOfMemoryError as exc:
            if ledger.refused is not None:
                requested, live = ledger.refused
                _refusals.last = Refusal(capacity_bytes=capacity_bytes, requested_bytes=requested, live_bytes=live,
                                         phase=phase[0],
                                         by_kind=live_by_kind(model, step.optimizer, live, exc.__traceback__))
            raise

    push_step_guard(guard)
    try:
        yield
    finally:
        pop_step_guard(guard)


def _on_cuda_or_fake(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    for p in model.parameters():
        return p.device.type != "cpu" or isinstance(p, FakeTensor)
    return False


# -- the user's own loop ---------------------------------------------------------------------------

class CpuCapacity:
    """Enforce a CPU device capacity (bytes) over a block of code (NOTE [CPU device capacity])::

        with remat.CpuCapacity(2 * 2**30, model, optimizer) as cap:
            train()          # an allocation past 2 GiB raises torch.OutOfMemoryError
        cap.peak_bytes       # the most the block held, with the named objects' tensors

    ``holding``: the objects whose tensors are live when the block starts and count against it
    (modules: parameters, buffers, gradients; optimizers: their state; any pytree of tensors).
    Tensors freed in the block that were live before it are not credited (it reads high, never
    low). ``remat.auto`` called inside the block plans for this capacity, less what is charged at
    the call (as CUDA's free memory), on copies that are not charged to it.
    """

    def __init__(self, capacity_bytes: int, *holding: Any) -> None:
        _check_capacity(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._holding = holding
        self._ledger: _Ledger | None = None
        self.peak_bytes = 0
        self.refusal: Refusal | None = None

    def __enter__(self) -> "CpuCapacity":
        seen: set[int] = set()
        base = 0
        for obj in self._holding:
            if isinstance(obj, nn.Module):
                base += storage_bytes([*obj.parameters(), *obj.buffers(), *(p.grad for p in obj.parameters())], seen)
            elif isinstance(obj, torch.optim.Optimizer):
                base += storage_bytes(optimizer_state_tensors(obj), seen)
            else:
                base += storage_bytes(_tensors_in(obj), seen)
        if base > self.capacity_bytes:
            raise CapacityError(f"the named objects already hold {fmt_bytes(base)}, over the capacity of "
                                f"{fmt_bytes(self.capacity_bytes)}")
        self._ledger = _Ledger(self.capacity_bytes, base)
        self._ledger.__enter__()
        _active_capacities.append(self)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self._ledger is not None
        if self in _active_capacities:
            _active_capacities.remove(self)
        self._ledger.__exit__()
        self.peak_bytes = self._ledger.peak_bytes
        if self._ledger.refused is not None:
            requested, live = self._ledger.refused
            self.refusal = Refusal(capacity_bytes=self.capacity_bytes, requested_bytes=requested,
                                   live_bytes=live, phase=None)

    @property
    def free_bytes(self) -> int:
        """The capacity less what is charged to it now."""
        assert self._ledger is not None, "free_bytes is read inside the block"
        return max(0, self.capacity_bytes - self._ledger.live_bytes)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Charge nothing to this capacity meanwhile (remat's copies while it plans); frees still credit."""
        m = _counter()
        before = m.ledger_activate(0)
        try:
            yield
        finally:
            m.ledger_activate(before)


_active_capacities: list[CpuCapacity] = []


def active_capacity() -> CpuCapacity | None:
    """The innermost :class:`CpuCapacity` block this process is in (None: none)."""
    return _active_capacities[-1] if _active_capacities else None
