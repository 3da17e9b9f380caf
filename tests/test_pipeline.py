"""Pipeline parallelism (issue 17): per-stage plans, stage modules, bubbles, equivalence, guardrails.

Launches run at world size 2 on gloo with short p2p timeouts and wall limits, so a regression
fails instead of hanging CI.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import remat
from remat.cli.main import main
from remat.distributed.launch import _alive_rank_pid
from remat.distributed.pipeline import (PIPELINE_WORKER_MODULE, PipelineConfig, balanced_bounds, build_stage_module,
                                        run_pipeline_config, split_batch, stage_layout)
from remat.distributed.pipeline_report import PipelineReport
from remat.distributed.worker import FAULT_ENV
from remat.errors import BudgetError, DistributedError, PlanError
from remat.plan.pipeline import PipelinePlan, Schedule, ideal_bubble, in_flight, load_any_plan, plan_stages
from remat.profile.fingerprint import fingerprint
from remat.profile.model import CandidateCost, PeakRow, ProfileReport
from remat.types import CheckpointMode, MemorySource
from remat.workload import load_workload

SHAPE = {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 16, "batch_size": 8, "vocab": 64}
SLEEP = str(Path(__file__).parent / "fixtures" / "pipeline_sleep.py") + ":build"


@pytest.fixture
def rank_env(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return monkeypatch


# -- pure: schedule arithmetic and per-stage planning ---------------------------------------------------

def test_in_flight_counts_and_ideal_bubble():
    assert [in_flight("1f1b", k, 4, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", k, 4, 2) for k in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", k, 4, 8) for k in range(4)] == [8, 8, 8, 8]
    assert ideal_bubble(2, 4) == pytest.approx(1 / 5) and ideal_bubble(4, 8) == pytest.approx(3 / 11)


def test_balanced_bounds_minimise_the_slowest_stage():
    assert balanced_bounds([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_bounds([3, 1, 1, 1], 2) == [0, 1, 4]
    assert balanced_bounds([1, 1, 1, 1], 2, last_extra=2) == [0, 3, 4]   # the head's time counts on the last stage
    assert balanced_bounds([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]
    with pytest.raises(DistributedError):
        balanced_bounds([1.0], 2)


def synthetic_report(n: int = 4, saved: int = 100, replay_ms: float = 1.0) -> ProfileReport:
    cands = [CandidateCost(name=f"h.{i}", class_name="Block", order=i, parent=None, fwd_ms=1.0, input_bytes=0,
                           saved_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: saved},
                           replay_ms={CheckpointMode.KEEP: 0.0, CheckpointMode.FULL: replay_ms},
                           replay_extra_bytes={CheckpointMode.KEEP: 0, CheckpointMode.FULL: 0}) for i in range(n)]
    return ProfileReport(candidates=cands, rows=[PeakRow(base_bytes=1000, live=(), replaying=())], excluded={},
                         baseline_peak_bytes=1000, baseline_step_ms=10.0, memory_source=MemorySource.CPU_LIVE_TENSORS,
                         fingerprint=fingerprint(torch.nn.Linear(1, 1)))


def test_stage_plans_count_each_saving_once_per_microbatch_held():
    report, blocks = synthetic_report(), [["h.0", "h.1"], ["h.2", "h.3"]]
    # 1F1B, p=2, m=4: stage 0 holds 2 microbatches, stage 1 one. One boundary on stage 0 saves 2 x 100 bytes
    # and its replay brings one microbatch's 100 back: 1000 - 200 + 100 = 900 <= 950.
    plans = plan_stages(report, blocks, schedule="1f1b", microbatches=4, base_peaks=[1000, 900], planner="optimal",
                        budget_bytes=950, reserve=0.0)
    assert [len(p.boundaries) for p in plans] == [1, 0]
    assert plans[0].predicted_peak_bytes == 900 and plans[1].predicted_peak_bytes == 900
    assert plans[0].predicted_overhead_ms == pytest.approx(4.0)   # 1 ms replay x 4 microbatches
    assert all(b.module in ("h.0", "h.1") for b in plans[0].boundaries)
    # GPipe holds all 4 on every stage: one boundary saves 400 on stage 0
    gp = plan_stages(report, blocks, schedule="gpipe", microbatches=4, base_peaks=[1000, 900], planner="optimal",
                     budget_bytes=950, reserve=0.0)
    assert gp[0].predicted_peak_bytes == 1000 - 400 + 100
    # the uniform rule checkpoints every block of every stage, whatever the load
    uni = plan_stages(report, blocks, schedule="1f1b", microbatches=4, base_peaks=[1000, 900], planner="all",
                      budget_bytes=None)
    assert [[b.module for b in p.boundaries] for p in uni] == blocks
    # a stage no plan can bring under the budget is named: stage 1's floor is 1000 - 2 x 100 + 100 = 900,
    # while stage 0 (2 held) reaches 1000 - 2 x 200 + 100 = 700
    with pytest.raises(BudgetError, match="pipeline stage 1"):
        plan_stages(report, blocks, schedule="1f1b", microbatches=4, base_peaks=[1000, 1000], planner="optimal",
                    budget_bytes=850, reserve=0.0)


def test_pipeline_plan_round_trip_and_refusals(tmp_path):
    from remat.plan.pipeline import StagePlan
    report, blocks = synthetic_report(), [["h.0", "h.1"], ["h.2", "h.3"]]
    plans = plan_stages(report, blocks, schedule="1f1b", microbatches=4, base_peaks=[1000, 900], planner="optimal",
                        budget_bytes=950, reserve=0.0)
    pp = PipelinePlan(schedule=Schedule.ONE_F_ONE_B, microbatches=4, budget_bytes=950, reserve=0.0,
                      stages=[StagePlan(stage=k, blocks=blocks[k], in_flight=[2, 1][k], base_peak_bytes=[1000, 900][k],
                                        plan=plans[k]) for k in range(2)], split_points=["h.2"], split_source="given")
    path = pp.save(tmp_path / "plan.json")
    back = load_any_plan(path)
    assert isinstance(back, PipelinePlan) and back.to_json() == pp.to_json()
    assert [b.module for b in back.for_stage(0).boundaries] == [b.module for b in plans[0].boundaries]
    bad = pp.to_json()
    bad["stages"][0]["surprise"] = 1
    with pytest.raises(PlanError):
        PipelinePlan.from_json(bad)
    bad = pp.to_json()
    bad["stages"][1]["in_flight"] = "1"
    with pytest.raises(PlanError):
        PipelinePlan.from_json(bad)
    with pytest.raises(PlanError):
        pp.for_stage(2)


# -- stage modules -----------------------------------------------------------------------------------

def test_stage_modules_compose_to_the_whole_model_bitwise():
    shape = {**SHAPE, "dropout": 0.0, "batch_size": 2}
    torch.manual_seed(0)
    whole = load_workload("gpt", shape).workload
    x, _ = split_batch(whole.batch(0))
    expected = whole.model(x)
    stages, params = [], []
    for k in range(2):
        torch.manual_seed(0)
        model = load_workload("gpt", shape).workload.model
        layout = stage_layout(model, ["h.1"], 2, x)
        stages.append(build_stage_module(model, layout, k))
        params.append({n for n, _ in stages[-1].named_parameters()})
    assert layout.tied == ["wte.weight"]          # gpt ties lm_head.weight to wte.weight
    assert torch.equal(stages[1](stages[0](x)), expected)
    # each stage keeps only what it runs: stage 0 no head, stage 1 no embedding (the tied weight sits in lm_head)
    assert not any(n.startswith(("model.ln_f", "model.lm_head", "model.h.1.", "model.h.2.")) for n in params[0])
    assert not any(n.startswith(("model.wpe", "model.h.0.")) for n in params[1]) and "model.lm_head.weight" in params[1]
    n_whole = sum(p.numel() for p in whole.model.parameters())
    n_stages = sum(p.numel() for s in stages for p in s.parameters())
    assert n_stages == n_whole + whole.model.wte.weight.numel()   # the tied weight lives on both end stages


def test_apply_takes_the_stage_a_rank_owns(tmp_path):
    from remat.apply import apply
    report, blocks = synthetic_report(), [["h.0", "h.1"], ["h.2", "h.3"]]
    model = load_workload("gpt", SHAPE).workload.model
    plans = plan_stages(dataclass_fp(report, model), blocks, schedule="1f1b", microbatches=4, base_peaks=[1000, 900],
                        planner="all", budget_bytes=None)
    from remat.plan.pipeline import StagePlan
    pp = PipelinePlan(schedule="1f1b", microbatches=4, budget_bytes=950, reserve=0.0, split_points=["h.2"],
                      split_source="given",
                      stages=[StagePlan(stage=k, blocks=blocks[k], in_flight=1, base_peak_bytes=1, plan=plans[k])
                              for k in range(2)])
    handle = apply(model, pp, stage=1)
    assert sorted(w.path for w in handle) == ["h.2", "h.3"]
    handle.remove()
    with pytest.raises(PlanError, match="stage"):
        apply(model, pp)   # a pipeline plan needs the stage


def dataclass_fp(report: ProfileReport, model: torch.nn.Module) -> ProfileReport:
    import dataclasses
    return dataclasses.replace(report, fingerprint=fingerprint(model))


# -- world size 2 on gloo ------------------------------------------------------------------------------

def test_pipeline_cli_per_stage_plans_bitwise_equal_and_side_by_side(rank_env, tmp_path):
    out = tmp_path / "out"
    code = main(["distributed", "--workload", "gpt", "--shape", ",".join(f"{k}={v}" for k, v in SHAPE.items()),
                 "--world-size", "2", "--engine", "pipeline", "--schedule", "1f1b", "--microbatches", "4",
                 "--split-points", "h.2", "--budget", "92%", "--out", str(out), "--dist-steps", "2",
                 "--dist-warmup", "2", "--dist-timeout", "30", "--dist-wall-timeout", "150"])
    assert code == 0
    d = json.loads((out / "pipeline.json").read_text())
    assert PipelineReport.from_json(json.loads(json.dumps(d))).to_json() == d
    assert set(d["sides"]) == {"none", "uniform", "remat"} and d["split_points"] == ["h.2"]
    assert d["ideal_bubble_fraction"] == pytest.approx(1 / 5)
    none, uni, rem = (d["sides"][s]["per_stage"] for s in ("none", "uniform", "remat"))
    assert [s["in_flight"] for s in none] == [2, 1]
    assert [s["blocks"] for s in none] == [["h.0", "h.1"], ["h.2", "h.3"]]
    # uniform: every block of every stage; remat: per stage, and only where the budget needs it
    assert [s["boundaries"] for s in uni] == [["h.0", "h.1"], ["h.2", "h.3"]]
    assert rem[0]["boundaries"] and all(b.startswith(("h.0", "h.1")) for b in rem[0]["boundaries"])
    assert rem[0]["peak_bytes"] < none[0]["peak_bytes"] and uni[0]["peak_bytes"] < none[0]["peak_bytes"]
    assert all(s["fits_budget"] for s in rem)
    for side in (none, uni, rem):
        for s in side:
            assert s["peak_bytes"] > 0 and len(s["held_at_backward_bytes"]) == 4
            assert 0 < s["p50_ms"] <= s["p95_ms"] and 0.0 <= s["bubble_fraction"] < 1.0
            kinds = [e[0] for e in s["timeline"]]
            assert kinds.count("forward") == 4 and kinds.count("backward") == 4
            assert s["exposed_p2p_ms"] <= s["p2p_ms"] + 1e-6
    assert all(s["replay_ms"] > 0 for s in uni) and all(s["replay_ms"] == 0 for s in none)
    # 1F1B, p=2: stage 0 holds 2 microbatches as its first three backwards start, 1 at the last
    held = none[0]["held_at_backward_bytes"]
    assert held[3] < held[2] and held[3] < held[1]
    assert all(s["bubble_delta_vs_none"] is None for s in none)
    assert all(isinstance(s["bubble_delta_vs_none"], float) for s in rem)
    # remat's plan on stage 0 was predicted from the measured unplanned peak; the prediction is conservative
    assert rem[0]["predicted_peak_bytes"] >= rem[0]["peak_bytes"] * 0.9
    for name in ("uniform", "remat"):
        eq = d["equivalence"][name]
        assert eq["bitwise_equal"] and eq["max_abs_diff"] == 0.0 and eq["first_loss_equal"] and eq["ok"]
        assert eq["params_compared"] > 0
    assert d["negative_control_rejected"] is True
    md = (out / "pipeline.md").read_text()
    assert "| remat | 0 | 2 |" in md and md.count("stage 0 |") == 3 and "bitwise equal" in md
    plan = load_any_plan(out / "plan.json")
    assert isinstance(plan, PipelinePlan) and [s.in_flight for s in plan.stages] == [2, 1]
    assert [b.module for b in plan.for_stage(0).boundaries] == rem[0]["boundaries"]


def test_bubble_matches_the_schedule_formula_for_known_stage_times(rank_env, tmp_path):
    cfg = PipelineConfig(spec=SLEEP, shape={"batch_size": 8}, world_size=2, schedule="gpipe", microbatches=4,
                         split_points=["blocks.1"], sides=["none"], steps=3, warmup=1, timeout_s=30)
    d = run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=90).to_json()
    ideal = 1 / 5   # (p - 1) / (m + p - 1)
    for s in d["sides"]["none"]["per_stage"]:
        assert s["bubble_fraction"] == pytest.approx(ideal, abs=0.06), s
    # the step is (m + p - 1) x (forward + backward) of one stage: 5 x 90 ms
    assert d["sides"]["none"]["p50_ms"] == pytest.approx(450, rel=0.2)


def test_dead_stage_is_named_and_leaves_no_process(rank_env, tmp_path):
    rank_env.setenv(FAULT_ENV, "exit:1:1")   # stage 1 calls os._exit(1) after its first step
    cfg = PipelineConfig(spec="gpt", shape=SHAPE, world_size=2, microbatches=4, split_points=["h.2"], sides=["none"],
                         steps=2, warmup=1, timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=60)
    assert time.monotonic() - t0 < 50
    assert info.value.message.startswith("rank 1 died after 1/")
    assert all(_alive_rank_pid(tmp_path.resolve(), r, PIPELINE_WORKER_MODULE) is None for r in (0, 1))


def test_hung_stage_is_named_after_the_p2p_timeout(rank_env, tmp_path):
    rank_env.setenv(FAULT_ENV, "hang:1:1")   # stage 1 sleeps forever after its first step
    cfg = PipelineConfig(spec="gpt", shape=SHAPE, world_size=2, microbatches=4, split_points=["h.2"], sides=["none"],
                         steps=2, warmup=1, timeout_s=4)
    with pytest.raises(DistributedError) as info:
        run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=60)
    assert info.value.message.startswith("rank 1 (pipeline stage 1) hung"), info.value.message
    assert "timed out after 4 s" in info.value.message and "was stopped by the launcher" in info.value.message
    assert all(_alive_rank_pid(tmp_path.resolve(), r, PIPELINE_WORKER_MODULE) is None for r in (0, 1))


def test_pipeline_config_refusals():
    with pytest.raises(DistributedError, match="world size"):
        PipelineConfig(spec="gpt", shape=SHAPE, world_size=2, split_points=["h.1", "h.2"], sides=["none"])
    with pytest.raises(DistributedError, match="at least 2"):
        PipelineConfig(spec="gpt", shape=SHAPE, world_size=1, split_points=[], sides=["none"])
    with pytest.raises(DistributedError, match="profile"):
        PipelineConfig(spec="gpt", shape=SHAPE, world_size=2, split_points=["h.1"], sides=["none", "remat"])
    d = PipelineConfig(spec="gpt", shape=SHAPE, world_size=2, split_points=["h.1"], sides=["none"]).to_json()
    assert PipelineConfig.from_json(d).to_json() == d
    with pytest.raises(DistributedError):
        PipelineConfig.from_json({**d, "steps": "2"})
    model = load_workload("gpt", SHAPE).workload.model
    x, _ = split_batch(load_workload("gpt", SHAPE).workload.batch(0))
    for bad in (["h.0"], ["h.4"], ["x.2"], ["h"]):
        with pytest.raises(DistributedError):
            stage_layout(model, bad, 2, x)
    assert remat.apply is not None


def test_equivalence_rejects_a_plan_that_changes_the_gradients(rank_env, tmp_path):
    """Negative control on the real path: replay without RNG preservation redraws dropout masks."""
    from remat.plan.model import Boundary, Plan
    from remat.plan.pipeline import StagePlan
    model = load_workload("gpt", SHAPE).workload.model
    blocks = [["h.0", "h.1"], ["h.2", "h.3"]]

    def stage_plan(names: list[str]) -> Plan:
        return Plan(planner="all", budget_bytes=None, reserve=0.0, preserve_rng_state=False,
                    boundaries=[Boundary(module=n, mode=CheckpointMode.FULL, saved_bytes=0, replay_ms=0.0)
                                for n in names],
                    excluded=[], predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=0,
                    baseline_step_ms=0.0, fingerprint=fingerprint(model))
    pp = PipelinePlan(schedule="1f1b", microbatches=4, budget_bytes=1 << 30, reserve=0.0, split_points=["h.2"],
                      split_source="given", stages=[StagePlan(stage=k, blocks=blocks[k], in_flight=[2, 1][k],
                                                              base_peak_bytes=1, plan=stage_plan(blocks[k]))
                                                    for k in range(2)])
    cfg = PipelineConfig(spec="gpt", shape=SHAPE, world_size=2, microbatches=4, split_points=["h.2"],
                         sides=["none", "remat"], plan=pp.to_json(), steps=1, warmup=1, timeout_s=20)
    report = run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=90)
    eq = report.data["equivalence"]["remat"]
    assert not eq["bitwise_equal"] and not eq["ok"] and eq["max_abs_diff"] > 0
    assert not report.ok


@pytest.mark.parametrize("argv, words", [
    (["--workload", "gpt", "--shape", "batch_size=6", "--microbatches", "4"], "does not split into 4"),
    (["--workload", "cnn", "--shape", "batch_size=4", "--microbatches", "2"], "cannot be split into pipeline stages"),
    (["--workload", "gpt", "--shape", "batch_size=8,n_layer=4", "--split-points", "h.0"], "must be increasing"),
    (["--workload", "gpt", "--shape", "batch_size=8", "--world-size", "1"], "at least 2"),
])
def test_pipeline_cli_refuses_bad_input_with_exit_2(tmp_path, capsys, argv, words):
    base = ["distributed", "--engine", "pipeline", "--out", str(tmp_path / "o"), "--dist-wall-timeout", "30"]
    if "--world-size" not in argv:
        base += ["--world-size", "2"]
    assert main(base + argv) == 2
    assert words in capsys.readouterr().err.replace("\n", " ")


def test_timeline_rows_place_each_interval_in_its_columns():
    from remat.receipt.pipeline_md import timeline_rows
    side = {"per_stage": [
        {"stage": 0, "timeline": [["forward", 0, 0.0, 25.0], ["p2p:fwd_send", -1, 25.0, 50.0],
                                  ["backward", 0, 50.0, 100.0], ["replay", -1, 50.0, 75.0]]},
        {"stage": 1, "timeline": [["forward", 0, 25.0, 50.0], ["loss", 0, 50.0, 75.0]]}]}
    rows = timeline_rows(side, width=8)
    assert rows[0] == "stage 0 |FF--RRBB|"      # replay drawn over the backward it runs in
    assert rows[1] == "stage 1 |..FFLL..|"      # idle where nothing was recorded
    assert rows[2].endswith("100 ms")
