"""remat.measure: runs a training step and measures it (the measurement stage of docs/DESIGN.md).

A fresh build of the workload, prepared by the caller (an :class:`Arm`: the control, a plan
applied by ``remat.wrap.PlanArm``, a torch baseline), warm-up, the whole-step peak and the
bytes held when a phase starts, and device-correct step timing (NOTE [device-correct timing]):
one percentile definition (:func:`percentile`), one timed-step loop (:func:`time_steps`) and
one interleaved round-robin scheduler (:func:`time_round_robin`). It never imports ``plan``
or ``apply``; profile, the closed loop, verify, frontier, distributed and the pipeline use it.
:class:`CompileSpec` imports without torch, so a plan carries one; the rest loads torch on
first use (NOTE [import cost] in remat._lazy).
"""

from .._lazy import lazy_exports
from .compile_spec import BACKENDS, CompileSpec

_LAZY = {   # name -> the module that defines it
    **dict.fromkeys(["Arm", "PeakLimitExceeded", "Prepared", "ProbeResult", "Runner", "StepMeasurement", "Stream", "Timings",
                     "Undo", "discard", "held_bytes_at_phase", "is_cuda", "measure_arm", "measure_arm_peak", "measure_step_peak_within",
                     "measure_stream_peaks",
                     "prepare_arm", "probe_capacity", "release_memory", "shape_value", "time_round_robin", "time_steps",
                     "warm_up"], "remat.measure.run"),
    **dict.fromkeys(["CompiledCall", "CompiledFunction", "compile_model", "compiled_step_peak",
                     "random_ops_in_program_order"], "remat.measure.compiled"),
    **dict.fromkeys(["LinkBandwidth", "link_bandwidth"], "remat.measure.bandwidth"),
    **dict.fromkeys(["RegionTimer", "StepClock", "p50_along"], "remat.clock"),
    **dict.fromkeys(["p50", "p95", "percentile"], "remat.percentile"),
}

__all__ = ["BACKENDS", "CompileSpec", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
