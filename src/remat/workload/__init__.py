"""The workload contract, loading, and the built-in workloads (gpt, cnn, mlp)."""

from .contract import PhaseMarker, TrainingStep, Workload
from .loader import BUILTINS, LoadedWorkload, factory_defaults, load_workload, parse_dtype, parse_shape

__all__ = ["BUILTINS", "LoadedWorkload", "PhaseMarker", "TrainingStep", "Workload",
           "factory_defaults", "load_workload", "parse_dtype", "parse_shape"]
