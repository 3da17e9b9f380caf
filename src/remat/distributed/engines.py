"""Wrapping a (planned) model in DDP or FSDP2, with timed or no-op communication.

The plan is applied to the bare model *before* this wrapping (torchtitan's order: activation
checkpointing, then data parallelism), and the wrapping itself never depends on the plan,
so the control and the planned run have the same engine configuration.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DistributedError
from .config import DistributedConfig, Engine
from .instrument import CommRecorder, DDPHookState, noop_allreduce_hook, timed_allreduce_hook


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineContext:
    """What every wrapping in this process shares."""

    config: DistributedConfig
    device: torch.device
    mesh: object | None = None  # DeviceMesh (FSDP2 only), created once per process


def make_context(config: DistributedConfig, device: torch.device) -> EngineContext:
    mesh = None
    if config.engine is Engine.FSDP2:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return EngineContext(config=config, device=device, mesh=mesh)


def shard_units(model: nn.Module) -> list[str]:
    """FSDP2 units: every child of every outermost ``nn.ModuleList`` (transformer blocks), then the root.

    Chosen from the module tree alone, so the control and the planned run shard the same way.
    """
    units: list[str] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name == u or name.startswith(u + ".") for u in inside):
            continue
        if isinstance(module, nn.ModuleList) and name:
            inside.append(name)
            units.extend(f"{name}.{i}" for i in range(len(module)))
    return units


def wrap(model: nn.Module, ctx: EngineContext, recorder: CommRecorder | None) -> nn.Module:
    """Wrap ``model`` in the configured engine; ``recorder=None`` installs the no-op (ablation) comm."""
    if ctx.config.engine is Engine.DDP:
        return _wrap_ddp(model, ctx, recorder)
    return _wrap_fsdp2(model, ctx, recorder)


def _wrap_ddp(model: nn.Module, ctx: EngineContext, recorder: CommRecorder | None) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids, find_unused_parameters=ctx.config.find_unused_parameters)
    if recorder is None:
        ddp.register_comm_hook(None, noop_allreduce_hook)
    else:
        ddp.register_comm_hook(DDPHookState(recorder=recorder), timed_allreduce_hook)
    return ddp


def _wrap_fsdp2(model: nn.Module, ctx: EngineContext, recorder: CommRecorder | None) -> nn.Module:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    try:
        from . import fsdp2_comm
    except ImportError as exc:
        raise DistributedError(f"this torch ({torch.__version__}) has no FSDP2 custom comm primitives "
                               "(FSDPModule.set_custom_all_gather); collectives cannot be timed",
                               tip="use torch >= 2.8, or --engine ddp") from exc
    for name in shard_units(model):
        fully_shard(model.get_submodule(name), mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    if recorder is None:
        all_gather, reduce_scatter = fsdp2_comm.NoopAllGather(), fsdp2_comm.NoopReduceScatter()
    else:
        all_gather, reduce_scatter = fsdp2_comm.TimedAllGather(recorder), fsdp2_comm.TimedReduceScatter(recorder)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 works in place)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
