"""Pipeline parallelism (issue 17): per-stage plans, stage modules, bubbles, equivalence, guardrails.

Launches run at world size 2 on gloo with short p2p timeouts and wall limits, so a regression
fails instead of hanging CI.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import remat
from remat.cli.main import main
from remat.distributed.config import DistributedConfig, Engine, PipelineSettings
from remat.distributed.launch import WORKER_MODULE, _alive_rank_pid
from remat.distributed.pipeline.engine import (balanced_bounds, build_stage_module, run_pipeline_config, split_batch,
                                               stage_layout)
from remat.distributed.report import DistributedReport
from remat.distributed.worker import FAULT_ENV
from remat.errors import BudgetError, DistributedError, PlanError
from remat.plan.pipeline import PipelinePlan, Schedule, Side, ideal_bubble, in_flight, load_any_plan, plan_stages
from remat.profile.fingerprint import fingerprint
from remat.profile.model import CandidateCost, PeakRow, ProfileReport
from remat.types import CheckpointMode, MemorySource
from remat.workload import load_workload


_SETTINGS = {f.name for f in dataclasses.fields(PipelineSettings)}


def pipeline_config(**kw) -> DistributedConfig:
    """A DistributedConfig of engine pipeline, its PipelineSettings taken from the same keywords."""
    settings = PipelineSettings(**{k: v for k, v in kw.items() if k in _SETTINGS})
    return DistributedConfig(engine=Engine.PIPELINE, pipeline=settings,
                             **{k: v for k, v in kw.items() if k not in _SETTINGS})

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
    from remat.wrap import apply
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

@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """One side-by-side launch (no plan, uniform, per-stage) shared by the tests that read its output folder."""
    out = tmp_path_factory.mktemp("pipeline") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(FAULT_ENV, raising=False)
        code = main(["distributed", "--workload", "gpt", "--shape", ",".join(f"{k}={v}" for k, v in SHAPE.items()),
                     "--world-size", "2", "--engine", "pipeline", "--schedule", "1f1b", "--microbatches", "4",
                     "--split-points", "h.2", "--budget", "92%", "--out", str(out), "--dist-steps", "2",
                     "--dist-warmup", "2", "--dist-timeout", "30", "--dist-wall-timeout", "150"])
    return code, out


def stage_rows(d: dict, side: str) -> list[dict]:
    """One side's rows of a pipeline run's report JSON, each row's figures and its stage's as one object (NOTE [one
    per-rank report]: a pipeline row is a rank's row with its ``stage``)."""
    return [{**{k: v for k, v in r.items() if k != "stage"}, **r["stage"]} for r in d["per_rank"][side]]


def sides_run(d: dict) -> set[str]:
    return {name for name, rows in d["per_rank"].items() if rows is not None}


def test_pipeline_cli_per_stage_plans_bitwise_equal_and_side_by_side(gpt_run):
    code, out = gpt_run
    assert code == 0
    d = json.loads((out / "pipeline.json").read_text())
    assert DistributedReport.from_json(json.loads(json.dumps(d))).to_json() == d
    assert d["engine"] == "pipeline" and d["passed"] is True and d["over_budget_ranks"] == []
    assert sides_run(d) == {"none", "uniform", "remat"} and d["pipeline"]["split_points"] == ["h.2"]
    assert d["pipeline"]["ideal_bubble_fraction"] == pytest.approx(1 / 5)
    none, uni, rem = (stage_rows(d, s) for s in ("none", "uniform", "remat"))
    assert [s["in_flight"] for s in none] == [2, 1]
    assert [s["blocks"] for s in none] == [["h.0", "h.1"], ["h.2", "h.3"]]
    # uniform: every block of every stage; remat: per stage, and only where the budget needs it
    assert [s["boundaries"] for s in uni] == [["h.0", "h.1"], ["h.2", "h.3"]]
    assert rem[0]["boundaries"] and all(b.startswith(("h.0", "h.1")) for b in rem[0]["boundaries"])
    assert rem[0]["peak_bytes"] < none[0]["peak_bytes"] and uni[0]["peak_bytes"] < none[0]["peak_bytes"]
    assert all(s["peak_bytes"] <= d["budget_bytes"] for s in rem)
    for side in (none, uni, rem):
        for s in side:
            assert s["peak_bytes"] > 0 and len(s["held_at_backward_bytes"]) == 4
            assert 0 < s["p50_ms"] <= s["p95_ms"] and 0.0 <= s["bubble_fraction"] < 1.0
            kinds = [e[0] for e in s["timeline"]]
            assert kinds.count("forward") == 4 and kinds.count("backward") == 4
            assert s["exposed_comm_ms"] <= s["comm_ms"] + 1e-6   # a pipeline's communication is p2p
    assert all(s["replay_ms"] > 0 for s in uni) and all(s["replay_ms"] == 0 for s in none)
    # 1F1B, p=2: stage 0 holds 2 microbatches as its first three backwards start, 1 at the last
    held = none[0]["held_at_backward_bytes"]
    assert held[3] < held[2] and held[3] < held[1]
    assert all(s["bubble_delta_vs_none"] is None for s in none)
    assert all(isinstance(s["bubble_delta_vs_none"], float) for s in rem)
    # remat's plan on stage 0 was predicted from the measured unplanned peak; the prediction is conservative
    assert rem[0]["predicted_peak_bytes"] >= rem[0]["peak_bytes"] * 0.9
    for name in ("uniform", "remat"):
        eq = d["pipeline"]["equivalence"][name]
        assert eq["bitwise_equal"] and eq["max_abs_diff"] == 0.0 and eq["first_loss_equal"] and eq["ok"]
        assert eq["params_compared"] > 0
    assert d["pipeline"]["negative_control_rejected"] is True
    md = (out / "pipeline.md").read_text()
    assert "| remat | 0 | 2 |" in md and md.count("stage 0 |") == 3 and "bitwise equal" in md
    plan = load_any_plan(out / "plan.json")
    assert isinstance(plan, PipelinePlan) and [s.in_flight for s in plan.stages] == [2, 1]
    assert [b.module for b in plan.for_stage(0).boundaries] == rem[0]["boundaries"]


def test_bubble_matches_the_schedule_formula_for_known_stage_times(rank_env, tmp_path):
    cfg = pipeline_config(spec=SLEEP, shape={"batch_size": 8}, world_size=2, schedule="gpipe", microbatches=4,
                         split_points=["blocks.1"], sides=["none"], steps=3, warmup=1, timeout_s=30)
    d = run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=90).to_json()
    ideal = 1 / 5   # (p - 1) / (m + p - 1)
    for s in stage_rows(d, "none"):
        assert s["bubble_fraction"] == pytest.approx(ideal, abs=0.06), s
    # the step is (m + p - 1) x (forward + backward) of one stage: 5 x 90 ms of sleep. Only the lower bound is
    # asserted: sleeps never end early, so a schedule that overlapped what it must not (4 x 90 ms) fails at any
    # load, while a loaded machine only adds time (no speed is asserted in a unit test)
    assert d["step_ms_p50"]["none"] >= 450 * 0.95


