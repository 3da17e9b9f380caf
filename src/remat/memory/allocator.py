"""CPU allocator counter: whole-step peaks on CPU without a Python call per op.

NOTE [CPU allocator counter]
The live-tensor tracker (NOTE [live-tensor tracker]) is a Python ``TorchDispatchMode``: one
Python call per op, which on small steps costs a large share of the step; torch.profiler's
allocator events cost more still, most of it in turning the events into a trace when the
profiler stops. Neither can be +10% of a step.

So the whole-step peaks that remat measures over and over (the profile's baseline, every plan
the closed loop, the frontier and verify measure) come from a counter inside the CPU allocator
itself: ``csrc/cpu_alloc_counter.cpp`` wraps ``c10::GetCPUAllocator()`` (what ``at::empty``
allocates from) and, while a *window* is open, adds each allocation's bytes and subtracts them
when that same window's allocation is freed, keeping the maximum. That is one mutex-guarded
map update per allocation in C++ (its cost against the tracker's: ``benchmarks/tracker_overhead.py``,
``benchmarks/RESULTS.md``).

What it counts, against the tracker: every CPU allocation through the allocator, so it also
sees what never becomes an op's output tensor (oneDNN workspaces, a kernel's temporary
buffers, ``torch.get_rng_state()``'s 5056 bytes per checkpointed region): it reads equal to or
higher than the tracker, as torch.profiler does (``tests/test_memory.py`` checks both against
an analytic count and the profiler). Allocations made before the window opened are not the
window's: their frees are not subtracted (a pre-existing tensor freed mid-step reads high,
never low). A storage resized in place allocates from the allocator it was made with, which for
one made before the counter was installed is not the counter: the window points such a storage
at the counter before it resizes (NOTE [storage resizes] in memory/resize.py: FSDP2's
all-gathered parameters). The state live when the
step starts (parameters, buffers, gradients, optimizer state) is registered and added as the
tracker registers it. The counter is process-wide (any thread's CPU allocations in the window
count), and it is installed once per process, at the first CPU measurement; from then on an
allocation outside a window is the wrapped allocator's own after one atomic load (the installed counter costs unmeasured steps
nothing), and only one inside a window pays the map update.

It is a small C++ extension, built with ``torch.utils.cpp_extension`` on first use (cached under torch's extension directory, ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``, in ``remat/<name>``, and imported from there directly by later
processes). Where it cannot be built (no C++ compiler or ninja), or ``REMAT_CPU_PEAK=tracker``
is set, CPU peaks come from the live-tensor tracker, and every figure's
``MemorySource`` says which instrument produced it (``cpu-allocator`` or ``cpu-live-tensors``).
The cost model still predicts tensor bytes from the tracker's recorded step; NOTE [untracked
bytes] in profile/step.py carries the gap between the two into its rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Iterator

from .resize import listen_to_resizes, stop_listening

if TYPE_CHECKING:
    import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_alloc_counter.cpp"
ENV_VAR = "REMAT_CPU_PEAK"           # "tracker": CPU peaks from the live-tensor tracker, never the counter
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class CounterStatus:
    """Whether the allocator counter measures CPU peaks in this process, and if not, why."""

    available: bool
    reason: str      # why not ("" when available)


def _module_name() -> str:
    """The extension's name: a digest of its source, torch's version and the interpreter's, so an edit,
    a torch upgrade or another Python builds anew instead of loading a library built for something else."""
    import platform
    import sys

    import torch
    built_for = f"{torch.__version__} {sys.implementation.cache_tag} {platform.machine()}".encode()
    digest = hashlib.sha256(SOURCE.read_bytes() + built_for).hexdigest()[:12]
    return f"remat_cpu_alloc_counter_{digest}"


def build_directory(name: str) -> Path:
    """Where the extension is built: torch's extension directory (``$TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions``), one folder per name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "remat" / name


def _import_built(name: str, directory: Path) -> ModuleType | None:
    """The library an earlier process built, imported directly (about 1 ms; the build tool's
    up-to-date check takes 0.2 s); None when there is none."""
    import importlib.util
    library = directory / f"{name}.so"
    if not library.is_file() or (directory / "lock").exists():   # absent, or another process is building it
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's extension builder runs ``ninja`` from ``PATH``; a venv's ``ninja`` package (a dependency
    of remat) is not there unless the venv is activated, so its folder is put on ``PATH`` for the build."""
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja   # the PyPI package: the binary and its folder
        folder = ninja.BIN_DIR
    except (ImportError, AttributeError):
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = folder + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


@functools.cache
def _build() -> ModuleType | str:
    """The built, installed extension, or why it is not available (a one-line reason)."""
    try:
        name = _module_name()
        directory = build_directory(name)
        module = _import_built(name, directory)
        if module is None:
            from torch.utils.cpp_extension import load
            directory.mkdir(parents=True, exist_ok=True)
            with _ninja_on_path():
                module = load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"],
                              build_directory=str(directory), verbose=False)
    except Exception as exc:  # noqa: BLE001  no compiler, no ninja, no headers: the tracker measures instead
        text = str(exc).strip().splitlines()
        return f"the C++ counter could not be built ({type(exc).__name__}: {text[-1][:200] if text else ''})"
    if not module.install():
        return "another CPU allocator was set with a higher priority; the counter would not see its allocations"
    return module


def counter_status() -> CounterStatus:
    """Build and install the counter if it is not yet (thread-safe, once per process)."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "tracker":
        return CounterStatus(False, f"{ENV_VAR}=tracker")
    with _lock:
        built = _build()
    if isinstance(built, str):
        return CounterStatus(False, built)
    if not built.installed():
        return CounterStatus(False, "another CPU allocator replaced the counter after it was installed")
    return CounterStatus(True, "")


class CpuAllocatorWindow:
    """One counting window of the CPU allocator counter (bytes)::

        with CpuAllocatorWindow() as w:
            ...               # w.peak_bytes: max over the window of (allocated - freed) in it
    """

    def __init__(self) -> None:
        built = _build()
        if isinstance(built, str):
            raise RuntimeError(built)
        self._m = built

    def __enter__(self) -> "CpuAllocatorWindow":
        listen_to_resizes(self)
        self._m.open_window()
        return self

    def __exit__(self, *exc: object) -> None:
        self._m.close_window()
        stop_listening(self)

    # -- storage resizes (a ResizeListener: NOTE [storage resizes] in memory/resize.py) ------------
    def before_resize(self, storage: "torch.UntypedStorage") -> None:
        """A storage made before the counter was installed allocates from the wrapped allocator on a
        resize: point it at the counter first, so the new buffer counts."""
        if storage.device.type == "cpu":
            self._m.adopt(storage._cdata)

    def after_resize(self, storage: "torch.UntypedStorage") -> None:
        pass

    @property
    def live_bytes(self) -> int:
        return int(self._m.live())

    @property
    def peak_bytes(self) -> int:
        return int(self._m.peak())

    @property
    def allocations(self) -> int:
        return int(self._m.allocations())

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated in the window, frees not subtracted."""
        return int(self._m.allocated())

    def reset_peak(self) -> None:
        """Start a new peak at the current live bytes (like ``reset_peak_memory_stats``)."""
        self._m.reset_peak()
