"""The typed error of the simulate stage."""

from __future__ import annotations

from ..errors import WorkloadError


class SimulationError(WorkloadError):
    """The workload cannot be simulated as asked (unknown device model, an op fake mode cannot run,
    a data-dependent shape). Exit code 2, like every bad-input error."""