def test_dead_stage_is_named_and_leaves_no_process(rank_env, tmp_path):
    rank_env.setenv(FAULT_ENV, "exit:1:1")   # stage 1 calls os._exit(1) after its first step
    cfg = pipeline_config(spec="gpt", shape=SHAPE, world_size=2, microbatches=4, split_points=["h.2"], sides=["none"],
                         steps=2, warmup=1, timeout_s=20)
    with pytest.raises(DistributedError) as info:   # the launch's wall limit is the hang bound
        run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=120)
    # named as a death, not as the wall limit running out (that message says "did not finish within")
    assert info.value.message.startswith("rank 1 died after 1/"), info.value.message
    assert all(_alive_rank_pid(tmp_path.resolve(), r, WORKER_MODULE) is None for r in (0, 1))


def test_hung_stage_is_named_after_the_p2p_timeout(rank_env, tmp_path):
    rank_env.setenv(FAULT_ENV, "hang:1:1")   # stage 1 sleeps forever after its first step
    cfg = pipeline_config(spec="gpt", shape=SHAPE, world_size=2, microbatches=4, split_points=["h.2"], sides=["none"],
                         steps=2, warmup=1, timeout_s=4)
    with pytest.raises(DistributedError) as info:
        run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=60)
    assert info.value.message.startswith("rank 1 (pipeline stage 1) hung"), info.value.message
    assert "timed out after 4 s" in info.value.message and "was stopped by the launcher" in info.value.message
    assert all(_alive_rank_pid(tmp_path.resolve(), r, WORKER_MODULE) is None for r in (0, 1))


