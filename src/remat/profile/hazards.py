"""Hazard inventory: what a candidate does in forward that a replay would do again."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..host_rng import HostRng
from ..types import HazardKind
from .model import HazardRecord

_SIMPLE = (int, float, str, bool, type(None))


def python_state(module: nn.Module) -> dict[str, Any]:
    """A cheap, comparable snapshot of the Python attributes a forward might change."""
    out: dict[str, Any] = {}
    for sub_name, sub in module.named_modules():
        for k, v in vars(sub).items():
            if k.startswith("_") or k == "training":
                continue
            key = f"{sub_name}.{k}" if sub_name else k
            if isinstance(v, _SIMPLE):
                out[key] = v
            elif isinstance(v, (list, dict, set, tuple)):
                out[key] = ("len", len(v))
    return out


def buffer_versions(module: nn.Module) -> dict[str, int]:
    return {n: b._version for n, b in module.named_buffers()}


@dataclasses.dataclass
class HazardProbe:
    """Before/after snapshots around one candidate's forward."""

    module: nn.Module
    compare_rng_state: bool = True   # off under FakeTensorMode: fake dropout leaves the real RNG alone
    buffers: dict[str, int] = dataclasses.field(default_factory=dict)
    python: dict[str, Any] = dataclasses.field(default_factory=dict)
    rng: torch.Tensor | None = None
    host: HostRng | None = None      # Python's and numpy's generators (NOTE [host RNG]): real draws even under fake mode
    found: list[HazardRecord] = dataclasses.field(default_factory=list)

    def before(self) -> None:
        self.buffers = buffer_versions(self.module)
        self.python = python_state(self.module)
        self.rng = torch.random.get_rng_state() if self.compare_rng_state else None
        self.host = HostRng.capture()

    def after(self) -> None:
        mutated = [n for n, v in buffer_versions(self.module).items() if self.buffers.get(n) != v]
        if mutated:
            owners = [self.module.get_submodule(n.rpartition(".")[0]) if "." in n else self.module for n in mutated]
            guardable = all(isinstance(o, _BatchNorm) for o in owners)
            self._add(HazardKind.BUFFER_MUTATION, f"{', '.join(mutated)} mutated in forward", guardable)
        now = python_state(self.module)
        changed = [f"{k}: {self.python.get(k)!r} -> {now.get(k)!r}" for k in sorted(now.keys() | self.python.keys())
                   if now.get(k) != self.python.get(k)]
        if changed:
            self._add(HazardKind.PYTHON_STATE, "; ".join(changed[:5]))
        drawn = self._generators_drawn()
        if drawn:
            self._add(HazardKind.RNG, f"draws from the {' and '.join(drawn)} RNG in forward (e.g. dropout, drop-path): "
                                      "safe while RNG state is preserved (NOTE [host RNG])")

    def _generators_drawn(self) -> list[str]:
        """The global generators this forward drew from: torch's CPU one, Python's ``random``, numpy's."""
        torch_cpu = self.rng is not None and not torch.equal(self.rng, torch.random.get_rng_state())
        host = self.host.differences(HostRng.capture()) if self.host is not None else []
        return (["CPU"] if torch_cpu else []) + host

    def _add(self, kind: HazardKind, detail: str, guardable: bool = False) -> None:
        if not any(h.kind is kind for h in self.found):
            self.found.append(HazardRecord(kind=kind, detail=detail, guardable=guardable))
