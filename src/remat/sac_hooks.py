"""What remat's selective (op-level) checkpoints do under a surrounding ``saved_tensors_hooks`` context.

NOTE [SAC under saved-tensor hooks]
torch 2.14 added ``respect_saved_tensors_hooks=`` to ``torch.utils.checkpoint.checkpoint`` (pytorch
PR 190581). It decides what happens to the tensors a *selective* checkpoint (a ``context_fn`` from
``create_selective_checkpoint_contexts``) keeps for backward when a ``saved_tensors_hooks`` context
is active around the region (``torch.autograd.graph.save_on_cpu()``, a user's own pack/unpack hooks):

- ``False``: the legacy behaviour, the only one torch 2.13 has. The tensors the policy saves are
  held by the checkpoint's own cache and bypass the surrounding hooks: they stay on the device.
- ``True``: the surrounding hooks pack them too (an outer ``save_on_cpu`` moves them to the host).
- ``None`` (torch's default in 2.14): ``False``, plus a ``FutureWarning`` when hooks are active,
  saying the default will become ``True``.

remat chooses ``False``, explicitly, wherever it runs a selective checkpoint (the planned region's
wrapper, eager path: ``remat/wrap/wrapper.py``; the mode dry runs: ``remat/profile/dryrun.py``), and
only where the installed torch's ``checkpoint`` has the keyword (read from its signature: torch 2.13
has none, and would pass an unknown keyword on to the module's ``forward``). Why ``False``: every
figure a plan carries (each region's saved bytes, the predicted and the measured peak, the verified
equivalence) was measured with the SAC-saved tensors on the device, as torch 2.13 keeps them; a
torch whose default flips must not move them behind remat's back, so the plan that runs stays the
plan that was measured. It matters in three places: a user who wraps the planned step in
``save_on_cpu`` or hooks of their own (the SAC-saved tensors stay on the device, as the plan
assumed; the rest of the step is offloaded by their hooks as before); remat's own step recorder,
whose hooks are taken off around each planned region anyway (NOTE [saved-tensor hooks and identity]
in remat/trace/recorder.py); and an offload boundary (NOTE [activation offload] in
remat/wrap/offload.py), which is never nested with a selective boundary in one plan (NOTE [valid
choice]) but could sit around one a user applied by hand. To offload a region's activations, plan
``CheckpointMode.OFFLOAD`` for it (``remat plan --offload``) rather than an outer hook.
Not passed under ``torch.compile`` (the traced path of NOTE [wrapper under compile]): there the
region is AOTAutograd's partition, which saved-tensor hooks never see.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

KEYWORD = "respect_saved_tensors_hooks"


@functools.lru_cache(maxsize=8)
def _accepts(fn: Callable[..., Any]) -> bool:
    try:
        return KEYWORD in inspect.signature(fn).parameters
    except (TypeError, ValueError):   # a builtin without a signature: pass nothing
        return False


def sac_checkpoint_kwargs(checkpoint_fn: Callable[..., Any]) -> dict[str, bool]:
    """The keyword remat passes beside a selective ``context_fn`` to ``checkpoint_fn`` (the checkpoint it
    is about to call): ``{"respect_saved_tensors_hooks": False}`` where ``checkpoint_fn`` takes it, else
    nothing (NOTE [SAC under saved-tensor hooks])."""
    return {KEYWORD: False} if _accepts(checkpoint_fn) else {}