def test_pipeline_config_refusals():
    with pytest.raises(DistributedError, match="world size"):
        pipeline_config(spec="gpt", shape=SHAPE, world_size=2, split_points=["h.1", "h.2"], sides=["none"])
    with pytest.raises(DistributedError, match="at least 2"):
        pipeline_config(spec="gpt", shape=SHAPE, world_size=1, split_points=[], sides=["none"])
    with pytest.raises(DistributedError, match="profile"):
        pipeline_config(spec="gpt", shape=SHAPE, world_size=2, split_points=["h.1"], sides=["none", "remat"])
    d = pipeline_config(spec="gpt", shape=SHAPE, world_size=2, split_points=["h.1"], sides=["none"]).to_json()
    assert DistributedConfig.from_json(d).to_json() == d and d["engine"] == "pipeline"
    # one config, one engine: a pipeline's settings or per-stage plans under ddp are refused, as is a pipeline
    # without its settings; ddp without them is the safe twin
    with pytest.raises(DistributedError, match="engine pipeline"):
        DistributedConfig.from_json({**d, "engine": "ddp"})
    with pytest.raises(DistributedError, match="needs its settings"):
        DistributedConfig.from_json({k: v for k, v in d.items() if k != "pipeline"})
    assert DistributedConfig.from_json({k: v for k, v in d.items() if k != "pipeline"} | {"engine": "ddp"}).pipeline is None
    with pytest.raises(DistributedError):
        DistributedConfig.from_json({**d, "steps": "2"})
    model = load_workload("gpt", SHAPE).workload.model
    x, _ = split_batch(load_workload("gpt", SHAPE).workload.batch(0))
    for bad in (["h.0"], ["h.4"], ["x.2"], ["h"]):
        with pytest.raises(DistributedError):
            stage_layout(model, bad, 2, x)
    assert remat.apply is not None


def test_verify_engine_pipeline_rejects_a_plan_that_changes_the_gradients(rank_env, tmp_path):
    """`remat verify --engine pipeline`'s negative control on the real path: replay without RNG preservation
    redraws dropout masks, so the planned pipeline's gradients differ and verify exits 1."""
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
    path = pp.save(tmp_path / "plan.json")
    code = main(["verify", "--workload", "gpt", "--shape", ",".join(f"{k}={v}" for k, v in SHAPE.items()),
                 "--plan", str(path), "--world-size", "2", "--engine", "pipeline", "--microbatches", "4",
                 "--out", str(tmp_path / "v"), "--dist-timeout", "20", "--dist-wall-timeout", "90"])
    assert code == 1
    report = DistributedReport.from_json(json.loads((tmp_path / "v" / "pipeline.json").read_text()))
    assert report.sides == ["none", "remat"] and report.pipeline is not None
    eq = report.pipeline.equivalence[Side.REMAT]
    assert not eq.bitwise_equal and not eq.ok and eq.max_abs_diff > 0
    assert not report.pipeline.ok and not report.passed
    # the receipt written beside it records the failure, and check fails on it without a launch
    assert main(["check", str(tmp_path / "v" / "receipt.json"), "--quick"]) == 1


def test_verify_engine_pipeline_passes_the_per_stage_plans(gpt_run, tmp_path, capsys):
    _, out = gpt_run
    code = main(["verify", "--workload", "gpt", "--shape", ",".join(f"{k}={v}" for k, v in SHAPE.items()),
                 "--plan", str(out / "plan.json"), "--world-size", "2", "--engine", "pipeline", "--microbatches", "4",
                 "--out", str(tmp_path / "v"), "--dist-timeout", "20", "--dist-wall-timeout", "90"])
    assert code == 0, capsys.readouterr()
    d = json.loads((tmp_path / "v" / "pipeline.json").read_text())
    assert sides_run(d) == {"none", "remat"} and d["pipeline"]["split_points"] == ["h.2"]   # the plan's split
    assert d["pipeline"]["equivalence"]["remat"]["bitwise_equal"] and d["pipeline"]["negative_control_rejected"] is True
    assert [s["boundaries"] for s in stage_rows(d, "remat")] == \
        [[b.module for b in st.plan.boundaries] for st in load_any_plan(out / "plan.json").stages]


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


@pytest.mark.parametrize("argv, words", [
    (["frontier", "--budget", "80%", "--plans", "all"], "--plans does not apply to --engine pipeline"),
    (["verify", "--plan", "WHOLE"], "whole-model plan"),
    (["frontier", "--budget", "80%"], "needs --world-size"),
])
def test_verify_and_frontier_engine_pipeline_refusals(tmp_path, capsys, argv, words):
    from remat.plan.model import Plan
    whole = tmp_path / "whole.json"
    Plan(planner="none", budget_bytes=None, reserve=0.0, boundaries=[], excluded=[], predicted_peak_bytes=0,
         predicted_overhead_ms=0.0, baseline_peak_bytes=0, baseline_step_ms=0.0,
         fingerprint=fingerprint(load_workload("gpt", SHAPE).workload.model)).save(whole)
    argv = [str(whole) if a == "WHOLE" else a for a in argv]
    ws = [] if "needs --world-size" in words else ["--world-size", "2"]
    assert main(argv + ["--workload", "gpt", "--engine", "pipeline", "--out", str(tmp_path / "o")] + ws) == 2
    assert words in capsys.readouterr().err.replace("\n", " ")


