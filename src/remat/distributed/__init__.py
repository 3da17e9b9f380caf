"""remat.distributed: the plan at world size N, on torch.distributed (DDP and FSDP2).

The package that runs plans on ``torch.distributed`` (``remat.auto``'s ranks agreeing on one
plan are ``remat.autoplan.ranks``, below it). :func:`run_distributed` starts the
ranks with torchrun (NOTE [launcher] in launch.py), each rank rebuilds the workload, runs
the control and the plan under the same engine configuration, and rank 0 writes
``distributed.json`` (:class:`DistributedReport`): per-rank step time and peak, collectives,
exposed communication (NOTE [exposed communication] in intervals.py), the no-op-comm
ablation, and gradient equivalence. A pipeline run's ``pipeline.json`` is the same report, each row with its
stage (NOTE [one per-rank report] in report.py).
"""

from .config import DistributedConfig, Engine, PipelineSettings
from .launch import free_port, launch_ranks, run_distributed, torchrun_command
from .report import (CollectiveCount, DistributedReport, Equivalence, GradComparison, RankFigures, RankResult,
                     RankSide, SideReport)

__all__ = ["CollectiveCount", "DistributedConfig", "DistributedReport", "Engine", "Equivalence", "GradComparison",
           "PipelineSettings", "RankFigures", "RankResult", "RankSide", "SideReport", "free_port", "launch_ranks",
           "run_distributed", "torchrun_command"]
