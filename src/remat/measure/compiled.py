"""Compiled execution: an arm's model run through ``torch.compile``, and its peak on any device.

NOTE [compiled arms]
*What is compiled*: the model, in place, not the step. ``compile_model`` sets the module's
``_compiled_call_impl`` (what ``nn.Module.compile()`` sets) so ``model(x)`` runs a
``torch.compile`` of the module's own ``_call_impl``: the loss function, ``backward()`` and the
optimizer stay eager. That is what users compile, it is where AOTAutograd partitions forward
from backward (the decision ``activation_memory_budget`` and checkpoint regions act on), and it
keeps every parameter name, hook-free wrapper and ``ApplyHandle`` as they were (a
``torch.compile(model)`` wrapper would rename every parameter ``_orig_mod.*``). A whole-step
compile would graph-break at ``loss.backward()`` and ``optimizer.step()`` anyway.

*One compiled function per arm*: Dynamo caches compiled code on the Python code object it
compiled, guarded by shapes and types, not by the module instance (inline_inbuilt_nn_modules).
Two builds of the same model class compiled one after the other share ``Module._call_impl``'s
code object, so the second would reuse the first's graph (and its budget). Each arm therefore compiles its own copy of the entry
function (a new code object, :func:`_fresh_entry`), so its cache, its recompiles and its
budget are its own.

*The budget*: ``torch._functorch.config.activation_memory_budget`` is a process-wide config
read when AOTAutograd partitions a graph (at the first call, and at any recompile). Each call
of an arm's compiled function runs under ``config.patch`` with the arm's value, so whenever
its graph is (re)partitioned it is with its own budget, whatever other arms set.

*Measuring*: the live-tensor tracker is a TorchDispatchMode, and Dynamo runs a frame eagerly
under one (and the frame stays eager afterwards: NOTE [compiled peaks] in
benchmarks/compare.py). So a compiled arm's peak never comes from the tracker: on CUDA from
the allocator (``cuda-allocator``, as every CUDA figure), on CPU from torch.profiler's
allocator events (``cpu-profiler-allocator``: the running sum of the CPU allocator's
``[memory]`` events over one warm step plus the step's starting state; it equals the
tracker's figure on eager steps, remat.memory.reference). Inductor's CPU kernels write into
buffers allocated through that allocator (``empty_strided``), so compiled buffers are seen;
scratch a C++ kernel keeps on its own stack is not.

*Random numbers*: inductor's own random kernels draw from a philox stream seeded once per
compiled graph, so any two different graphs (the compiled control and a compiled plan, whose
checkpoint regions change the partition) draw different dropout masks from the same generator
state (benchmarks/RESULTS.md has the zoo's GPT-2 losses). For a comparison, :func:`random_ops_in_program_order` sets inductor's ``fallback_random``: random ops
then run torch's eager kernels, which draw from the generator in program order, as eager does,
so the two graphs draw the same masks (and the plan with RNG preservation off still draws new
ones in its backward replay, so that negative control is still rejected). It changes how a
random op is lowered, not how AOTAutograd partitions the graph, so what is saved and what is
recomputed is the same as in the timed arms, which keep inductor's kernels.

*Compile time*: the first step of a fresh build compiles (forward at the first call, backward
at the first backward). ``compile_s`` is that first step's wall time less a warm step's: the
compile cost, reported apart from the warm step times, never mixed into them.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from typing import Any, Iterator

import torch
import torch._functorch.config as functorch_config
from torch import nn

from ..errors import RematError
from ..memory.measure import PeakMeasurement, cuda_step_peak, model_device
from ..memory.reference import profiler_step_peak
from ..types import MemorySource
from ..workload.contract import TrainingStep
from .compile_spec import CompileSpec


def _compiled_entry(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What an arm's compiled function runs: the module's own call (hooks, forward)."""
    return module._call_impl(*args, **kwargs)


_entries = itertools.count()


def _fresh_entry() -> types.FunctionType:
    """A copy of :func:`_compiled_entry` with its own code object (NOTE [compiled arms]: one Dynamo cache per arm)."""
    n = next(_entries)
    code = _compiled_entry.__code__.replace(co_name=f"remat_compiled_{n}", co_qualname=f"remat_compiled_{n}")
    return types.FunctionType(code, _compiled_entry.__globals__, f"remat_compiled_{n}")


class CompiledFunction:
    """One arm's compiled entry (its own Dynamo cache, NOTE [compiled arms]); every build of the
    arm shares it, so a second build of the same arm reuses the graph instead of recompiling."""

    def __init__(self, spec: CompileSpec) -> None:
        self.spec = spec
        self.entry = _fresh_entry()
        self.compiled = torch.compile(self.entry, backend=spec.backend)

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.spec.memory_budget is None:
            return self.compiled(module, *args, **kwargs)
        with functorch_config.patch(activation_memory_budget=float(self.spec.memory_budget)):
            return self.compiled(module, *args, **kwargs)


class CompiledCall:
    """The compiled call installed on a model (``model._compiled_call_impl``): NOTE [compiled arms]."""

    def __init__(self, module: nn.Module, function: CompiledFunction) -> None:
        self.module = module
        self.function = function

    @property
    def spec(self) -> CompileSpec:
        return self.function.spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.module, *args, **kwargs)


class CompiledModel:
    """Undo for :func:`compile_model`: the model runs its eager ``_call_impl`` again."""

    def __init__(self, module: nn.Module, call: CompiledCall, previous: Any) -> None:
        self.module, self.call, self.previous = module, call, previous

    def __call__(self) -> None:
        if getattr(self.module, "_compiled_call_impl", None) is self.call:
            self.module._compiled_call_impl = self.previous


def compile_model(model: nn.Module, spec: CompileSpec | CompiledFunction) -> CompiledModel:
    """Compile ``model`` in place (NOTE [compiled arms]); returns the undo. Pass a
    :class:`CompiledFunction` to share its compiled graph (builds of one arm)."""
    if not hasattr(model, "_compiled_call_impl"):  # pragma: no cover - every torch >= 2.2 has it
        raise RematError("this torch has no nn.Module._compiled_call_impl: cannot compile a model in place",
                         tip="use torch >= 2.2")
    function = spec if isinstance(spec, CompiledFunction) else CompiledFunction(spec)
    call = CompiledCall(model, function)
    previous = model._compiled_call_impl
    model._compiled_call_impl = call
    return CompiledModel(model, call, previous)


@contextlib.contextmanager
def random_ops_in_program_order() -> Iterator[None]:
    """Compiled random ops draw from torch's generator in program order, as eager does
    (inductor ``fallback_random``; NOTE [compiled arms], *Random numbers*). Held over forward
    *and* backward: AOTAutograd compiles the backward graph at the first backward call."""
    import torch._inductor.config as inductor_config   # loaded on demand: eager runs never need inductor
    with inductor_config.patch(fallback_random=True):
        yield


def compiled_step_peak(step: TrainingStep, step_index: int) -> PeakMeasurement:
    """Whole-step peak (bytes) of one step of a compiled model: the CUDA allocator, or on CPU
    torch.profiler's allocator events (never the tracker: NOTE [compiled arms])."""
    device = model_device(step)
    if device.type == "cuda":
        return cuda_step_peak(step, step_index, device)
    peak = profiler_step_peak(step, step_index)
    return PeakMeasurement(peak, MemorySource.CPU_PROFILER, None, 0)