# -- the pipeline receipt ---------------------------------------------------------------------------

def test_pipeline_receipt_shows_the_per_stage_table_and_timelines(gpt_run):
    import hashlib
    import re
    import xml.etree.ElementTree as ET
    from remat.profile import module_revision
    from remat.receipt import load_receipt_with_digest
    _, out = gpt_run
    receipt, digest = load_receipt_with_digest(out / "receipt.json")
    assert receipt.pipeline is not None and receipt.pipeline.why_not == [] and receipt.world_size.engine.value == "pipeline"
    assert receipt.settings is None and receipt.decision is None   # a pipeline run has no single-process section
    assert digest == hashlib.sha256((out / "receipt.json").read_bytes()).hexdigest()
    # one boundary record per planned boundary, with the revision of that module in a fresh model
    plan = load_any_plan(out / "plan.json")
    model = load_workload("gpt", SHAPE).workload.model
    assert [(b.stage, b.module, b.revision) for b in receipt.pipeline.boundaries] == \
        [(st.stage, b.module, module_revision(model.get_submodule(b.module))) for st in plan.stages
         for b in st.plan.boundaries]
    html = (out / "report.html").read_text()
    assert f"receipt.json sha256 {digest}" in html and f"receipt.json sha256 {digest}" in (out / "report.md").read_text()
    # the per-stage table: a row per side and stage, stage 0 holding 2 microbatches under 1F1B, stage 1 one
    for side in ("none", "uniform", "remat"):
        assert f"<td>{side}</td><td>0</td><td>2</td>" in html and f"<td>{side}</td><td>1</td><td>1</td>" in html
    # the timelines: one SVG per side, one lane per stage, each stage's 4 forwards and 4 backwards drawn
    svgs = re.findall(r"<svg .*?</svg>", html)
    assert len(svgs) == 3
    for svg in svgs:
        root = ET.fromstring(svg)
        titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
        assert sum(t.startswith("forward mb") for t in titles) == 8
        assert sum(t.startswith("backward mb") for t in titles) == 8
        assert {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")} >= {"stage 0", "stage 1"}
    replays = re.findall(r"<title>replay", svgs[1])   # uniform: every block checkpointed, replays on both stages
    assert replays and "<title>replay" not in svgs[0]


def test_check_pipeline_receipt_quick_and_what_it_rejects(gpt_run, tmp_path):
    import shutil
    from remat.errors import ReceiptError
    from remat.workflow.pipeline import check_pipeline_receipt
    from remat.workflow.findings import FindingKind
    from remat.receipt import Receipt, write_receipt
    _, out = gpt_run
    assert main(["check", str(out / "receipt.json"), "--quick"]) == 0
    data = json.loads((out / "receipt.json").read_text())
    run = data["world_size"]["pipeline"]

    def edited(fn) -> Receipt:
        d = json.loads(json.dumps(data))
        fn(d["world_size"]["pipeline"])
        return Receipt.from_json(d)
    # a boundary whose module changed since: MODEL, and the re-run is skipped
    r = edited(lambda p: p["boundaries"][0].update(revision="0" * 16))
    rep = check_pipeline_receipt(r, quick=False)
    assert not rep.passed and [f.kind for f in rep.failures] == [FindingKind.MODEL]
    assert rep.failures[0].boundary == run["boundaries"][0]["module"]
    assert any("not re-run" in s for s in rep.skipped)
    # a receipt that recorded different gradients: DECISION
    def differ(p):
        p["report"]["pipeline"]["equivalence"]["remat"].update(ok=False, bitwise_equal=False, max_abs_diff=0.5)
    rep = check_pipeline_receipt(edited(differ), quick=True)
    assert [f.kind for f in rep.failures] == [FindingKind.DECISION] and "differ" in rep.failures[0].message
    # reports rendered from another receipt: REPORT (exit 1 from the CLI)
    folder = tmp_path / "copy"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("distributed"))
    other = Receipt.from_json(json.loads(json.dumps(data)))
    other.context.created = "2000-01-01T00:00:00+00:00"
    write_receipt(other, tmp_path / "other")
    shutil.copy(tmp_path / "other" / "report.md", folder / "report.md")
    assert main(["check", str(folder / "receipt.json"), "--quick"]) == 1
    # malformed: boundary records that are not the plans' (exit 2, nothing run)
    bad = json.loads(json.dumps(data))
    bad["world_size"]["pipeline"]["boundaries"] = run["boundaries"][1:]
    with pytest.raises(ReceiptError, match="boundary records"):
        Receipt.from_json(bad)
    (folder / "receipt.json").write_text(json.dumps(bad))
    assert main(["check", str(folder / "receipt.json"), "--quick"]) == 2


