"""The CI gate against tampered receipts: each edit of receipt.json (its embedded plan.json included) is
mapped to the finding that must fail it, and the unedited receipt (the safe twin) passes.

One small receipt on the built-in ``mlp`` is made once for the module. Most edits make the receipt
contradict itself and are refused before anything runs (NOTE [receipt consistency]); the few that
stay consistent are caught by re-measuring, and those re-measurements are shared: the stages
``check_receipt`` calls are memoised per plan for the module (``shared_runs``)."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from remat.cli.main import main
from remat.clock import percentile
from remat.errors import CheckTimeout, ReceiptError
from remat.frontier import FrontierPoint
from remat.frontier.pareto import overhead_interval
from remat.receipt import Receipt, RunSettings, write_receipt
from remat.workflow import FindingKind, GateSettings, check_receipt, make_receipt
from remat.workflow import check as check_mod
from remat.workflow.check import Deadline
from remat.workload import load_workload

from .test_receipt import _mutate

MLP = {"batch_size": 256, "width": 32, "depth": 4, "d_in": 8}
SETTINGS = RunSettings(trace_warmup=1, trace_steps=1, verify_steps=1, verify_seeds=1, verify_timing_steps=0,
                       frontier_plans=["none", "optimal"], frontier_steps=3, frontier_warmup=1,
                       capacity_key=None, capacity_tries=1, capacity_steps=1, note="tamper suite")
MiB = 2 ** 20
LOAD = "load"    # refused when the receipt is read (ReceiptError, exit 2)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """(the receipt folder, its JSON): made once (about 10 s)."""
    torch.set_num_threads(1)
    receipt = make_receipt(load_workload("mlp", MLP), budget="95%", reserve=0.05, settings=SETTINGS)
    assert receipt.decision.status == "ship" and receipt.plan.boundaries, receipt.decision.why
    files = write_receipt(receipt, tmp_path_factory.mktemp("tamper") / "out")
    return files.receipt.parent, json.loads(files.receipt.read_text())


@pytest.fixture(scope="module")
def shared_runs():
    """Memoise the measuring stages per plan: every edit that keeps the plan shares one re-run."""
    mp = pytest.MonkeyPatch()
    for name in ("verify_plan", "measure_plan", "measure_savings", "_interleaved_ms", "_trace_peak"):
        real = getattr(check_mod, name)
        cache: dict[str, Any] = {}

        def memo(*args, _real=real, _cache=cache, **kw):
            plan = next((a for a in args if hasattr(a, "boundaries")), None)   # None: the control
            wl = next((a for a in args if hasattr(a, "spec") and hasattr(a, "shape")), None)   # the shape too
            key = json.dumps([None if wl is None else wl.shape, None if plan is None else plan.to_json()],
                             sort_keys=True)
            if key not in _cache:
                _cache[key] = _real(*args, **kw)
            return _cache[key]
        mp.setattr(check_mod, name, memo)
    yield
    mp.undo()


# -- edits ---------------------------------------------------------------------------------------------

def _shipped_point(d: dict) -> dict:
    return next(p for p in d["frontier"]["points"] if p["plan"] == d["frontier"]["shipped"])


def _control_point(d: dict) -> dict:
    return next(p for p in d["frontier"]["points"] if p["plan"] == d["frontier"]["control"])


def _set(path: str, value: Any) -> Callable[[dict], None]:
    return lambda d: _mutate(d, path, value)


def _scale(path: str, factor: float) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        node: Any = d
        for k in path.split("."):
            node = node[int(k)] if isinstance(node, list) else node[k]
        _mutate(d, path, type(node)(node * factor))
    return edit


def _all(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        for e in edits:
            e(d)
    return edit


def _budget_x4_decision(d: dict) -> None:     # the edit: the decision's two figures only
    d["decision"]["budget_bytes"] *= 4
    d["decision"]["effective_budget_bytes"] *= 4


def _budget_x4_everywhere(d: dict) -> None:   # the same, with every figure that follows from it kept consistent
    _budget_x4_decision(d)
    dec, fr = d["decision"], d["frontier"]
    dec["headroom_bytes"] = dec["effective_budget_bytes"] - dec["shipped_peak_bytes"]
    dec["reserve_left"] = 1.0 - dec["shipped_peak_bytes"] / dec["budget_bytes"]
    fr["budget_bytes"], fr["effective_budget_bytes"] = dec["budget_bytes"], dec["effective_budget_bytes"]
    for p in fr["points"]:
        p["fits"] = p["peak_bytes"] is not None and p["peak_bytes"] <= dec["effective_budget_bytes"]


def _restate(d: dict) -> None:
    """Rewrite every statement that follows from the edited figures as remat would (NOTE [receipt statements]):
    each frontier point's verdict and reason, the rejected plans and decision.why; an attacker can run remat's
    code too, so a consistent edit stays consistent."""
    from remat.frontier.pareto import ship_decision
    from remat.workflow.build import shipped_why
    r = Receipt.from_json(d)
    fr = r.frontier
    again = ship_decision(fr.points, budget_bytes=fr.budget_bytes, reserve=fr.reserve, control=fr.control)
    for p, v in zip(d["frontier"]["points"], again.verdicts):
        p["reason"] = v.reason
        for rej in d["decision"]["rejected"]:
            if rej["plan"] == p["plan"]:
                rej["reason"] = v.reason
    r = Receipt.from_json(d)
    why = shipped_why(r.frontier, r.plan.plan, r.traces.target, r.verification, r.blocked, r.plan.excluded_after_verify)
    d["decision"]["why"][:len(why)] = why


def _peak_claimed(d: dict, peak: int) -> None:
    """The shipped peak edited in the decision, its arithmetic and the frontier: consistent."""
    dec = d["decision"]
    dec["shipped_peak_bytes"] = peak
    dec["headroom_bytes"] = dec["effective_budget_bytes"] - peak
    dec["reserve_left"] = 1.0 - peak / dec["budget_bytes"]
    _shipped_point(d)["peak_bytes"] = peak


def _peak_1mib_everywhere(d: dict) -> None:
    _peak_claimed(d, MiB)
    _restate(d)


def _control_fits_everywhere(d: dict) -> None:
    peak = d["decision"]["effective_budget_bytes"] - 1
    d["decision"]["control_peak_bytes"] = peak
    _control_point(d).update(peak_bytes=peak, fits=True)


def _overhead_minus_90_everywhere(d: dict) -> None:
    """The plan claimed 10x faster than the control, every copy of the timing edited to agree."""
    dec, ship = d["decision"], _shipped_point(d)
    ship["step_ms"] = [x * 0.1 for x in _control_point(d)["step_ms"]]
    ship["p50_ms"] = percentile(ship["step_ms"], 50.0)
    dec["shipped_p50_ms"] = ship["p50_ms"]
    dec["overhead_pct"] = ship["overhead_pct"] = (ship["p50_ms"] - dec["control_p50_ms"]) / dec["control_p50_ms"] * 100
    # the interval too, as remat would compute it from the edited samples (NOTE [overhead intervals])
    control = FrontierPoint.from_json(_control_point(d))
    oi = overhead_interval(FrontierPoint.from_json(ship), control).to_json()
    dec["overhead_interval"] = ship["overhead_interval"] = oi
    _restate(d)


def _saving_x3(d: dict) -> None:
    b = d["plan"]["boundaries"][0]
    b["measured_saving_bytes"] *= 3


def _saving_x3_tolerance_1(d: dict) -> None:
    _saving_x3(d)
    d["settings"]["saving_tolerance"] = 1.0
    for b in d["plan"]["boundaries"]:
        b["saving_tolerance"] = 1.0


def _other_mode(mode: str) -> str:
    """A mode the boundary does not have: the planner picks full or selective from measured replay prices, so
    a fixed "selective" was no edit at all whenever it had picked selective (a false pass seen under load)."""
    return "full" if mode == "selective" else "selective"


def _mode_in_plan(d: dict) -> None:
    b = d["plan"]["plan"]["boundaries"][0]
    b["mode"] = _other_mode(b["mode"])


def _mode_in_record(d: dict) -> None:
    b = d["plan"]["boundaries"][0]
    b["mode"] = _other_mode(b["mode"])


def _fixture_100x1000(d: dict) -> None:
    """The issue's hours-long receipt: 100 seeds x 1000 steps, settings, fixtures and report all agreeing."""
    d["settings"].update(verify_seeds=100, verify_steps=1000)
    for b in d["plan"]["boundaries"]:
        b["fixture"].update(seeds=list(range(100)), steps=1000)
    d["verification"].update(seeds=list(range(100)), steps=1000)


