"""Candidate discovery on the layouts that used to hide real blocks (NOTE [natural blocks]), shared
modules costed over every call (NOTE [shared modules]) and small boundaries (NOTE [small boundaries]).

Ground truths: hand-written candidate names per layout; hand counts of saved bytes; the live-tensor
tracker's measured peaks of the unmodified control and of each plan applied; verify's paired runs.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from remat.memory import measure_step_peak
from remat.plan import make_plan
from remat.plan.cost import CostModel
from remat.profile import auto_candidates, profile_workload
from remat.profile.model import CandidateCost, ModelFingerprint, PeakRow, ProfileReport
from remat.types import CheckpointMode as M
from remat.types import MemorySource
from remat.verify import verify_plan
from remat.workload import TrainingStep, load_workload
from remat.wrap import apply

from .conftest import FIXTURES, hand_plan

sys.path.insert(0, str(FIXTURES))
import candidate_layouts as L  # noqa: E402

LAYOUTS = f"{FIXTURES / 'candidate_layouts.py'}"


# -- which candidates each layout offers (hand-written) ---------------------------------------------

def test_twins_inside_a_block_leave_the_block_a_candidate():
    found = auto_candidates(L.Joint())
    assert found == ["blocks.0", "blocks.0.norm", "blocks.0.norm_context", "blocks.0.ff", "blocks.0.ff.net",
                     "blocks.0.ff_context", "blocks.0.ff_context.net",
                     "blocks.1", "blocks.1.norm", "blocks.1.norm_context", "blocks.1.ff", "blocks.1.ff.net",
                     "blocks.1.ff_context", "blocks.1.ff_context.net"]


def test_leaves_of_a_sequential_mlp_are_not_blocks():
    # the Linears of ``mlp`` used to be "blocks", which demoted blocks.N (examples/auto_plain_loop.py)
    assert auto_candidates(L.SeqMLPNet()) == ["blocks.0", "blocks.0.ln1", "blocks.0.ln2", "blocks.0.attn",
                                              "blocks.0.mlp", "blocks.1", "blocks.1.ln1", "blocks.1.ln2",
                                              "blocks.1.attn", "blocks.1.mlp"]
    # ... except in a plain stack of layers, where nothing else would be a block
    stack = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    assert auto_candidates(stack) == ["0", "1", "2", "3"]


def test_sequential_unet_stages_are_candidates_not_their_layers():
    assert auto_candidates(L.SeqUNet()) == ["inc", "down1", "down1.maxpool_conv", "down1.maxpool_conv.1",
                                            "down2", "down2.maxpool_conv", "down2.maxpool_conv.1",
                                            "up1", "up1.conv", "up2", "up2.conv"]


def test_a_modulelist_of_distinct_stages_offers_each_stage():
    found = auto_candidates(L.ListedStages())
    assert {"down_blocks.0", "down_blocks.1"} <= set(found)          # distinct classes, no sibling twin
    assert {"down_blocks.0.resnets.0", "down_blocks.1.resnets.1"} <= set(found)
    assert "down_blocks" not in found                                # no forward of its own


def test_a_wrapper_of_a_stack_is_still_not_a_candidate():
    class Wrapper(nn.Module):                # HF style: model.transformer.h.N, twins inside each block
        def __init__(self):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.h = nn.ModuleList(L.JointBlock(4) for _ in range(2))

    found = auto_candidates(Wrapper())
    assert "transformer" not in found and "transformer.h.0" in found and "transformer.h.0.ff" in found


# -- the U-Net layout: whole stages plan where single layers could not ---------------------------------

def _measured_peak(spec: str, names: list[str]) -> int:
    lw = load_workload(spec)
    if names:
        apply(lw.workload.model, hand_plan(lw.workload.model, names, guarded=True))
    step = TrainingStep(lw.workload)
    step.run(0)
    step.run(1)
    return measure_step_peak(step, 2).peak_bytes


def test_unet_stage_plan_saves_more_than_the_layer_plan_and_meets_70_percent():
    spec = f"{LAYOUTS}:build_unet"
    report = profile_workload(load_workload(spec), warmup=1, repeats=1, measure_replays=False)
    offered = {c.name for c in report.candidates}
    assert {"down1", "down2", "up1", "up2"} <= offered
    control = _measured_peak(spec, [])
    stages = _measured_peak(spec, ["inc", "down1", "down2", "up1"])
    layers = _measured_peak(spec, ["down1.maxpool_conv.1.1", "down2.maxpool_conv.1.1",   # the BatchNorms, as before
                                   "up1.conv.1", "up2.conv.1"])
    assert control - stages > 4 * max(control - layers, 0) and control - stages > 0.2 * control, \
        (control, stages, layers)
    plan = make_plan(report, "optimal", budget_bytes=int(0.7 * control), reserve=0.05)
    assert _measured_peak(spec, [b.module for b in plan.boundaries]) <= int(0.7 * control)


# -- shared modules: costed over every call ------------------------------------------------------------

def test_shared_module_saved_bytes_are_every_calls_hand_count():
    B, d = 256, 32
    report = profile_workload(load_workload(f"{LAYOUTS}:build_siamese", {"batch_size": B, "d": d}),
                              candidates=["tower.blocks.0"], repeats=1)
    (c,) = report.candidates
    # per call: the first Linear's output (saved by GELU) and GELU's output (saved by the second
    # Linear), (B, 4d) float32 each; two calls per step
    assert c.calls == 2
    assert c.saved_bytes[M.FULL] == 2 * 2 * B * 4 * d * 4
    assert "times per step" not in str(report.excluded)


def test_siamese_model_plans_and_verifies():
    spec = f"{LAYOUTS}:build_siamese"
    report = profile_workload(load_workload(spec), warmup=1, repeats=1, measure_replays=False)
    control = report.baseline_peak_bytes
    plan = make_plan(report, "optimal", budget_bytes=int(0.7 * control), reserve=0.05)
    assert plan.boundaries
    measured = _measured_peak(spec, [b.module for b in plan.boundaries])
    assert measured <= int(0.7 * control)
    assert plan.predicted_peak_bytes == pytest.approx(measured, rel=0.03)
    lw = load_workload(spec)
    assert verify_plan(lw, plan, steps=1, seeds=1, timing_steps=2).passed


FP = ModelFingerprint(modules=(("", "M"),), params=(), class_source_hashes=(), digest="d" * 64)


def _cand(name: str, order: int, saved: int, ms: float, *, parent: str | None = None, calls: int = 1) -> CandidateCost:
    return CandidateCost(name=name, class_name="Block", order=order, parent=parent, fwd_ms=ms, input_bytes=0,
                         saved_bytes={M.KEEP: 0, M.FULL: saved}, replay_ms={M.KEEP: 0.0, M.FULL: ms},
                         replay_extra_bytes={M.KEEP: 0, M.FULL: 0}, calls=calls)


def _report(cands: list[CandidateCost], rows: list[PeakRow]) -> ProfileReport:
    return ProfileReport(candidates=cands, rows=rows, excluded={}, baseline_peak_bytes=max(r.base_bytes for r in rows),
                         baseline_step_ms=10.0, memory_source=MemorySource.CPU_LIVE_TENSORS, fingerprint=FP)


def test_a_row_frees_the_share_of_a_shared_module_held_there():
    # "t" is called twice, freeing 100 B per call: both calls held at 1000 B, one at 980 B
    rep = _report([_cand("t", 0, 200, 1.0, calls=2)],
                  [PeakRow(base_bytes=1000, live=("t", "t"), replaying=()),
                   PeakRow(base_bytes=980, live=("t",), replaying=())])
    model = CostModel(rep)
    assert model.peak(model.vector({"t": M.FULL})) == 880        # max(1000 - 200, 980 - 100)
    wrong = _report([_cand("t", 0, 200, 1.0, calls=1)], rep.rows)  # one call: the whole 200 B in each row
    assert CostModel(wrong).peak(CostModel(wrong).vector({"t": M.FULL})) == 800


# -- small boundaries give way to their block (NOTE [small boundaries]) ---------------------------------

def _block_report(block_ms: float) -> ProfileReport:
    """Block ``b`` (1000 B) holds ``b.norm`` (40 B, 1 ms) and ``b.ff`` (960 B, 9 ms)."""
    cands = [_cand("b", 0, 1000, block_ms), _cand("b.norm", 1, 40, 1.0, parent="b"),
             _cand("b.ff", 2, 960, 9.0, parent="b")]
    return _report(cands, [PeakRow(base_bytes=2000, live=("b", "b.norm", "b.ff"), replaying=())])


def test_a_small_boundary_gives_way_to_its_block_at_no_more_cost():
    plan = make_plan(_block_report(10.0), "optimal", budget_bytes=1000, reserve=0.0)
    assert [b.module for b in plan.boundaries] == ["b"]
    assert plan.predicted_peak_bytes == 1000 and plan.predicted_overhead_ms == 10.0


def test_a_small_boundary_stays_when_the_block_costs_more():
    plan = make_plan(_block_report(10.5), "optimal", budget_bytes=1000, reserve=0.0)
    assert [b.module for b in plan.boundaries] == ["b.norm", "b.ff"]
    assert plan.predicted_overhead_ms == 10.0


# -- real models: whole blocks offered (benchmarks/zoo/) -------------------------------------------------

ZOO = FIXTURES.parents[1] / "benchmarks" / "zoo"


def _zoo_candidates(name: str, shape: dict) -> list[str]:
    return auto_candidates(load_workload(f"{ZOO / (name + '.py')}:build", shape).workload.model)


def test_bart_decoder_layers_are_candidates():
    pytest.importorskip("transformers")
    found = _zoo_candidates("hf_bart", dict(batch_size=1, src_len=8, tgt_len=8, d_model=16, vocab_size=64))
    assert {"model.decoder.layers.0", "model.decoder.layers.1"} <= set(found)       # twins self_attn/encoder_attn
    assert {"model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"} <= set(found)
    assert "model" not in found and "model.decoder" not in found                      # wrappers of the stack


def test_diffusers_unet_stages_and_transformer_blocks_are_candidates():
    pytest.importorskip("diffusers")
    found = set(_zoo_candidates("diffusers_unet2d", dict(batch_size=1, sample_size=8, width=8, layers_per_block=1)))
    assert {"down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1"} <= found
    assert {"down_blocks.0.attentions.0", "down_blocks.0.attentions.0.transformer_blocks.0",
            "down_blocks.0.attentions.0.transformer_blocks.0.attn1"} <= found                 # attn1/attn2 twins


def test_sd3_joint_blocks_are_candidates():
    pytest.importorskip("diffusers")
    found = set(_zoo_candidates("diffusers_sd3", dict(batch_size=1, sample_size=8, n_layer=2, heads=2, head_dim=8)))
    assert {"transformer_blocks.0", "transformer_blocks.1"} <= found                  # ff/ff_context twins inside
    assert {"transformer_blocks.0.ff", "transformer_blocks.0.ff_context"} <= found
