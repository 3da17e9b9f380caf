"""Import torchvision when its compiled extension does not match the installed torch.

Why: the torchvision 0.28.0 wheel on PyPI is a CUDA build. Next to the CPU build of torch
2.13 (``torch==2.13.0+cpu``) its ``_C.so`` fails to load; torchvision swallows that, but then
its pure-Python modules register fake/autograd kernels for ``torchvision::nms`` and friends,
and ``import torchvision`` dies with ``RuntimeError: operator torchvision::nms does not exist``.
timm imports torchvision too. The zoo's models (ResNet, ViT, ConvNeXt, EfficientNet, timm
nets) never call those detection ops, so defining their *schemas* (no kernels) is enough
for the model code to import. A call to one of them would fail loudly ("no kernel"), never
compute something wrong.

``import_torchvision()`` tries the ordinary import first and defines the schemas only when
it fails with exactly that error, so a working torchvision (a matching CPU or CUDA build)
is never touched. Idempotent: safe to call from every factory, in any order.

NOTE [torchvision import hook]
A user's plain script cannot be asked to call ``import_torchvision()`` first: transformers imports
torchvision as soon as it is installed (``from transformers import LlamaConfig`` failed with
``Could not import module 'LlamaConfig'``), and so does timm. So where ``import torchvision`` fails in
the environment ``make test`` builds (the CPU torch from this machine's wheel, the CUDA torchvision
from PyPI), the Makefile runs ``python benchmarks/zoo/_torchvision_cpu.py --install``: this file is
copied into that environment's site-packages with a ``.pth`` line (Python's ``site`` runs an
``import`` line of a ``.pth`` file at start-up, as setuptools' ``distutils-precedence.pth`` does)
that puts :class:`SchemasFirst` on ``sys.meta_path``. It costs nothing at start-up (no torch import)
and acts once, on the first ``import torchvision``: it loads torchvision's compiled extension
itself and, only if that load fails, defines the op schemas above before torchvision's own import
runs; then the ordinary import proceeds. ``REMAT_TORCHVISION_HOOK=0`` turns it off (the test that
runs a plain script uses it for the wrong case: without the hook that script fails). The real fix
is a torchvision built for the installed torch: for a CPU torch, the CPU wheel of the same index
(``pip install torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu`` for torch
2.13.0+cpu); with it, ``import torchvision`` works and the Makefile installs no hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import sysconfig
import types
from pathlib import Path

# torchvision/csrc/ops/*.cpp, TORCH_LIBRARY_FRAGMENT(torchvision, m) { m.def(...) } in 0.28.0
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)

_MISSING_OP = "operator torchvision::nms does not exist"
_LIBRARY_ATTR = "_remat_zoo_torchvision_schemas"  # on the torch.library module: one Library per process


def _has_op(name: str) -> bool:
    import torch
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _define_missing_schemas() -> None:
    import torch
    lib = getattr(torch.library, _LIBRARY_ATTR, None)
    if lib is None:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        setattr(torch.library, _LIBRARY_ATTR, lib)  # kept alive: a collected Library drops its defs
    for schema in _SCHEMAS:
        if not _has_op(schema.split("(", 1)[0]):
            lib.define(schema)


def import_torchvision() -> types.ModuleType:
    """``import torchvision``, defining the op schemas first only if the extension failed to load."""
    try:
        import torchvision
        return torchvision
    except RuntimeError as exc:
        if _MISSING_OP not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package, so the second import starts clean
    _define_missing_schemas()
    import torchvision
    return torchvision


# -- the import hook: NOTE [torchvision import hook] -------------------------------------------------------

HOOK_MODULE = "_remat_torchvision_cpu"      # this file's name in site-packages
HOOK_ENV = "REMAT_TORCHVISION_HOOK"         # "0": the hook does nothing


def _extension_loads(package_dir: Path) -> bool:
    """Whether torchvision's compiled ops (``_C``) load beside the installed torch; True when there is none."""
    import torch
    libs = sorted(package_dir.glob("_C.*so")) + sorted(package_dir.glob("_C.*pyd"))
    if not libs:
        return True
    try:
        torch.ops.load_library(str(libs[0]))
    except OSError:   # e.g. libc10_cuda.so: cannot open shared object file (a CUDA build beside a CPU torch)
        return False
    return True


class SchemasFirst(importlib.abc.MetaPathFinder):
    """Before the first ``import torchvision``: define the op schemas if its extension does not load."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name != "torchvision":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)   # once: torchvision's own import then runs as ever
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is not None and spec.submodule_search_locations and \
                not _extension_loads(Path(list(spec.submodule_search_locations)[0])):
            _define_missing_schemas()
        return None                      # the ordinary finders import it


def install_import_hook() -> None:
    """Called by the ``.pth`` line at interpreter start-up (no torch import here)."""
    if os.environ.get(HOOK_ENV, "1") != "0" and not any(isinstance(f, SchemasFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, SchemasFirst())


def install_into_site_packages() -> Path:
    """Copy this file into the running interpreter's site-packages and add the ``.pth`` line that loads it."""
    site = Path(sysconfig.get_paths()["purelib"])
    shutil.copyfile(Path(__file__), site / f"{HOOK_MODULE}.py")
    pth = site / f"{HOOK_MODULE}.pth"
    pth.write_text(f"import {HOOK_MODULE}; {HOOK_MODULE}.install_import_hook()\n")
    return pth


if __name__ == "__main__":
    if sys.argv[1:] != ["--install"]:
        sys.exit("usage: python benchmarks/zoo/_torchvision_cpu.py --install")
    print(f"torchvision's extension does not load beside this torch: installed {install_into_site_packages()} "
          "(NOTE [torchvision import hook] in benchmarks/zoo/_torchvision_cpu.py)")
