"""Simulated traces and runtimes: plan for hardware you do not have.

The step runs under ``FakeTensorMode`` on a model built on ``meta`` (NOTE [building without
memory], NOTE [simulated step]); bytes come from the same live-tensor tracker as a real CPU
trace, times from a roofline model of a named device (NOTE [roofline runtime model]).
"""

from .build import SimulatedWorkload, fake_module_, fake_workload, load_simulated
from .costs import OpCostRecorder, OpRecord
from .devices import DEVICE_MODELS, DeviceModel, fit_calibration, get_device_model
from .errors import SimulationError
from .runtime import OpTypeCost, RuntimePrediction, op_ms, predict_runtime
from .semantics import KernelSemantics, SimulationDispatch, SimulationFunctions
from .simulation import Simulation, estimate_step_runtime, simulate_trace, simulate_workload

__all__ = ["DEVICE_MODELS", "DeviceModel", "KernelSemantics", "OpCostRecorder", "OpRecord", "OpTypeCost",
           "RuntimePrediction", "Simulation", "SimulatedWorkload", "SimulationDispatch", "SimulationError",
           "SimulationFunctions", "estimate_step_runtime", "fake_module_", "fake_workload", "fit_calibration", "get_device_model",
           "load_simulated", "op_ms", "predict_runtime", "simulate_trace", "simulate_workload"]