def test_check_pipeline_receipt_re_runs_the_pipeline(gpt_run, tmp_path):
    from remat.workflow.pipeline import check_pipeline_receipt
    from remat.workflow.findings import FindingKind
    from remat.receipt import Receipt
    _, out = gpt_run
    assert main(["check", str(out / "receipt.json")]) == 0
    # the same receipt with a per-device budget below every stage's peak: its recorded peaks are over it (a row's
    # fit is its peak against the report's budget, NOTE [one per-rank report]), and the re-run still finds the
    # gradients bitwise equal and names both stages' peaks over the budget
    d = json.loads((out / "receipt.json").read_text())
    d["world_size"]["pipeline"]["report"]["budget_bytes"] = 1
    rep = check_pipeline_receipt(Receipt.from_json(d), work_dir=tmp_path / "w", wall_timeout_s=90)
    assert any("bitwise equal" in c for c in rep.checked)
    assert [f.kind for f in rep.failures] == [FindingKind.DECISION, FindingKind.PEAK, FindingKind.PEAK]
    assert "stage 0, stage 1" in rep.failures[0].message
    assert [f.message.split(":")[0] for f in rep.failures[1:]] == ["stage 0", "stage 1"]


# -- a zoo transformer ---------------------------------------------------------------------------------

ZOO_TTE = str(Path(__file__).parent.parent / "benchmarks" / "zoo" / "torch_transformer_encoder.py") + ":build_pipeline"


def test_zoo_transformer_encoder_stages_compose_to_the_whole_model_bitwise():
    shape = {"batch_size": 4, "seq_len": 8, "n_layer": 4, "d_model": 16, "vocab": 32, "n_tags": 8}
    torch.manual_seed(0)
    whole = load_workload(ZOO_TTE, shape).workload
    whole.model.eval()   # dropout off: the two builds draw no masks
    x, _ = split_batch(whole.batch(0))
    expected = whole.model(x)
    stages = []
    for k in range(2):
        torch.manual_seed(0)
        model = load_workload(ZOO_TTE, shape).workload.model.eval()
        layout = stage_layout(model, ["encoder.layers.2"], 2, x)
        stages.append(build_stage_module(model, layout, k))
    assert layout.blocks_path == "encoder.layers" and layout.tied == []
    assert "encoder.norm" in layout.head_modules and layout.embed_modules == {"embed"}
    assert torch.equal(stages[1](stages[0](x)), expected)


def test_a_model_without_embed_and_head_is_split_by_its_blocks_path():
    """NOTE [pipeline by module path]: no protocol, so the modules before the blocks are the first stage's."""
    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(4, 4)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return x
    layout = stage_layout(Stack(), ["layers.1"], 2, torch.zeros(2, 4))
    assert (layout.embed_modules, layout.head_modules, layout.bounds) == ({"inp"}, set(), [0, 1, 3])
    assert layout.stage_modules(0) == {"inp", "layers.0"} and layout.trained_modules(1) == {"layers.1", "layers.2"}


def test_timeline_rows_place_each_interval_in_its_columns():
    import dataclasses
    from remat.receipt.render import timeline_rows
    from remat.distributed.report import RankFigures, SideReport, StageFigures, TimelineSpan
    blank = StageFigures(stage=0, host="h", in_flight=1, blocks=[], boundaries=[], forward_ms=0.0, backward_ms=0.0,
                         replay_ms=0.0, optimizer_ms=0.0, idle_ms=0.0, bubble_fraction=0.0, held_at_backward_bytes=[],
                         bubble_delta_vs_none=None, predicted_peak_bytes=None, grad_sq_sum=None, timeline=[])
    timelines = [[["forward", 0, 0.0, 25.0], ["p2p:fwd_send", -1, 25.0, 50.0], ["backward", 0, 50.0, 100.0],
                  ["replay", -1, 50.0, 75.0]], [["forward", 0, 25.0, 50.0], ["loss", 0, 50.0, 75.0]]]
    rows = [RankFigures(rank=k, peak_bytes=0, p50_ms=0.0, p95_ms=0.0, exposed_comm_ms=None, comm_ms=None,
                        ablation_step_ms=None, stage=dataclasses.replace(
                blank, stage=k, timeline=[TimelineSpan(kind=e[0], mb=e[1], start_ms=e[2], end_ms=e[3]) for e in t]))
            for k, t in enumerate(timelines)]
    side = SideReport(per_rank=rows, global_samples_per_s=0.0, step_ms_p50=0.0, collectives={}, exposed_comm_ms=None,
                      comm_ms=None, ablation_step_ms=None)
    rows = timeline_rows(side, width=8)
    assert rows[0] == "stage 0 |FF--RRBB|"      # replay drawn over the backward it runs in
    assert rows[1] == "stage 1 |..FFLL..|"      # idle where nothing was recorded
    assert rows[2].endswith("100 ms")


