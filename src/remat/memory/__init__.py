"""Measuring bytes: CUDA allocator statistics, or the CPU live-tensor tracker."""

from .cuda import CudaMemoryStats, dump_memory_snapshot, read_cuda_stats, require_cuda, reset_cuda_peak
from .reference import ProfilerPeak, profiler_memory_peak, profiler_step_peak
from .measure import PeakMeasurement, measure_step_peak, track_step_state
from .tracker import LiveTensorTracker, PhaseMark, StorageRecord

__all__ = ["CudaMemoryStats", "LiveTensorTracker", "PeakMeasurement", "PhaseMark", "ProfilerPeak", "profiler_memory_peak", "profiler_step_peak", "StorageRecord",
           "dump_memory_snapshot", "measure_step_peak", "read_cuda_stats", "require_cuda",
           "reset_cuda_peak", "track_step_state"]
