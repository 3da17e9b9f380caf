"""Building a workload for simulation: on ``meta`` (no memory, no init cost), then fake.

NOTE [building without memory]
The factory is called with ``device="meta"`` (inside ``torch.device("meta")`` too, for factories
that take no ``device``), so parameters cost nothing and init ops are no-ops whatever the size.
It is *not* called under ``FakeTensorMode``: ``Module.to`` on fake parameters goes through
``torch.utils.swap_tensors``, which refuses tensors that fake mode holds weak references to
("_apply(): Couldn't swap Linear.weight"), and every factory calls ``.to(device, dtype)``.
Then :func:`fake_module_` replaces each meta parameter, buffer and tensor attribute, in place,
by a fake tensor of the same size, stride and dtype on the simulated device (tied parameters
stay tied: one fake per original tensor). The workload's ``batch`` closure still says
``.to("meta")``: :class:`~remat.simulate.semantics.SimulationFunctions` maps that to the simulated
device while the step runs, and ``torch.Generator`` + ``randint``/``randn`` work under fake mode.
A model that already exists on a real device is converted the same way into a copy
(:func:`fake_workload`), so the caller's model is never touched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..workload.contract import TrainingStep, Workload
from ..workload.loader import LoadedWorkload, ShapeValue, load_workload_on_meta
from .devices import DeviceModel, get_device_model
from .semantics import KernelSemantics, SimulationDispatch, SimulationFunctions, prepare_optimizer

SIM_DEVICE = torch.device("cpu")  # fake tensors report this device (NOTE [simulated step])


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor with ``t``'s size, stride, dtype (call with the fake mode active)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)


def fake_module_(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device = SIM_DEVICE,
                 memo: dict[int, torch.Tensor] | None = None) -> nn.Module:
    """Replace, in place, every parameter, buffer and tensor attribute of ``model`` by a fake tensor.

    ``memo`` maps ``id(original)`` -> fake, so a tensor shared by two modules (tied weights) is
    replaced by one fake tensor. Returns ``model``.
    """
    memo = {} if memo is None else memo
    with fake_mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) not in memo:
                    memo[id(p)] = nn.Parameter(_fake_like(p, device), requires_grad=p.requires_grad)
                if p is not None:
                    module._parameters[name] = memo[id(p)]  # type: ignore[assignment]
            for name, b in list(module._buffers.items()):
                if b is not None and id(b) not in memo:
                    memo[id(b)] = _fake_like(b, device)
                if b is not None:
                    module._buffers[name] = memo[id(b)]
            for name, v in list(vars(module).items()):
                if isinstance(v, torch.Tensor) and not name.startswith("_"):
                    if id(v) not in memo:
                        memo[id(v)] = _fake_like(v, device)
                    setattr(module, name, memo[id(v)])
    return model


def fake_workload(workload: Workload, fake_mode: FakeTensorMode, device: torch.device = SIM_DEVICE) -> Workload:
    """A copy of ``workload`` whose model is fake; the original model is left as it is.

    A meta model is converted in place (it holds nothing worth keeping); a real one is deep-copied
    with every parameter and buffer already swapped for its fake, so no real bytes are copied.
    """
    model = workload.model
    tensors = [*model.parameters(), *model.buffers()]
    if tensors and all(t.device.type == "meta" for t in tensors):
        fake_module_(model, fake_mode, device)
    else:
        memo: dict[int, Any] = {}
        fakes: dict[int, torch.Tensor] = {}
        with fake_mode:
            for t in tensors:
                if id(t) not in fakes:
                    f = _fake_like(t, device)
                    fakes[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        memo.update(fakes)
        model = copy.deepcopy(model, memo)
        fake_module_(model, fake_mode, device)  # plain tensor attributes the deepcopy copied
    return dataclasses.replace(workload, model=model)


@dataclasses.dataclass(kw_only=True)
class SimulatedWorkload:
    """A workload whose model is fake, with the modes its steps must run under.

    ``loaded`` has the spec, shape and dtype the trace context records; its ``device`` is the
    *simulated* device kind ("cpu" or "cuda", from the device model's kernel semantics).
    Run anything that touches the model inside :meth:`session`.
    """

    loaded: LoadedWorkload
    device_model: DeviceModel
    fake_mode: FakeTensorMode
    dispatch: SimulationDispatch

    @property
    def semantics(self) -> KernelSemantics:
        return self.device_model.semantics

    @contextlib.contextmanager
    def session(self) -> Iterator["SimulatedWorkload"]:
        """Fake mode + the simulation's dispatch and function modes (NOTE [simulated step])."""
        with self.fake_mode, self.dispatch, SimulationFunctions(SIM_DEVICE, self.semantics):
            yield self

    def training_step(self) -> TrainingStep:
        """A fresh TrainingStep (new optimizer) on the fake model, set up for the device's kernels."""
        with self.session():
            step = TrainingStep(self.loaded.workload)
            prepare_optimizer(step.optimizer, self.semantics)
        return step

    def rebuild(self, **shape_overrides: ShapeValue) -> "SimulatedWorkload":
        return load_simulated(self.loaded.spec, {**self.loaded.shape, **shape_overrides},
                              dtype=self.loaded.dtype, target_device=self.device_model)


def load_simulated(spec: str | LoadedWorkload, shape: dict[str, ShapeValue] | None = None, *,
                   dtype: str = "float32", target_device: str | DeviceModel = "cpu") -> SimulatedWorkload:
    """Build ``spec`` at ``shape`` for simulation: on meta, then fake (NOTE [building without memory]).

    ``spec`` may be a LoadedWorkload: it is rebuilt from its spec, shape and dtype (never copied).
    """
    if isinstance(spec, LoadedWorkload):
        shape = {**spec.shape, **(shape or {})}
        dtype = spec.dtype
        spec = spec.spec
    model = get_device_model(target_device)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with torch.device("meta"):
        loaded = load_workload_on_meta(spec, shape, dtype=dtype)
    loaded.device = model.semantics.value
    loaded.workload = fake_workload(loaded.workload, fake_mode, SIM_DEVICE)
    return SimulatedWorkload(loaded=loaded, device_model=model, fake_mode=fake_mode,
                             dispatch=SimulationDispatch(model.semantics))