# -- interleaved 1F1B ------------------------------------------------------------------------------------

def test_in_flight_from_the_schedules_own_order():
    from remat.plan.pipeline import in_flight_from_order
    # rank 0 of 2, stages 0 and 2, m = 2: F0 F0 F2 F2 B2 B2 B0 B0: holds 2 + 2 after its 4th forward
    order = [(0, "F"), (0, "F"), (2, "F"), (2, "F"), (2, "B"), (0, "F"), (2, "B"), (0, "B"), (0, "B"), (0, "B")]
    assert in_flight_from_order(order) == {0: 2, 2: 2}
    assert in_flight_from_order([(1, "F"), (1, "B"), (1, "F"), (1, "B")]) == {1: 1}
    assert ideal_bubble(2, 4, 2) == pytest.approx(1 / 9)
    with pytest.raises(PlanError):
        in_flight("interleaved-1f1b", 0, 2, 4)


def test_interleaved_1f1b_gradients_match_the_unsplit_model(rank_env, tmp_path):
    """Two stages per rank (torch's ScheduleInterleaved1F1B): the first step's gradients, summed over the ranks,
    equal the unsplit model's on the mean microbatch loss (each stage scales only its own parameters by 1/m)."""
    shape = {**SHAPE, "dropout": 0.0}
    cfg = pipeline_config(spec="gpt", shape=shape, world_size=2, schedule="interleaved-1f1b", stages_per_rank=2,
                         microbatches=4, split_points=["h.1", "h.2", "h.3"], sides=["none"], steps=1, warmup=1,
                         timeout_s=30)
    d = run_pipeline_config(cfg, work_dir=tmp_path, wall_timeout_s=120).to_json()
    ranks = stage_rows(d, "none")
    # rank r runs stages r and r + 2; torch's order warms up (v - 1) p + 2 (p - 1 - r) forwards, then one more
    assert [s["blocks"] for s in ranks] == [["h.0", "h.2"], ["h.1", "h.3"]]
    assert [s["in_flight"] for s in ranks] == [5, 3]
    assert d["pipeline"]["ideal_bubble_fraction"] == pytest.approx(1 / 9) and d["pipeline"]["stages_per_rank"] == 2
    for s in ranks:
        kinds = [e[0] for e in s["timeline"]]
        assert kinds.count("forward") == 8 and kinds.count("backward") == 8   # v x m chunks per rank
    torch.manual_seed(0)
    wl = load_workload("gpt", shape).workload
    x, y = split_batch(wl.batch(0))
    loss = sum(wl.loss(wl.model, (x[i:i + 2], y[i:i + 2])) for i in range(0, 8, 2)) / 4
    loss.backward()
    expected = sum(p.grad.double().pow(2).sum() for p in wl.model.parameters())
    expected += wl.model.wte.weight.grad.double().pow(2).sum()   # the tied weight lives on both end stages
    assert sum(s["grad_sq_sum"] for s in ranks) == pytest.approx(float(expected), rel=1e-5)


def _two_stages_at_950():
    """Two stages planned from the synthetic profile at a 950-byte budget: (stage plans, the PipelinePlan, the
    StageReplanner that made them)."""
    from remat.plan.pipeline import StagePlan
    from remat.distributed.pipeline.worker import StageReplanner
    report, blocks = synthetic_report(), [["h.0", "h.1"], ["h.2", "h.3"]]
    kw = dict(schedule="1f1b", microbatches=4, reserve=0.0)
    plans = plan_stages(report, blocks, planner="optimal", budget_bytes=950, base_peaks=[1000, 900], **kw)
    pp = PipelinePlan(schedule="1f1b", microbatches=4, budget_bytes=950, reserve=0.0, split_points=["h.2"],
                      split_source="given", stages=[StagePlan(stage=k, blocks=blocks[k], in_flight=[2, 1][k],
                                                              base_peak_bytes=[1000, 900][k], plan=plans[k])
                                                    for k in range(2)])
    return plans, pp, StageReplanner(report=report, stage_blocks=blocks, budget_bytes=950, planner="optimal",
                                     base_peaks=[1000, 900], plan_kw=kw)


