"""The workload contract, loading, and the built-in workloads (gpt, cnn, mlp)."""

from .contract import AutocastLoss, PhaseMarker, TrainingStep, Workload, parse_autocast, with_autocast
from .loader import BUILTINS, LoadedWorkload, factory_defaults, load_workload, parse_dtype, parse_shape, shape_text

__all__ = ["BUILTINS", "AutocastLoss", "LoadedWorkload", "PhaseMarker", "TrainingStep", "Workload",
           "factory_defaults", "load_workload", "parse_autocast", "parse_dtype", "parse_shape", "shape_text", "with_autocast"]
