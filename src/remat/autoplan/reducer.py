"""DDP's reducer put back as planning found it (NOTE [DDP reducer after planning]).

NOTE [DDP reducer after planning]
DDP's reducer (``model.reducer``, C++) reduces gradients in buckets. A new one buckets the
parameters in registration order; during its first backward it records the order the gradients
became ready, and before the next forward with grad (``_pre_forward`` ->
``reducer._rebuild_buckets()``) rebuilds its buckets once, in that order, for good
(``has_rebuilt_bucket_``). Which gradient sits at which offset of a bucket decides how gloo's ring
all-reduce splits the bucket into chunks, so at 3 ranks or more it decides the order each
element's ranks are summed in: the same gradients in other buckets are reduced to sums ulps
apart. (At 2 ranks each sum is ``a + b`` however the bucket is chunked, and IEEE addition
commutes, so the 2-rank job in tests/test_examples.py cannot show it.)

``remat.auto`` profiles a DDP model in place (NOTE [wrapped models in place] in
autoplan/inplace.py), so its first profiled step was the reducer's first iteration: planning left a
reducer already rebuilt (from the profiled step's order), and :class:`StateSnapshot` restores
values, not the reducer. Measured at 4 gloo ranks (tests/fixtures/auto_ddp_state_job.py, TinyLM
``tiny``, 4 steps): the job's first step after ``remat.auto`` ran with the 27 parameters in the
rebuilt order ``[26, 25, 24, 23, 22, 21, 15, 16, 20, ...]`` where the same job without remat (and
with ``remat.apply`` of the same plan) runs ``[0, 1, ..., 26]`` and rebuilds after it; 2,843 of
the 29,568 final parameter elements differed (2,093 by 1 ulp, none by more than 6.9e-6), while
``remat.apply`` was bitwise equal. The job's step 2 peaked one bucket lower (118,272 B here, all
27 parameters in float32; a user measured 919,808 B): the rebuild, which briefly holds the old and
the new bucket, had happened during planning instead of in the job's step 2.
``reducer._reset_state()`` is no cure: it re-arms the rebuild but keeps the rebuilt buckets for
the next step.

So :class:`ReducerState` records, before planning, whether the reducer is still new (never
rebuilt, no backward recorded: ``reducer.get_backward_stats()`` is all zeros until its first
backward), and :meth:`ReducerState.restore` makes such a reducer new again: the old reducer's
autograd hooks removed, and a reducer and logger built by DDP's own constructor path
(``_build_params_for_reducer``, ``_ddp_init_helper``, as ``DistributedDataParallel.__setstate__``
does), with what the constructor or the user set on the old one carried over: static graph,
the mixed-precision parameter dtype, the comm hooks registered through ``register_comm_hook``
(their state objects are the user's, passed as they are), the optimizer-in-backward flag. A
reducer that had already run a backward is left as planning left it: either it had rebuilt (a
rebuild happens once, so planning changed no bucket) or its first iteration's order was recorded,
and the first profiled forward rebuilt from that order, as the job's next forward would have (read
from torch's reducer: the tests check that such a reducer is kept, not the job's numbers). A
built-in comm hook (``_register_builtin_comm_hook``) is not recorded where it could be registered
again, and DDP's Python reducer (compiled autograd) bypasses the C++ reducer rebuilt here: both
are refused before planning.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..errors import AutoError


def _is_new(model: nn.parallel.DistributedDataParallel) -> bool:
    """True while the reducer has run no backward: its buckets are the constructor's."""
    return not model._has_rebuilt_buckets and not any(model.reducer.get_backward_stats())


def _check_rebuildable(model: nn.parallel.DistributedDataParallel) -> None:
    if model._use_python_reducer:
        raise AutoError("this DDP model runs DDP's Python reducer (compiled autograd), and remat.auto "
                        "cannot put its state back after planning (NOTE [DDP reducer after planning])",
                        tip="call remat.auto on the model before turning on compiled autograd's DDP path")
    hook = model._get_ddp_logging_data().get("comm_hook")
    if hook and not model._comm_hooks:
        raise AutoError(f"this DDP model has the built-in comm hook {hook}, which remat.auto cannot register "
                        "again on the reducer it rebuilds after planning (NOTE [DDP reducer after planning])",
                        tip="call remat.auto before _register_builtin_comm_hook, or register the hook "
                            "with register_comm_hook")


class ReducerState:
    """Whether a DDP model's reducer was new before planning; :meth:`restore` makes it new again."""

    def __init__(self, model: nn.parallel.DistributedDataParallel) -> None:
        self.model = model
        # no reducer at all: every parameter is all-reduced by DDP's delayed hook, nothing bucketed
        self.new = getattr(model, "reducer", None) is not None and _is_new(model)
        if self.new:
            _check_rebuildable(model)

    def restore(self) -> None:
        if self.new:
            _new_reducer(self.model)


def _new_reducer(model: nn.parallel.DistributedDataParallel) -> None:
    """Replace ``model.reducer`` and ``model.logger`` by new ones, as DDP's constructor builds them."""
    model.reducer._remove_autograd_hooks()        # else the old reducer's hooks fire in every backward too
    parameters, expect_sparse_gradient = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    model._ddp_init_helper(parameters, expect_sparse_gradient, names, model.static_graph)
    model._has_rebuilt_buckets = False
    model.require_forward_param_sync = True
    if model.static_graph:
        model._static_graph_delay_allreduce_enqueued = False
        model.reducer._set_static_graph()
        model.logger._set_static_graph()
    if model.mixed_precision is not None:
        model.reducer._set_mixed_precision_param_dtype(model.mixed_precision.param_dtype)
    for hook, state in model._comm_hooks:
        model.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(model.reducer, state, hook)
    if model._lazy_init_ran and any(hasattr(p, "_in_backward_optimizers") for p in model._module_parameters):
        model.reducer._set_optimizer_in_backward()
