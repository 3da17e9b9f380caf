"""Pipeline parallelism: stages built from the workload's model, the split, the config, the launch.

NOTE [pipeline stages]
A model is pipelined as ``embed -> blocks -> head``. Without more, remat splits it by module
path at its repeated blocks, running the model's own forward around them (NOTE [pipeline by
module path] in chain.py). The override: the model defines
``pipeline_embed(inputs) -> hidden`` and ``pipeline_head(hidden) -> outputs`` and its forward is
``pipeline_head(blocks[n-1](...blocks[0](pipeline_embed(inputs))))`` over one ``nn.ModuleList``
of blocks that map hidden -> hidden (the built-in ``gpt``: ``wte + wpe + drop``, ``h``,
``ln_f + lm_head``). Every rank builds the *whole* model from the workload (same seed, so the
same weights), applies its stage's plan by the whole model's module names (so plans and their
fingerprints are the whole model's), then keeps only what its stage runs:

  stage 0        pipeline_embed + blocks[0:s1]
  stage k        blocks[s_k:s_{k+1}]
  last stage     blocks[s_{p-1}:n] + pipeline_head, and the workload's loss

Modules a stage never calls are detached from the model (set to None), so their parameters,
gradients and optimizer state are not on that rank; which modules ``pipeline_embed`` and
``pipeline_head`` call is recorded once, by forward pre-hooks, on one microbatch. A parameter
used by both (gpt ties ``lm_head.weight`` to ``wte.weight``) lives on the first and the last
stage; after each backward their two partial gradients are summed (``all_reduce`` over a
group of those two ranks), which is what the unsplit model's autograd does.

The loss: the batch must be ``(inputs, targets)`` and ``workload.loss(model, batch)`` must call
``model(inputs)`` once; the last stage calls it with a stand-in model that returns the stage's
output, so the workload's own loss code runs unchanged. ``torch.distributed.pipelining`` splits
``inputs`` and ``targets`` into ``m`` microbatches along dim 0 and scales the gradients by
``1/m`` (``scale_grads=True``): the step's gradient is that of the mean microbatch loss.

NOTE [default split]
Without ``--split-points`` the blocks are cut into ``p`` contiguous stages that minimise the
largest stage forward time, measured on this process before the launch: the least of 5 warm
forwards (no autograd recording) of ``pipeline_embed`` (counted on stage 0), each block, and
``pipeline_head`` + loss (counted on the last stage), at the microbatch shape.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from ..config import DistributedConfig
from ..launch import WORKER_MODULE, RankProgram, RankStatus, diagnose_launch, launch_ranks, rank_state
from ...errors import DistributedError, WorkloadError
from .chain import PathChain, Placeholder, ProtocolChain, has_protocol, make_chain
from ..report import DistributedReport
from ...types import ProgressFn, no_progress

PIPELINE_REPORT_NAME = "pipeline.json"


# -- the split ---------------------------------------------------------------------------------------

def _check_pipelinable(model: Any) -> None:
    """NOTE [pipeline stages], NOTE [pipeline by module path] (chain.py): an ``nn.Module`` that defines
    ``pipeline_embed``/``pipeline_head``, or has one ``nn.ModuleList`` of repeated blocks to split at."""
    import torch.nn as nn
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"the model ({type(model).__name__}) cannot be split into pipeline stages: it is not an "
                            "nn.Module")
    if has_protocol(model):
        return
    try:
        find_blocks(model)
    except WorkloadError as exc:
        raise WorkloadError(f"the model ({type(model).__name__}) cannot be split into pipeline stages: {exc.message}",
                            tip="define pipeline_embed(inputs) -> hidden and pipeline_head(hidden) -> outputs so that "
                                "forward = head(blocks(embed(inputs))) (NOTE [pipeline stages] in "
                                "remat/distributed/pipeline/engine.py)") from None


def find_blocks(model: Any) -> str:
    """The path of the longest ``nn.ModuleList`` whose children all share one class (the repeated blocks)."""
    import torch.nn as nn
    best, n = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > n and len({type(c) for c in m}) == 1:
            best, n = name, len(m)
    if best is None or n < 2:
        raise WorkloadError(f"no ModuleList of repeated blocks found in {type(model).__name__} to split into stages",
                            tip="pass --split-points naming the blocks, e.g. h.2")
    return best


def parse_split_points(points: list[str], n_stages: int, model: Any) -> tuple[str, list[int]]:
    """``["h.2", "h.4"]`` -> (``"h"``, [0, 2, 4, n]): the blocks path and the stage boundaries."""
    import torch.nn as nn
    if len(points) != n_stages - 1:
        raise DistributedError(f"{len(points)} split points make {len(points) + 1} stages, but the world size is "
                               f"{n_stages} (one stage per rank)")
    parents, cuts = set(), []
    for p in points:
        head, _, idx = p.rpartition(".")
        if not head or not idx.isdigit():
            raise DistributedError(f"split point {p!r} must name a block as PATH.INDEX, e.g. h.2")
        parents.add(head)
        cuts.append(int(idx))
    if len(parents) != 1:
        raise DistributedError(f"split points must all cut the same ModuleList, got {sorted(parents)}")
    path = parents.pop()
    try:
        blocks = model.get_submodule(path)
    except AttributeError:
        raise DistributedError(f"split points name {path!r}, which the model does not have") from None
    if not isinstance(blocks, nn.ModuleList):
        raise DistributedError(f"split points must cut an nn.ModuleList; {path!r} is {type(blocks).__name__}")
    bounds = [0, *cuts, len(blocks)]
    if any(b >= a for a, b in zip(bounds[1:], bounds)) :
        raise DistributedError(f"split points {points} must be increasing, inside 1..{len(blocks) - 1}: every stage "
                               f"needs at least one of the {len(blocks)} blocks of {path}")
    return path, bounds


def balanced_bounds(costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Contiguous cut of ``costs`` into ``stages`` non-empty groups minimising the largest group's sum
    (``first_extra``/``last_extra`` added to the first/last group). Exact dynamic programme, O(p n^2)."""
    n = len(costs)
    if stages > n:
        raise DistributedError(f"{stages} stages need at least {stages} blocks, the model has {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: least max-stage cost placing blocks[0:j] into k stages; cut[k][j]: where stage k starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                c = prefix[j] - prefix[i] + (first_extra if k == 1 else 0.0) + (last_extra if k == stages and j == n else 0.0)
                v = max(best[k - 1][i], c)
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    bounds = [n]
    j = n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    return bounds[::-1]


def microbatch_shape(shape: Mapping[str, Any], microbatches: int, batch_key: str = "batch_size") -> dict[str, Any]:
    """The workload's shape with ``batch_size`` divided by ``microbatches`` (must divide evenly)."""
    shape = dict(shape)
    b = shape.get(batch_key)
    if b is None:
        raise DistributedError(f"the pipeline engine needs the batch size in --shape ({batch_key}=N) to split it "
                               f"into {microbatches} microbatches")
    if not isinstance(b, int) or b % microbatches:
        raise DistributedError(f"{batch_key}={b} does not split into {microbatches} equal microbatches",
                               tip=f"use a {batch_key} that is a multiple of --microbatches")
    shape[batch_key] = b // microbatches
    return shape


def default_split(spec: str, shape: Mapping[str, Any], stages: int, microbatches: int, *, dtype: str = "float32",
                  seed: int = 0) -> tuple[list[str], str]:
    """NOTE [default split]: (split points, how they were found)."""
    import torch
    from ...clock import StepClock
    from ...workload.loader import load_workload
    torch.manual_seed(seed)
    loaded = load_workload(spec, microbatch_shape(shape, microbatches), dtype=dtype)
    wl = loaded.workload
    model = wl.model
    _check_pipelinable(model)
    path = find_blocks(model)
    blocks = model.get_submodule(path)
    inputs, targets = split_batch(wl.batch(0))
    chain = make_chain(model, path, inputs)

    clock = StepClock(next(model.parameters()).device)

    with torch.no_grad():
        for _ in range(2):   # warm-up of the whole chain: first calls pay one-off kernel set-up
            wl.loss(model, (inputs, targets))
        # every piece's input, once; then 5 rounds over all pieces, each piece's least time kept: round-robin,
        # so a burst of load from other processes on the host lands on one round of every piece, not on all
        # the timings of a few consecutive blocks (which then looked 10x slower and skewed the split)
        hs = [chain.embed(model, inputs)]
        for i in range(len(blocks)):
            hs.append(chain.block(model, i, hs[-1]))
        pieces: list[Callable[[], Any]] = [lambda: chain.embed(model, inputs)]
        pieces += [lambda i=i, h=h: chain.block(model, i, h) for i, h in enumerate(hs[:-1])]
        pieces.append(lambda: wl.loss(_Fixed(chain.head(model, hs[-1])), (inputs, targets)))
        best = [float("inf")] * len(pieces)
        for _ in range(5):
            for i, fn in enumerate(pieces):
                best[i] = min(best[i], clock.time(fn)[1])   # ms; NOTE [device-correct timing] in remat/clock.py
    embed_ms, costs, head_ms = best[0], best[1:-1], best[-1]
    bounds = balanced_bounds(costs, stages, embed_ms, head_ms)
    points = [f"{path}.{b}" for b in bounds[1:-1]]
    what = (f"default: even by measured forward time (ms per block: "
            f"{', '.join(f'{c:.2f}' for c in costs)}; embed {embed_ms:.2f}, head+loss {head_ms:.2f})")
    return points, what


def check_split(spec: str, shape: Mapping[str, Any], points: list[str], stages: int, microbatches: int, *,
                dtype: str = "float32") -> None:
    """Refuse a world size, a model or split points that cannot make the pipeline, before any measuring."""
    if stages < 2:
        raise DistributedError(f"a pipeline needs at least 2 stages (world size >= 2), got {stages}")
    from ...workload.loader import load_workload
    wl = load_workload(spec, microbatch_shape(shape, microbatches), dtype=dtype).workload
    _check_pipelinable(wl.model)
    inputs, _ = split_batch(wl.batch(0))
    path = parse_split_points(points, stages, wl.model)[0] if points else find_blocks(wl.model)
    make_chain(wl.model, path, inputs)   # split by module path: its context checks, before any launch


def split_batch(batch: Any) -> tuple[Any, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise WorkloadError("the pipeline engine needs batches of (inputs, targets)",
                            tip="NOTE [pipeline stages] in remat/distributed/pipeline/engine.py")
    return batch[0], batch[1]


class _Fixed:
    """A stand-in model for the workload's loss on the last stage: returns the stage's output."""

    def __init__(self, output: Any) -> None:
        self.output = output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def make_loss_fn(workload: Any, unpack: Callable[[Any], Any] = lambda output: output) -> Callable[[Any, Any], Any]:
    """``loss_fn(output, target)`` for torch's schedules, from ``workload.loss(model, (inputs, targets))``;
    ``unpack``: the last stage's tensors back to the model's output object (chain.py)."""
    from ...workload.contract import call_user

    def loss_fn(output: Any, target: Any) -> Any:
        return call_user("the workload's loss", workload.loss, _Fixed(unpack(output)), (None, target))
    return loss_fn


# -- stage modules -----------------------------------------------------------------------------------

@dataclasses.dataclass
class StageLayout:
    """Where the stages cut the model: the blocks path, boundaries, and what embed and head call."""

    blocks_path: str
    bounds: list[int]
    embed_modules: set[str]
    head_modules: set[str]
    tied: list[str]        # names of parameters used by both embed and head (gradients summed across stages)
    chain: ProtocolChain | PathChain    # how embed, a block and head run (chain.py)
    scaffold: set[str] = dataclasses.field(default_factory=set)   # the last stage's too (NOTE [pipeline by module path])

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_blocks(self, k: int) -> list[str]:
        return [f"{self.blocks_path}.{i}" for i in range(self.bounds[k], self.bounds[k + 1])]

    def stage_modules(self, k: int) -> set[str]:
        keep = set(self.stage_blocks(k))
        if k == 0:
            keep |= self.embed_modules
        if k == self.stages - 1:
            keep |= self.head_modules | self.scaffold
        return keep

    def trained_modules(self, k: int) -> set[str]:
        """What stage ``k`` trains: its modules less the last stage's scaffold (run, never given a gradient)."""
        return self.stage_modules(k) - (self.scaffold - self.head_modules)


def stage_layout(model: Any, split_points: list[str], stages: int, sample_inputs: Any) -> StageLayout:
    _check_pipelinable(model)
    path, bounds = parse_split_points(split_points, stages, model)
    chain = make_chain(model, path, sample_inputs)
    embed, head, scaffold = chain.modules_around(model, sample_inputs)
    blocks_prefix = path + "."

    def outside(names: set[str]) -> set[str]:
        """Neither a block nor an ancestor of the blocks (the model, ``model.model`` of an HF LM)."""
        return {n for n in names if not n.startswith(blocks_prefix) and n != path and not path.startswith(n + ".")}
    embed, head, scaffold = outside(embed), outside(head), outside(scaffold)

    def params_of(names: set[str]) -> dict[int, str]:
        out = {}
        for n in sorted(names):
            for pn, prm in model.get_submodule(n).named_parameters(prefix=n):
                out.setdefault(id(prm), pn)
        return out
    pe, ph = params_of(embed), params_of(head)
    tied = sorted(pe[i] for i in pe.keys() & ph.keys())
    return StageLayout(path, bounds, embed, head, tied, chain, scaffold)


def stage_examples(model: Any, layout: StageLayout, k: int, sample_inputs: Any) -> tuple[Any, Any]:
    """(input, output) of stage ``k`` on one microbatch, on the whole model, without autograd or RNG side
    effects: the example tensors torch's ``PipelineStage`` takes for static shapes."""
    import torch
    chain = layout.chain
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        x = chain.embed(model, sample_inputs)
        for i in range(layout.bounds[k]):
            x = chain.block(model, i, x)
        stage_in = sample_inputs if k == 0 else x
        for i in range(layout.bounds[k], layout.bounds[k + 1]):
            x = chain.block(model, i, x)
        out = chain.pack(chain.head(model, x)) if k == layout.stages - 1 else x
    # the metadata says which tensors carry gradients: a received activation does (else the stage sends no
    # input gradient back and the previous stage's backward silently does nothing), and so does the output
    if k > 0:
        stage_in = stage_in.detach().requires_grad_(stage_in.is_floating_point())
    def example(t: Any) -> Any:
        return t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
    return stage_in, tuple(example(t) for t in out) if isinstance(out, tuple) else example(out)


def prune_to_stage(model: Any, keep: set[str]) -> None:
    """Detach (set to None) every module neither in ``keep``, inside one, nor an ancestor of one."""
    def needed(name: str) -> bool:
        return any(name == k or name.startswith(k + ".") or k.startswith(name + ".") for k in keep)
    for name, module in list(model.named_modules()):
        if not name or not needed(name):
            continue
        for child, sub in list(module._modules.items()):
            full = f"{name}.{child}"
            if sub is not None and not needed(full):
                module._modules[child] = None
    for child, sub in list(model._modules.items()):
        if sub is not None and not needed(child):
            model._modules[child] = None


def build_stage_module(model: Any, layout: StageLayout, k: int) -> Any:
    """The ``nn.Module`` stage ``k`` runs (NOTE [pipeline stages]); prunes ``model`` to it."""
    return build_stage_modules(model, layout, [k])[0]


def build_stage_modules(model: Any, layout: StageLayout, ks: list[int]) -> list[Any]:
    """The ``nn.Module`` of each stage in ``ks`` (one rank's stages), sharing ``model`` pruned to their union."""
    import torch.nn as nn

    class PipelineStageModule(nn.Module):
        """Stage ``k`` of ``embed -> blocks -> head``. Alone on its rank, ``self.model`` is the pruned whole
        model; with other stages on the rank, each registers only the modules it runs (``owned``) and reaches
        the model unregistered: torch scales each stage's ``parameters()`` by 1/m after its backwards, so a
        parameter registered in two stages would be scaled twice."""

        def __init__(self, k: int, own: bool) -> None:
            super().__init__()
            if own:
                self.owned = nn.ModuleDict({n.replace(".", "__"): model.get_submodule(n)
                                            for n in sorted(layout.trained_modules(k))})
                object.__setattr__(self, "_whole", model)   # reached, not registered (nn.Module.__setattr__ would)
            else:
                self.model = model
            self.first, self.last = k == 0, k == layout.stages - 1
            self.start, self.stop = layout.bounds[k], layout.bounds[k + 1]

        def forward(self, x: Any) -> Any:
            whole = getattr(self, "_whole", None) or self.model
            chain = layout.chain
            if self.first:
                x = chain.embed(whole, x)
            for i in range(self.start, self.stop):
                x = chain.block(whole, i, x)
            return chain.pack(chain.head(whole, x)) if self.last else x

    placeholders = _placeholders(model, layout, ks)
    prune_to_stage(model, set().union(*(layout.stage_modules(k) for k in ks)))
    blocks = model.get_submodule(layout.blocks_path)
    for i, ph in placeholders.items():
        blocks[i] = ph
    # a scaffold is reached, not registered: its parameters are not the stage's to train, scale or compare
    return [PipelineStageModule(k, own=len(ks) > 1 or bool(layout.scaffold - layout.head_modules)
                                and k == layout.stages - 1) for k in ks]


def _placeholders(model: Any, layout: StageLayout, ks: list[int]) -> dict[int, Any]:
    """NOTE [pipeline by module path]: on a rank holding the last stage of a split by module path, the head runs
    the model's whole forward, so every block of another stage needs a parameter-free stand-in in its slot."""
    if not isinstance(layout.chain, PathChain) or layout.stages - 1 not in ks:
        return {}
    mine = {i for k in ks for i in range(layout.bounds[k], layout.bounds[k + 1])}
    blocks = model.get_submodule(layout.blocks_path)
    return {i: Placeholder.of(blocks[i]) for i in range(len(blocks)) if i not in mine}


# -- the launch --------------------------------------------------------------------------------------

def run_pipeline_config(config: DistributedConfig, *, work_dir: Path | str | None = None,
                        wall_timeout_s: float | None = None, progress: ProgressFn = no_progress) -> DistributedReport:
    """Run ``config`` (engine pipeline) on ``world_size`` local ranks with the launcher of NOTE [launcher] (same
    rank program and files, same diagnosis: a dead or hung stage is a DistributedError naming its rank)."""
    assert config.pipeline is not None
    return launch_ranks(config, PIPELINE_PROGRAM, what=f"pipeline {config.pipeline.schedule.value} "
                        f"x{config.world_size}, {config.pipeline.microbatches} microbatches",
                        work_dir=work_dir, wall_timeout_s=wall_timeout_s, progress=progress)


def _diagnose_pipeline(out: Path, config: DistributedConfig, returncode: int | None,
                       timed_out: float | None) -> DistributedError:
    """launch.diagnose, plus the pipeline's hung stage: its neighbours fail first (their p2p op times out
    after ``timeout_s``), the hung rank only when the launcher stops it; then it is the hung rank we name."""
    err = diagnose_launch(out, config, returncode, timed_out)
    states = [rank_state(out, r) for r in range(config.world_size)]
    stopped = [s for s in states if s.kind is RankStatus.STOPPED]
    errors = [s for s in states if s.kind is RankStatus.ERROR]
    if timed_out is None and stopped and errors and all(s.follow_on for s in errors):
        hung = stopped[0]
        others = "; ".join(f"rank {s.rank} {s.detail}" for s in states if s is not hung)
        return DistributedError(
            f"rank {hung.rank} (pipeline stage {hung.rank}) hung: its peers' p2p ops timed out after "
            f"{config.timeout_s:g} s waiting for it, and it {hung.detail} (then: {others})", tip=err.tip)
    return err


# the pipeline engine's report and diagnosis for the one launcher and rank program (NOTE [launcher])
PIPELINE_PROGRAM = RankProgram(module=WORKER_MODULE, report_name=PIPELINE_REPORT_NAME, name="pipeline",
                               read_report=DistributedReport.from_json, diagnose=_diagnose_pipeline)