def _workload_gpt(d: dict) -> None:
    d["context"]["workload"] = "gpt"
    d["traces"]["target"]["context"]["workload"] = "gpt"


def _drop_plan_boundary(d: dict) -> None:
    d["plan"]["plan"]["boundaries"] = []


def _interval_resolved_in_the_decision(d: dict) -> None:
    """A noisy overhead claimed resolved (or the reverse) in the decision only."""
    oi = d["decision"]["overhead_interval"]
    oi["resolved"] = not oi["resolved"]


def _interval_narrowed_everywhere(d: dict) -> None:
    """The decision and the shipped point agree on an interval the samples do not give."""
    for oi in (d["decision"]["overhead_interval"], _shipped_point(d)["overhead_interval"]):
        oi.update(low_pct=oi["pct"] - 0.01, high_pct=oi["pct"] + 0.01, resolved=True)


# (id, edit, the finding kind that must fail it, or LOAD)
TAMPERS: list[tuple[str, Callable[[dict], None], FindingKind | str]] = [
    # the budget arithmetic
    ("budget-x4-in-the-decision", _budget_x4_decision, FindingKind.BUDGET),
    ("budget-x4-everywhere", _budget_x4_everywhere, FindingKind.CLAIMS),
    ("effective-budget-raised", _scale("decision.effective_budget_bytes", 1.5), FindingKind.BUDGET),
    ("reserve-zeroed", _set("decision.reserve", 0.0), FindingKind.BUDGET),
    ("headroom-raised", _scale("decision.headroom_bytes", 10), FindingKind.BUDGET),
    ("reserve-left-raised", _set("decision.reserve_left", 0.9), FindingKind.BUDGET),
    ("clears-false-but-ships", _set("decision.clears", False), FindingKind.BUDGET),
    ("frontier-budget-x4", _scale("frontier.budget_bytes", 4), FindingKind.BUDGET),
    # plan.json (embedded) vs the boundary records, the decision and the frontier
    ("plan-mode-selective", _mode_in_plan, FindingKind.RECORDS),
    ("record-mode-selective", _mode_in_record, FindingKind.RECORDS),
    ("plan-guarded", _set("plan.plan.boundaries.0.guarded", True), FindingKind.RECORDS),
    ("plan-predicted-saving-x3", _scale("plan.plan.boundaries.0.saved_bytes", 3), FindingKind.RECORDS),
    ("decision-boundaries", lambda d: d["decision"]["boundaries"].append("head:full"), FindingKind.RECORDS),
    ("plan-label", _set("plan.label", "all"), FindingKind.RECORDS),
    ("plan-rng-policy-off", _set("plan.plan.preserve_rng_state", False), FindingKind.RECORDS),
    ("frontier-point-boundaries", lambda d: _shipped_point(d)["boundaries"].append("head:full"), FindingKind.RECORDS),
    ("plan-drops-its-boundary", _drop_plan_boundary, LOAD),
    # fixture sizes
    ("fixture-100-seeds-x-1000-steps", _fixture_100x1000, FindingKind.FIXTURE),
    ("fixture-steps-only", _set("plan.boundaries.0.fixture.steps", 1000), FindingKind.FIXTURE),
    ("fixture-other-seed", _set("plan.boundaries.0.fixture.seeds", [7]), FindingKind.FIXTURE),
    ("fixture-dtype", _set("plan.boundaries.0.fixture.dtype", "bfloat16"), FindingKind.FIXTURE),
    ("settings-seeds-only", _set("settings.verify_seeds", 2), FindingKind.FIXTURE),
    ("frontier-steps-1000", _set("settings.frontier_steps", 1000), FindingKind.FIXTURE),
    ("saving-warmup-100", _set("settings.saving_warmup", 100), FindingKind.FIXTURE),
    # claimed figures that contradict each other
    ("shipped-peak-1mib-in-the-decision", _set("decision.shipped_peak_bytes", MiB), FindingKind.CLAIMS),
    ("control-peak-lowered", _scale("decision.control_peak_bytes", 0.5), FindingKind.CLAIMS),
    ("overhead-to-1pct", _set("decision.overhead_pct", 1.0), FindingKind.CLAIMS),
    ("shipped-p50-lowered", _scale("decision.shipped_p50_ms", 0.5), FindingKind.CLAIMS),
    ("overhead-interval-flipped-in-the-decision", _interval_resolved_in_the_decision, FindingKind.CLAIMS),
    ("overhead-interval-narrowed-everywhere", _interval_narrowed_everywhere, FindingKind.CLAIMS),
    ("point-p50-not-its-samples", lambda d: _shipped_point(d).update(p50_ms=_shipped_point(d)["p50_ms"] * 0.5),
     FindingKind.CLAIMS),
    ("control-point-fits", lambda d: _control_point(d).update(fits=True), FindingKind.CLAIMS),
    ("control-fits-everywhere", _control_fits_everywhere, FindingKind.CLAIMS),
    ("verified-false-but-ships", _set("decision.verified", False), FindingKind.CLAIMS),
    ("verification-failed", _set("verification.passed", False), FindingKind.CLAIMS),
    ("record-tolerance-1", _set("plan.boundaries.0.saving_tolerance", 1.0), FindingKind.CLAIMS),
    # consistent edits: only re-measuring catches them
    ("peak-1mib-everywhere", _peak_1mib_everywhere, FindingKind.PEAK_CLAIM),
    ("saving-x3", _saving_x3, FindingKind.SAVING),
    ("saving-x3-tolerance-1", _saving_x3_tolerance_1, FindingKind.SAVING),
    ("overhead-minus-90-everywhere", _overhead_minus_90_everywhere, FindingKind.TIME),
    # what the receipt names and decides
    ("workload-gpt", _workload_gpt, FindingKind.WORKLOAD),
    ("ships-nothing", _set("decision.status", "no-plan"), FindingKind.DECISION),
]
CONSISTENCY = {FindingKind.BUDGET, FindingKind.RECORDS, FindingKind.FIXTURE, FindingKind.CLAIMS}


