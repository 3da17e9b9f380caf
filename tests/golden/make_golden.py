"""Writes the golden files tests/test_codec_golden.py holds the codecs to (run once, before a codec change).

``PYTHONPATH=src python tests/golden/make_golden.py`` makes a receipt of the tiny residual MLP of
tests/test_receipt.py at its test sizes, adds a run at world size 2 made up from it (nothing launches
ranks: the evidence of tests/test_gate_reports.py), and writes:

- ``receipt.json``: the receipt's bytes as ``remat receipt`` writes them (receipt/write.py);
- ``receipt_optional.json``: the same with the keys a plain receipt leaves out given (autocast,
  the device's memory, candidates excluded after verification);
- ``distributed_config.json``: a pipeline engine's ``DistributedConfig`` (its ``PipelineSettings``
  given field by field) as ``DistributedConfig.save`` writes it (``--config-only``: only this file,
  nothing launched);
- ``schemas.json``: the specs of the receipt and the distributed config
  (``describe`` of tests/test_codec_golden.py: every Spec's class and bounds, key by key), so a schema
  derived from the types is held to the hand one it replaced (``--schemas-only``: only this file);
- ``hostile.json``: for each hostile edit of tests/test_codec_golden.py (wrong type, out-of-bound
  number, extra key, missing key), the name of the error class reading the edited receipt raised
  (or "accepted").

``pipeline_receipt.json`` is no longer written: it is a pipeline receipt in the old format (kind
``remat-pipeline-receipt``, before NOTE [one receipt] in remat/receipt/model.py), made by this script
then around the report tests/test_pipeline.py assembles from made-up stage results, its context the
receipt's. It is kept as it was: the old format a reader must refuse, and the figures the one receipt
must hold unchanged (tests/test_codec_golden.py). Its report is in the layout before the one per-rank report
(NOTE [one per-rank report] in remat/distributed/report.py): ``pipeline_render.md`` (its ``pipeline.md``) and
``pipeline_receipt_render.txt`` (the one receipt's report.html, a ``=====`` line, its report.md) are what the
renderers wrote from it before that change, kept as they were: the renderers of the one report must write them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))   # the repository root: tests.* importable

from remat.receipt import Receipt, write_receipt  # noqa: E402
from remat.receipt.write import receipt_bytes  # noqa: E402
from remat.workflow import make_receipt  # noqa: E402
from remat.workload import load_workload  # noqa: E402
from tests.test_codec_golden import EDITS, describe_schemas, outcome  # noqa: E402
from tests.test_gate_reports import _evidence  # noqa: E402
from tests.test_receipt import SETTINGS, WORKLOAD  # noqa: E402


def pipeline_config() -> bytes:
    """A pipeline config with every settings field away from its default, as ``save`` writes it."""
    from remat._io import atomic_write_json
    from remat.distributed.config import DistributedConfig, PipelineSettings
    from remat.plan.pipeline import Schedule
    settings = PipelineSettings(schedule=Schedule.GPIPE, microbatches=2, split_points=["h.1"], split_source="default",
                                profile={"peak_bytes": [1, 2.5]}, planner="greedy", uniform_planner="sqrt",
                                budget="60%", reserve=0.1, sides=["none", "remat"], perturb_control=False)
    config = DistributedConfig(spec="gpt", shape={"batch_size": 4}, world_size=2, engine="pipeline", pipeline=settings,
                               budget_bytes=10, timeout_s=30.0)
    with tempfile.TemporaryDirectory() as tmp:
        return atomic_write_json(Path(tmp) / "config.json", config.to_json()).read_bytes()


def main() -> None:
    if "--schemas-only" in sys.argv:
        (HERE / "schemas.json").write_text(json.dumps(describe_schemas(), indent=1) + "\n")
        return
    (HERE / "distributed_config.json").write_bytes(pipeline_config())
    if "--config-only" in sys.argv:
        return
    (HERE / "schemas.json").write_text(json.dumps(describe_schemas(), indent=1) + "\n")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            Path("work.py").write_text(WORKLOAD)
            receipt = make_receipt(load_workload("work.py:build", {}), budget="85%", reserve=0.05,
                                   boundary_shape={"batch_size": 512}, settings=SETTINGS, command="pytest")
            write_receipt(receipt, Path(tmp) / "out")
        finally:
            os.chdir(cwd)
    data = json.loads(receipt_bytes(receipt))
    data["world_size"] = _evidence(data, 2)
    receipt = Receipt.from_json(data)
    (HERE / "receipt.json").write_bytes(receipt_bytes(receipt))
    # the keys a plain receipt leaves out, given: they must keep their place in the bytes too
    data = json.loads(receipt_bytes(receipt))
    data["context"].update(autocast="bfloat16", device_memory_bytes=1 << 30)
    data["plan"]["excluded_after_verify"] = {"blocks.1": "draws random numbers"}
    (HERE / "receipt_optional.json").write_bytes(receipt_bytes(Receipt.from_json(data)))
    text = (HERE / "receipt.json").read_bytes()
    hostile = {name: outcome(text, edit) for name, edit in EDITS.items()}
    (HERE / "hostile.json").write_text(json.dumps(hostile, indent=1) + "\n")


if __name__ == "__main__":
    main()
