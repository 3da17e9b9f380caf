"""Compiled submodules found before ``remat.auto`` does any work (NOTE [compiled blocks]).

NOTE [compiled blocks]
torchtitan compiles each block (``torch.compile(block)`` or ``block.compile()``) and then shards.
``remat.auto`` on such a model profiles modules whose forward dynamo runs: with ``fullgraph=True``
dynamo cannot trace remat's own timing hook (remat/clock.py, called from profile/step.py) and
the call failed after 27 s as the *user's* error (``UserCodeError ... fix it there``); with
``fullgraph=False`` it took 97.7 s and planned a step that is not the compiled job's (graph
breaks at every hook). The plan is made on the eager blocks and the compiled job built from it
(``remat.apply``, then compile). So ``remat.auto`` refuses a model holding compiled modules
before it copies or runs anything, naming them: a module that is a ``torch._dynamo``
``OptimizedModule`` (``torch.compile(block)`` set as a child), or one whose ``_compiled_call_impl``
is set (``block.compile()``, which compiles in place and keeps the module's class). remat's own
compiled arms (NOTE [compiled arms] in remat/measure/compiled.py) are installed on copies it
makes, never on the model handed to ``remat.auto``.
"""

from __future__ import annotations

from torch import nn

from ..errors import AutoError

_SHOWN = 5   # compiled modules named in the message; the rest are counted


def _is_optimized_module(module: nn.Module) -> bool:
    # torch._dynamo.eval_frame.OptimizedModule, by name: importing torch._dynamo costs seconds
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def compiled_modules(model: nn.Module) -> list[str]:
    """Paths of the modules of ``model`` that run compiled (``<root>`` for the model itself), each with how:
    ``"blocks.0 (torch.compile wrapper)"`` or ``"blocks.1 (module.compile())"``. An OptimizedModule's own
    inner module (``_orig_mod``) is not listed again."""
    found: list[str] = []
    inside: list[str] = []     # the ``_orig_mod`` paths of OptimizedModules: their subtrees are covered
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") for p in inside):
            continue
        name = path or "<root>"
        if _is_optimized_module(module):
            found.append(f"{name} (torch.compile wrapper)")
            inside.append(f"{path}._orig_mod" if path else "_orig_mod")
        elif getattr(module, "_compiled_call_impl", None) is not None:
            found.append(f"{name} (module.compile())")
    return found


def check_uncompiled(model: nn.Module) -> None:
    """:class:`AutoError` naming the compiled modules of ``model``, if any (NOTE [compiled blocks])."""
    found = compiled_modules(model)
    if not found:
        return
    shown = ", ".join(found[:_SHOWN]) + (f" (+{len(found) - _SHOWN} more)" if len(found) > _SHOWN else "")
    raise AutoError(f"{len(found)} module(s) of the model run compiled: {shown}; remat.auto profiles eager modules "
                    "(dynamo cannot trace its timing hooks, and a plan measured through graph breaks is not the "
                    "compiled job's)",
                    tip="plan the uncompiled model first (remat.auto before torch.compile / module.compile(); for a "
                        "wrapper, on its ._orig_mod), then compile the blocks: the plan's wrappers compile with them")