def test_the_suite_covers_every_gate_check():
    assert len(TAMPERS) >= 30 and len({t[0] for t in TAMPERS}) == len(TAMPERS)
    assert CONSISTENCY | {FindingKind.PEAK_CLAIM, FindingKind.SAVING, FindingKind.TIME} <= {t[2] for t in TAMPERS}


def _check(data: dict, cwd: Path, **kw):
    return check_receipt(Receipt.from_json(data), workload="mlp", cwd=cwd, **kw)


def test_the_unedited_receipt_passes_a_full_check(made, shared_runs, tmp_path):
    _, data = made
    report = _check(data, tmp_path)
    assert report.passed, report.failures
    text = " ".join(report.checked)
    assert "agrees with itself" in text and "within 5% of the claimed" in text and "overhead" in text
    assert "budget" in text and "from the receipt (consistent" in text


@pytest.mark.parametrize("name,edit,kind", TAMPERS, ids=[t[0] for t in TAMPERS])
def test_a_tampered_receipt_fails_the_check_it_must(made, shared_runs, tmp_path, name, edit, kind):
    _, data = made
    d = copy.deepcopy(data)
    edit(d)
    if kind == LOAD:
        with pytest.raises(ReceiptError):
            Receipt.from_json(d)
        return
    report = _check(d, tmp_path)
    assert not report.passed, f"{name}: a false pass"
    assert kind in {f.kind for f in report.failures}, report.failures
    if kind in CONSISTENCY:   # refused before anything ran
        assert any("nothing re-run" in s for s in report.skipped), report.skipped


