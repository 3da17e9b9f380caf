"""The zoo: workload factories for models remat was not written against (issue 11).

One file per model, each ``build(...) -> remat.Workload`` (random init, no downloads), given
to remat as ``benchmarks/zoo/<file>.py:build``. ``run.py`` runs ``remat receipt`` on all of
them and writes ``benchmarks/ZOO.md`` and ``benchmarks/zoo/results.json``.
"""
