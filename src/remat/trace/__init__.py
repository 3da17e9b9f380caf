"""Phase-labelled step traces: where the memory goes, by phase, category and module."""

from .model import SCHEMA_VERSION, ModuleBytes, PhaseStats, StepTrace, TimelinePoint, TraceContext
from .perfetto import to_perfetto
from .recorder import ModuleWindow, SavedTensor, StepRecorder
from .tracer import trace_on_device, trace_step, trace_workload

__all__ = ["SCHEMA_VERSION", "ModuleBytes", "ModuleWindow", "PhaseStats", "SavedTensor", "StepRecorder",
           "StepTrace", "TimelinePoint", "TraceContext", "to_perfetto", "trace_on_device", "trace_step", "trace_workload"]