# -- thresholds from the repository --------------------------------------------------------------------

def test_the_repos_budget_wins_over_the_receipts(made, shared_runs, tmp_path):
    """A model change that raised the peak: the receipt's own budget no longer matters, the repo's does."""
    _, data = made
    (tmp_path / "pyproject.toml").write_text('[tool.remat]\nworkload = "mlp"\nbudget = "1MiB"\nreserve = "0%"\n')
    report = check_receipt(Receipt.from_json(data), cwd=tmp_path)
    assert [f.kind for f in report.failures] == [FindingKind.PEAK]
    assert "budget 1.00 MiB from pyproject.toml [tool.remat]" in " ".join(report.checked)
    # the flag wins over pyproject.toml
    report = check_receipt(Receipt.from_json(data), cwd=tmp_path, gate=GateSettings(budget=data["decision"]["budget_bytes"]))
    assert report.passed, report.failures
    assert "from command line" in " ".join(report.checked)


def test_a_percentage_budget_in_the_repo_is_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.remat]\nbudget = "80%"\n')
    from remat.errors import WorkloadError
    from remat.workflow.gate import project_gate
    with pytest.raises(WorkloadError, match="must be bytes"):
        project_gate(tmp_path)


def test_a_looser_receipt_tolerance_is_not_used(made):
    from remat.workflow.gate import Source, resolve_thresholds
    _, data = made
    d = copy.deepcopy(data)
    _saving_x3_tolerance_1(d)
    t = resolve_thresholds(Receipt.from_json(d), GateSettings(), GateSettings())
    assert t.saving_tolerance.value == 0.10 and t.saving_tolerance.source is Source.DEFAULT


