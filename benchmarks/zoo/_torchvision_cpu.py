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
"""

from __future__ import annotations

import sys
import types

import torch

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
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _define_missing_schemas() -> None:
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