def test_closed_loop_replans_only_the_stage_that_missed():
    """NOTE [pipeline closed loop]: stage 0 measured 80 bytes over its prediction; its base is raised by the miss
    and it is planned again (two boundaries now), stage 1 keeps its plan."""
    from remat.distributed.pipeline.worker import RematSideLoop
    plans, pp, replanner = _two_stages_at_950()
    notes: list[str] = []
    loop = RematSideLoop(rank=None, notes=notes, replanner=replanner)
    loop.peaks = [plans[0].predicted_peak_bytes + 80, 900]
    assert not loop.fits(pp)
    again = loop.correct(pp)
    assert plans[0].predicted_peak_bytes == 900 and len(plans[0].boundaries) == 1
    assert again.stages[0].base_peak_bytes == 1080 and len(again.stages[0].plan.boundaries) == 2
    assert again.stages[0].plan.predicted_peak_bytes == 1080 - 2 * 200 + 100
    assert again.stages[1] is pp.stages[1] and "stage 0 measured" in notes[-1]
    # a miss no plan can absorb is said, and nothing is re-run
    loop.peaks = [2000, 900]
    with pytest.raises(BudgetError):
        loop.correct(pp)
    assert "no re-plan fits" in notes[-1]


def test_remat_side_loop_runs_the_replan_once_and_reports_its_figures():
    """NOTE [pipeline closed loop] through the one closed loop: a side that misses is re-planned and run once
    more, and the figures shipped are the second run's; a side that fits runs once."""
    from remat.distributed.pipeline.worker import RematSideLoop
    plans, pp, replanner = _two_stages_at_950()

    class FakeRank:   # stage 0 peaks 80 bytes over its prediction on every plan: one re-plan, then it stands
        rank, total, runs = 0, 0, 0
        cfg = pipeline_config(spec="gpt", shape=SHAPE, world_size=2, split_points=["h.2"], sides=["none"])

        def run_side(self, name, plan):
            self.runs += 1
            return f"run {self.runs}", [], None

        def gather_peaks(self, result):
            return [self.stage0_peak, 900]

    for over, runs in ((80, 2), (0, 1)):
        rank, notes = FakeRank(), []
        rank.stage0_peak = plans[0].predicted_peak_bytes + over
        loop = RematSideLoop(rank=rank, notes=notes, replanner=replanner)
        shipped, run = loop.run(pp)
        assert rank.runs == runs and run[0] == f"run {runs}" and len(notes) == runs - 1
        assert (shipped is pp) == (runs == 1)
        assert rank.total == (runs - 1) * (rank.cfg.warmup + rank.cfg.steps + 1)


# -- simulated pipelines (NOTE [simulated pipeline]) -------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 8)])
def test_played_schedule_with_equal_stages_has_the_ideal_bubble(schedule, p, m):
    from remat.distributed.pipeline.simulate import play_schedule
    step, busy = play_schedule(schedule, [1.0] * p, [2.0] * p, m)
    assert step == pytest.approx(3.0 * (m + p - 1))   # (m + p - 1) slots of forward + backward
    assert all(1 - b / step == pytest.approx(ideal_bubble(p, m)) for b in busy)
    # a slow stage sets the pace: the others idle for it
    step, busy = play_schedule(schedule, [1.0] * (p - 1) + [2.0], [2.0] * (p - 1) + [4.0], m)
    assert step >= m * 6.0 and busy[-1] == m * 6.0


def test_simulated_pipeline_stages_at_a_world_size_this_machine_lacks():
    from remat.distributed.pipeline.simulate import simulate_pipeline
    shape = {**SHAPE, "n_layer": 4}
    sims = {s: simulate_pipeline("gpt", shape, world_size=4, microbatches=4, schedule=s) for s in ("1f1b", "gpipe")}
    one, gp = sims["1f1b"], sims["gpipe"]
    assert one.split_points == ["h.1", "h.2", "h.3"] and [s.in_flight for s in one.stages] == [4, 3, 2, 1]
    model = load_workload("gpt", shape).workload.model
    for s in one.stages:
        # static: parameters + gradients + AdamW's two moments (+ its step counters, a few bytes each)
        names = [b for b in s.blocks] + (["wte", "wpe"] if s.stage == 0 else []) + \
            (["ln_f", "lm_head"] if s.stage == 3 else [])
        n_bytes = sum(p.numel() * 4 for n, p in model.named_parameters(remove_duplicate=False)
                      if any(n.startswith(x + ".") for x in names))
        assert 4 * n_bytes <= s.static_bytes <= 4 * n_bytes + 1024
        assert s.held_bytes > 0 and s.forward_ms > 0 and s.backward_ms > s.forward_ms
    # GPipe holds all 4 microbatches on every stage: the same stage peaks higher by the extra held ones
    for a, b in zip(one.stages, gp.stages):
        assert b.peak_bytes - a.peak_bytes == (4 - a.in_flight) * a.held_bytes
    assert one.ideal_bubble_fraction == pytest.approx(3 / 7)
    assert all(0 < s.bubble_fraction < 1 for s in one.stages)


