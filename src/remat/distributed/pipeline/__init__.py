"""Pipeline parallelism, in one place: every module whose subject is a pipeline of stages.

``plan`` (per-stage plans and the schedules' in-flight cost model, pure), ``engine`` (split, config,
launch), ``worker`` (one rank), ``report`` (the typed result), ``simulate`` (other world sizes),
``receipt``, ``markdown`` and ``render`` (its receipt), ``check`` (``remat check`` of that receipt).
Each module sits at its own layer of the import-linter contract (pyproject.toml; docs/DESIGN.md),
so this ``__init__`` imports nothing: ``remat.wrap`` can load per-stage plans without loading the engine.
"""