# -- the CLI: reports, time limit ----------------------------------------------------------------------

@pytest.fixture
def folder(made, tmp_path, monkeypatch) -> Path:
    root, _ = made
    shutil.copytree(root, tmp_path / "out")
    (tmp_path / "pyproject.toml").write_text('[tool.remat]\nworkload = "mlp"\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path / "out"


@pytest.mark.parametrize("report", ["report.html", "report.md"])
def test_a_missing_report_fails_unless_no_reports(folder, capsys, report):
    (folder / report).unlink()
    assert main(["check", "out/receipt.json", "--quick"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"FAIL report: {report}: none beside the receipt" in out
    assert main(["check", "out/receipt.json", "--quick", "--no-reports"]) == 0


def test_check_says_how_many_fixture_steps_run_and_keeps_its_time_limit(folder, capsys, monkeypatch):
    # fixtures estimated at an hour: refused up front, well before the hard limit (5 s) could fire
    monkeypatch.setattr(check_mod.FixturePlan, "estimate_s", property(lambda self: 3600.0))
    assert main(["check", "out/receipt.json", "--quick", "--timeout", "5"]) == 4
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(r"check: \d+ fixture steps will run \(equivalence \d+", err)
    assert "limit" in err and "nothing was run" in err


# A hanging factory or batch() (one that ignores SIGALRM, or swallows exceptions in a retry loop) and one
# that exits the process: remat check runs the workload in a child process and keeps --timeout from outside
# it (NOTE [workload in a child process]); tests/test_check_child.py, on a file workload (a monkeypatch here
# would not reach the child).


def test_the_deadline_stops_a_running_stage():
    deadline = Deadline(0.0)
    guarded = deadline.guard(lambda *a: None)
    with pytest.raises(CheckTimeout) as exc:
        guarded("verify", 1, 10)
    assert exc.value.exit_code == 4 and "at verify" in exc.value.message
    Deadline(None).guard(lambda *a: None)("verify", 1, 10)   # no limit: never raises


def test_the_overhead_fails_only_when_resolved_past_the_claim_and_its_tolerance():
    from remat.workflow.check import _time_verdict
    control = [10.0 + 0.01 * i for i in range(8)]
    slower = [1.3 * c for c in control]           # +30%, every round
    fails, said = _time_verdict(control, slower, claimed=1.0, allowance=10.0)
    assert fails and "resolved slower than the claim" in said
    assert not _time_verdict(control, slower, claimed=29.0, allowance=10.0)[0]
    noisy = [c * (1.0 if i % 2 else 2.0) for i, c in enumerate(control)]   # half the rounds +100%, half +0%
    fails, said = _time_verdict(control, noisy, claimed=1.0, allowance=10.0)
    assert not fails and "within the noise" in said