def test_a_stage_that_already_fits_gets_no_boundary_even_when_replay_looks_free():
    # replay estimates of 0 ms (a profile measured under load): the optimal planner would take them for free
    report, blocks = synthetic_report(replay_ms=0.0), [["h.0", "h.1"], ["h.2", "h.3"]]
    plans = plan_stages(report, blocks, schedule="1f1b", microbatches=4, base_peaks=[1000, 900], planner="optimal",
                        budget_bytes=950, reserve=0.0)
    assert plans[0].boundaries and plans[1].boundaries == [] and plans[1].predicted_peak_bytes == 900


def test_assembled_report_is_typed_and_round_trips_its_json():
    from remat.distributed.report import GradComparison
    from remat.receipt.render import render_pipeline_markdown
    from remat.plan.pipeline import Side
    from remat.distributed.pipeline.report import RankOutcome, StageResult, TimelineEvent, assemble_pipeline
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

    def outcome(k: int, missing: list[str]) -> RankOutcome:
        cmp = GradComparison(params_compared=3, bitwise_equal=True, within_tolerance=True, max_abs_diff=0.0,
                             worst_param=None, mismatched=[])
        return RankOutcome(results={Side.NONE: result(Side.NONE, k, 8.0), Side.UNIFORM: result(Side.UNIFORM, k, 5.0)},
                           comparisons={Side.UNIFORM: cmp}, negative_rejected=True,
                           losses={Side.NONE: 1.5, Side.UNIFORM: 1.5},
                           missing_grads={Side.NONE: [], Side.UNIFORM: missing}, notes=["rank note"], plans={})
    report = assemble_pipeline(cfg, [outcome(0, []), outcome(1, ["w"])], torch_version="t",
                               memory_source=MemorySource.CPU_LIVE_TENSORS)
    assert report.sides == ["none", "uniform"] and report.engine is Engine.PIPELINE
    assert report.pipeline is not None and report.pipeline.schedule is Schedule.ONE_F_ONE_B
    uni = [r.stage for r in report.side("uniform").per_rank]
    # the pipeline step is 11 ms (stage 0 starts at 1 ms, stage 1 ends at 12): idle 3 ms unplanned, 6 ms uniform
    assert uni[0].bubble_delta_vs_none == pytest.approx(3 / 11)
    assert report.side("none").per_rank[0].stage.bubble_delta_vs_none is None
    assert report.side("none").step_ms_p50 == pytest.approx(11.0) and report.side("none").step_ms_p95 == pytest.approx(11.0)
    assert uni[1].timeline[0].start_ms == pytest.approx(1.0) and uni[1].timeline[1].category == "p2p"
    eq = report.pipeline.equivalence[Side.UNIFORM]
    assert not eq.ok and eq.mismatched == ["stage 1: w: no gradient"] and eq.params_compared == 6 and eq.first_loss_equal
    assert not report.passed and report.over_budget == [] and report.remat_plan is None
    assert report.notes[-1] == "rank note"
    d = json.loads(json.dumps(report.to_json()))
    assert d["per_rank"]["uniform"][1]["stage"]["timeline"][1] == ["p2p:send", -1, pytest.approx(2.0),
                                                                   pytest.approx(3.0)]
    assert d["per_rank"]["uniform"][0]["comm_ms"] == pytest.approx(0.1)   # the row's p2p
    again = DistributedReport.from_json(d)
    assert again == report and again.to_json() == d
    # the schema comes from the fields' bounds: a bubble over 1, a short timeline row or no schema_version is refused
    for bad in ({**d, "schema_version": 2}, {k: v for k, v in d.items() if k != "schema_version"}):
        with pytest.raises(DistributedError):
            DistributedReport.from_json(bad)
    for key, value in (("bubble_fraction", 1.5), ("timeline", [["forward", 0, 1.0]])):
        bad = json.loads(json.dumps(d))
        bad["per_rank"]["none"][0]["stage"][key] = value
        with pytest.raises(DistributedError, match=key):
            DistributedReport.from_json(bad)
    assert "| uniform | 1 |" in render_pipeline_markdown(again)
    from remat.cli.cmd_distributed import _frontier_table, render_report
    from remat.cli.render import console
    with console.capture() as cap:
        render_report(again)
        console.print(_frontier_table(again))
    printed = cap.get()
    assert "DIFFERENT" in printed and "stage 1: w: no gradient" in printed and "uniform *" in printed
