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
- ``pipeline_receipt.json``: a pipeline receipt around the report tests/test_pipeline.py assembles
  from made-up stage results (nothing launched), its context the receipt's (``--pipeline-only``:
  only this file; it reads ``receipt.json``);
- ``schemas.json``: the specs of the receipt, the pipeline receipt and the distributed config
  (``describe`` of tests/test_codec_golden.py: every Spec's class and bounds, key by key), so a schema
  derived from the types is held to the hand one it replaced (``--schemas-only``: only this file);
- ``hostile.json``: for each hostile edit of tests/test_codec_golden.py (wrong type, out-of-bound
  number, extra key, missing key), the name of the error class reading the edited receipt raised
  (or "accepted").
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


def pipeline_receipt_bytes() -> bytes:
    """The pipeline receipt ``write_pipeline_receipt`` would write (its bytes, as that function makes them)."""
    from remat.distributed.pipeline.report import RankOutcome, StageResult, TimelineEvent, assemble_pipeline
    from remat.distributed.report import GradComparison
    from remat.plan.pipeline import Side
    from remat.receipt.pipeline import PipelineReceipt
    from remat.types import MemorySource
    from tests.test_pipeline import SHAPE, pipeline_config
    cfg = pipeline_config(spec="gpt", shape=SHAPE, world_size=2, microbatches=2, split_points=["h.2"],
                          sides=["none", "uniform"], profile={"given": True})

    def result(side: Side, k: int, busy_ms: float) -> StageResult:
        t0 = 1_000_000 * (k + 1)
        return StageResult(side=side, stage=k, rank=k, host="h", in_flight=2 - k, blocks=[f"h.{2 * k}"], boundaries=[],
                           step_ns=[(t0, t0 + 10_000_000)], forward_ms=[1.0], backward_ms=[2.0], replay_ms=[0.0],
                           optimizer_ms=[0.5], p2p_ms=[0.1], exposed_p2p_ms=[0.1], compute_ms=[busy_ms],
                           peak_bytes=1000 * (k + 1), held_at_backward_bytes=[10, 20],
                           timeline=[TimelineEvent(kind="forward", mb=0, start_ns=0, end_ns=1_000_000),
                                     TimelineEvent(kind="p2p:send", mb=-1, start_ns=1_000_000, end_ns=2_000_000)],
                           timeline_t0_ns=t0)

    def outcome(k: int) -> RankOutcome:
        cmp = GradComparison(params_compared=3, bitwise_equal=True, within_tolerance=True, max_abs_diff=0.0,
                             worst_param=None, mismatched=[])
        return RankOutcome(results={Side.NONE: result(Side.NONE, k, 8.0), Side.UNIFORM: result(Side.UNIFORM, k, 5.0)},
                           comparisons={Side.UNIFORM: cmp}, negative_rejected=True,
                           losses={Side.NONE: 1.5, Side.UNIFORM: 1.5},
                           missing_grads={Side.NONE: [], Side.UNIFORM: []}, notes=["rank note"], plans={})
    report = assemble_pipeline(cfg, [outcome(0), outcome(1)], torch_version="t",
                               memory_source=MemorySource.CPU_LIVE_TENSORS)
    context = Receipt.loads((HERE / "receipt.json").read_bytes()).context
    context.workload = "gpt"
    receipt = PipelineReceipt(context=context, pipeline=report, boundaries=[], check_steps=2, check_timeout_s=30.0)
    return (json.dumps(receipt.to_json(), indent=1, allow_nan=False) + "\n").encode("utf-8")


def main() -> None:
    if "--pipeline-only" in sys.argv:
        (HERE / "pipeline_receipt.json").write_bytes(pipeline_receipt_bytes())
        return
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
    (HERE / "pipeline_receipt.json").write_bytes(pipeline_receipt_bytes())
    text = (HERE / "receipt.json").read_bytes()
    hostile = {name: outcome(text, edit) for name, edit in EDITS.items()}
    (HERE / "hostile.json").write_text(json.dumps(hostile, indent=1) + "\n")


if __name__ == "__main__":
    main()
