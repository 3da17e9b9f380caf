"""``remat.auto``: one call that fits a model's training step under a memory budget.

A stage above ``verify`` and ``closed_loop`` (it profiles, plans in a closed loop, optionally
verifies, and applies); the integrations (``remat.integrations``) sit above it.
"""

from .batches import ExampleBatches
from .cache import (ENV_VAR, BrokenCacheEntryWarning, CacheKey, PlanCache, PlanCacheWarning, StaleCacheEntryWarning,
                    UnusableCacheDirWarning, default_cache_dir)
from .report import AutoHandle, AutoReport, CacheStatus, VerifyStatus
from .run import auto, existing_checkpointing
from .shapes import NewShapeWarning, ShapeEnvelope, ShapeGuard, ShapePolicy, TrainableChangedWarning
from .source import InMemoryWorkload, ModelSource, OptimizerSpec, hf_loss, unwrap_optimizer

__all__ = ["ENV_VAR", "AutoHandle", "AutoReport", "BrokenCacheEntryWarning", "CacheKey", "CacheStatus", "ExampleBatches",
           "InMemoryWorkload", "ModelSource", "NewShapeWarning", "OptimizerSpec", "PlanCache", "PlanCacheWarning",
           "ShapeEnvelope", "ShapeGuard", "ShapePolicy", "StaleCacheEntryWarning", "TrainableChangedWarning",
           "UnusableCacheDirWarning", "VerifyStatus", "auto", "default_cache_dir", "existing_checkpointing",
           "hf_loss", "unwrap_optimizer"]
