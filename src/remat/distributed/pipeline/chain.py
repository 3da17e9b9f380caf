"""How a model runs as ``embed -> blocks -> head``: by its own protocol, or split by module path.

NOTE [pipeline by module path]
A model that defines ``pipeline_embed``/``pipeline_head`` (NOTE [pipeline stages] in engine.py)
says itself where its blocks start and end: :class:`ProtocolChain`, the override. Any other
``nn.Module`` with one ``nn.ModuleList`` of repeated blocks (the longest, ``find_blocks``: an HF
causal LM's ``model.layers``, ``nn.TransformerEncoder``'s ``layers``) is split by module path,
running the model's *own* forward for what comes before and after the blocks
(:class:`PathChain`):

* embed (first stage): ``model(inputs)`` until ``blocks[0]`` is called; a forward pre-hook
  there stops the forward and hands back its hidden input (the first positional argument).
  The modules called before it are the first stage's extras.
* the blocks take more than the hidden state (an HF decoder layer: the causal mask, rotary
  ``position_embeddings``, ``position_ids``; ``nn.TransformerEncoderLayer``: ``src_mask``...).
  Those *context* arguments are recorded once per block on a sample microbatch (shape of one
  microbatch) and replayed to every block on every stage. That is right only when they do not
  depend on the batch's values nor carry a gradient, so both are checked: a context tensor that
  requires grad (computed from parameters) or an object that is not a tensor, number, string or
  None (a KV cache) is refused up front; and every first-stage forward compares the context its
  real inputs give with the recorded one and raises a WorkloadError on any difference (a padding
  mask): never a silently different step.
* head (last stage): ``model(sample_inputs)`` again, with every block's forward swapped for one
  that returns the last stage's hidden state: the model's code after the blocks (final norm,
  pooling, the LM head, its output object) runs on it. The modules before the blocks run too,
  on the fixed sample microbatch; their output is discarded (no gradient reaches them there),
  so the last stage also holds them (their parameters, never their gradients or optimizer
  state), and blocks of other stages are parameter-free placeholders there (:class:`Placeholder`,
  whose attributes read through to a meta-device copy for a model that inspects ``blocks[0]``).
  Parameters used both before and after the blocks (tied embeddings) are the tied ones whose
  gradients the first and last stage sum.
A block's output is its hidden state or a tuple whose first element is (recorded, and re-wrapped
the same way when swapped). torch's ``PipelineStage`` takes only tensors as a stage's output, so
the last stage hands an output object (an HF ``CausalLMOutputWithPast``) over as the tuple of its
pytree leaves, and the loss gets the object back (``pack``/``unpack``, the treespec recorded on
the first call) before the workload's own loss reads ``.logits`` from it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator

from ...errors import WorkloadError

PROTOCOL = ("pipeline_embed", "pipeline_head")


class _Reached(Exception):
    """Raised by the pre-hook on ``blocks[0]``: the forward got to the blocks (NOTE [pipeline by module path])."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("the forward reached the first block")
        self.args, self.kwargs = args, kwargs


@dataclasses.dataclass
class BlockCall:
    """One block's call, minus its hidden state: replayed on every stage."""

    args: tuple[Any, ...]        # positional arguments after the hidden state
    kwargs: dict[str, Any]
    tuple_out: bool              # the block returns (hidden, ...) rather than hidden


def called_modules(model: Any, fn: Callable[[], Any]) -> set[str]:
    """Names of every module whose forward runs during ``fn()`` (forward pre-hooks, removed after)."""
    import torch
    seen: set[str] = set()
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.add(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            fn()
    finally:
        for h in handles:
            h.remove()
    return seen


def has_protocol(model: Any) -> bool:
    return all(callable(getattr(model, m, None)) for m in PROTOCOL)


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(hidden state, other positional arguments, keyword arguments) of a block call."""
    if args:
        return args[0], args[1:], kwargs
    for name in ("hidden_states", "src", "x", "hidden", "input"):
        if name in kwargs:
            return kwargs[name], (), {k: v for k, v in kwargs.items() if k != name}
    raise WorkloadError("a block was called without a positional hidden state; remat cannot tell which argument "
                        "carries it", tip="define pipeline_embed/pipeline_head (NOTE [pipeline stages])")


def _check_constant(value: Any, where: str) -> None:
    """A context argument must be a constant: a tensor without gradient, a number, a string, None, or a
    tuple/list/dict of those (NOTE [pipeline by module path])."""
    import torch
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            raise WorkloadError(f"{where} carries a gradient (it is computed from parameters), so a pipeline "
                                "stage cannot replay it as a constant",
                                tip="define pipeline_embed/pipeline_head (NOTE [pipeline stages] in "
                                    "remat/distributed/pipeline/engine.py)")
        return
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _check_constant(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_constant(v, f"{where}[{k!r}]")
        return
    raise WorkloadError(f"{where} is a {type(value).__name__}, not a tensor or a number: a pipeline stage cannot "
                        "replay it (a cache object? turn it off, e.g. config.use_cache=False)",
                        tip="or define pipeline_embed/pipeline_head (NOTE [pipeline stages])")


def _same(a: Any, b: Any) -> bool:
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _detached(value: Any) -> Any:
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class _Packing:
    """NOTE [pipeline by module path]: the last stage's output as tensors for torch, as the object for the loss."""

    out_spec: Any = None    # the treespec of a non-tensor output (None: the output is a tensor)

    def pack(self, out: Any) -> Any:
        import torch
        from torch.utils import _pytree as pytree
        if isinstance(out, torch.Tensor):
            return out
        leaves, self.out_spec = pytree.tree_flatten(out)
        return tuple(leaves)

    def unpack(self, output: Any) -> Any:
        from torch.utils import _pytree as pytree
        if self.out_spec is None:
            return output
        return pytree.tree_unflatten(list(output if isinstance(output, (tuple, list)) else (output,)), self.out_spec)


class ProtocolChain(_Packing):
    """The model's own ``pipeline_embed``/``pipeline_head`` around ``blocks`` (NOTE [pipeline stages])."""

    def __init__(self, blocks_path: str) -> None:
        self.blocks_path = blocks_path

    def embed(self, model: Any, inputs: Any) -> Any:
        return model.pipeline_embed(inputs)

    def block(self, model: Any, i: int, x: Any) -> Any:
        return model.get_submodule(self.blocks_path)[i](x)

    def head(self, model: Any, x: Any) -> Any:
        return model.pipeline_head(x)

    def modules_around(self, model: Any, sample_inputs: Any) -> tuple[set[str], set[str], set[str]]:
        """(called by embed, called by head, the last stage's scaffold): module names outside the blocks."""
        embedded: list[Any] = []
        embed = called_modules(model, lambda: embedded.append(self.embed(model, sample_inputs)))
        head = called_modules(model, lambda: self.head(model, embedded[0]))
        return embed, head, set()


class PathChain(_Packing):
    """NOTE [pipeline by module path]: the model's forward, stopped at / resumed after its blocks."""

    def __init__(self, blocks_path: str, calls: list[BlockCall], sample_inputs: Any) -> None:
        self.blocks_path, self.calls, self.sample_inputs = blocks_path, calls, sample_inputs

    @classmethod
    def record(cls, model: Any, blocks_path: str, sample_inputs: Any) -> "PathChain":
        """Each block's context on ``sample_inputs`` (gradients on, to see which carry one; RNG restored)."""
        import torch
        blocks = model.get_submodule(blocks_path)
        seen: dict[int, BlockCall] = {}

        def pre(i: int) -> Callable[..., None]:
            def hook(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                _, rest, kw = _hidden(args, kwargs)
                for j, v in enumerate(rest):
                    _check_constant(v, f"block {blocks_path}.{i}'s argument {j + 1}")
                for k, v in kw.items():
                    _check_constant(v, f"block {blocks_path}.{i}'s argument {k}")
                seen[i] = BlockCall(args=_detached(rest), kwargs=_detached(kw), tuple_out=False)
            return hook

        def post(i: int) -> Callable[..., None]:
            def hook(mod: Any, args: Any, output: Any) -> None:
                seen[i].tuple_out = isinstance(output, (tuple, list))
            return hook
        handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(pre(i), with_kwargs=True),
                                                              b.register_forward_hook(post(i)))]
        try:
            with torch.random.fork_rng(devices=[]):
                model(sample_inputs)
        finally:
            for h in handles:
                h.remove()
        missing = [i for i in range(len(blocks)) if i not in seen]
        if missing:
            raise WorkloadError(f"the model's forward did not call {blocks_path}.{missing[0]} on a sample microbatch, "
                                "so it cannot be split at its blocks",
                                tip="define pipeline_embed/pipeline_head (NOTE [pipeline stages])")
        return cls(blocks_path, [seen[i] for i in range(len(blocks))], sample_inputs)

    def embed(self, model: Any, inputs: Any) -> Any:
        """``model(inputs)`` up to ``blocks[0]``; its hidden input, after checking the replayed context."""
        first = model.get_submodule(self.blocks_path)[0]

        def stop(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            raise _Reached(args, kwargs)
        handle = first.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            model(inputs)
        except _Reached as reached:
            hidden, rest, kw = _hidden(reached.args, reached.kwargs)
        else:
            raise WorkloadError(f"the model's forward never called {self.blocks_path}.0")
        finally:
            handle.remove()
        call = self.calls[0]
        if not (_same(rest, call.args) and _same(kw, call.kwargs)):
            raise WorkloadError(f"the arguments {self.blocks_path}.0 takes besides the hidden state differ from those "
                                "of the sample microbatch (they depend on the batch, e.g. a padding mask): a pipeline "
                                "split by module path replays them as constants and would train another step",
                                tip="define pipeline_embed/pipeline_head (NOTE [pipeline stages] in "
                                    "remat/distributed/pipeline/engine.py)")
        return hidden

    def block(self, model: Any, i: int, x: Any) -> Any:
        call = self.calls[i]
        out = model.get_submodule(self.blocks_path)[i](x, *call.args, **call.kwargs)
        return out[0] if call.tuple_out else out

    def head(self, model: Any, x: Any) -> Any:
        """``model(sample_inputs)`` with every block returning ``x``: the model's own code after its blocks."""
        with self._blocks_return(model, x):
            return model(self.sample_inputs)

    @contextlib.contextmanager
    def _blocks_return(self, model: Any, x: Any) -> Iterator[None]:
        blocks = model.get_submodule(self.blocks_path)
        saved = []
        for i, b in enumerate(blocks):
            out = (x,) if self.calls[i].tuple_out else x
            saved.append(b.__dict__.get("forward"))
            object.__setattr__(b, "forward", lambda *a, _out=out, **k: _out)
        try:
            yield
        finally:
            for b, f in zip(blocks, saved):
                if f is None:
                    del b.__dict__["forward"]
                else:
                    object.__setattr__(b, "forward", f)

    def modules_around(self, model: Any, sample_inputs: Any) -> tuple[set[str], set[str], set[str]]:
        """(called before the blocks, called after them, the last stage's scaffold = those before)."""
        import torch
        blocks = model.get_submodule(self.blocks_path)
        order: list[tuple[str, bool]] = []     # (name, after the blocks)
        after = [False]
        handles = [m.register_forward_pre_hook(lambda mod, args, n=n: order.append((n, after[0])))
                   for n, m in model.named_modules() if n]
        handles.append(blocks[len(blocks) - 1].register_forward_hook(lambda *a: after.__setitem__(0, True)))
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                model(sample_inputs)
        finally:
            for h in handles:
                h.remove()
        before = {n for n, late in order if not late}
        late = {n for n, is_late in order if is_late}
        return before, late, set(before)


class Placeholder:
    """Factory of parameter-free stand-ins for blocks another stage holds (NOTE [pipeline by module path])."""

    @staticmethod
    def of(block: Any) -> Any:
        import torch
        import torch.nn as nn
        # a copy on the meta device, never materialised: each parameter and buffer maps to a meta twin
        memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                                for p in block.parameters()}
        memo.update({id(b): torch.empty_like(b, device="meta") for b in block.buffers()})
        shadow = copy.deepcopy(block, memo)

        class BlockPlaceholder(nn.Module):
            """Holds no parameters; reads attributes through to a meta-device copy of the block; its forward
            is swapped for the head's (it is never run otherwise)."""

            def __init__(self) -> None:
                super().__init__()
                object.__setattr__(self, "_shadow", shadow)

            def __getattr__(self, name: str) -> Any:
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    return getattr(object.__getattribute__(self, "_shadow"), name)

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("a placeholder block ran: remat's pipeline stage is wrong (please report it)")
        return BlockPlaceholder()


def make_chain(model: Any, blocks_path: str, sample_inputs: Any) -> ProtocolChain | PathChain:
    """The protocol when the model defines it (the override), else the split by module path."""
    return ProtocolChain(blocks_path) if has_protocol(model) else PathChain.record(model, blocks_path, sample_inputs)
