"""More tampered receipts (issue 41): the repository's pins, the control re-measured, the receipt's statements
regenerated, the reports and printed strings, each edit mapped to the finding that must fail it.

Reuses the one receipt ``tests/test_check_tamper.py`` makes and its shared re-runs (nothing here makes
another). A few claims no receipt data can confirm (the git revision, the command, the planner's exclusions)
cannot fail: their edits must be named on the check's "unchecked" line instead (``UNCHECKED`` below), never
passed silently. Kinds are written as strings so the edits can be replayed against an older check."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from remat.cli.main import main
from remat.receipt import Receipt, write_receipt
from remat.workflow import FindingKind, GateSettings, ReportStamps, check_receipt
from remat.receipt.model import load_receipt_with_digest

from .test_check_tamper import _control_point, _restate, _set, _shipped_point, made, shared_runs  # noqa: F401
from .test_gate_reports import _at_world_size, _evidence, no_launch  # noqa: F401

LOAD = "load"            # refused when the receipt is read (ReceiptError, exit 2)
UNCHECKED = "unchecked"  # cannot be re-derived: named on the check's unchecked line
MLP_PROJECT = '[tool.remat]\nworkload = "mlp"\n'


# -- edits ---------------------------------------------------------------------------------------------

def _control_peak_x2(d: dict) -> None:
    """The issue's edit: the unplanned peak doubled everywhere, every statement restated to agree."""
    peak = d["decision"]["control_peak_bytes"] * 2
    d["decision"]["control_peak_bytes"] = peak
    _control_point(d)["peak_bytes"] = peak
    for r in d["decision"]["rejected"]:
        if r["plan"] == d["frontier"]["control"]:
            r["peak_bytes"] = peak
    _restate(d)


def _control_peak_x0_9(d: dict) -> None:
    """Lowered by 10%, still over the budget: consistent, and the re-measure must see it."""
    dec = d["decision"]
    peak = max(int(dec["control_peak_bytes"] * 0.9), dec["effective_budget_bytes"] + 1)
    dec["control_peak_bytes"] = peak
    _control_point(d)["peak_bytes"] = peak
    for r in dec["rejected"]:
        if r["plan"] == d["frontier"]["control"]:
            r["peak_bytes"] = peak
    _restate(d)


def _trace_peak_x2_everywhere(d: dict) -> None:
    t = d["traces"]["target"]
    extra = t["peak_bytes"]
    t["peak_bytes"] += extra
    t["step_peaks"] = [p + extra for p in t["step_peaks"]]
    t["categories_at_peak"]["activations"] += extra


def _trace_categories_cut(d: dict) -> None:
    d["traces"]["target"]["categories_at_peak"]["activations"] //= 2


def _torch_everywhere(version: str) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d["context"]["torch_version"] = version
        for t in d["traces"].values():
            if t is not None:
                t["context"]["torch_version"] = version
        d["frontier"]["context"]["torch_version"] = version
    return edit


def _why(i: int, text: str) -> Callable[[dict], None]:
    return lambda d: d["decision"]["why"].__setitem__(i, text)


def _rejected_reason(text: str, *, frontier_too: bool) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        r = d["decision"]["rejected"][0]
        r["reason"] = text
        if frontier_too:
            next(p for p in d["frontier"]["points"] if p["plan"] == r["plan"])["reason"] = text
    return edit


def _unsupported(edit: Callable[[list], Any]) -> Callable[[dict], None]:
    return lambda d: edit(d["unsupported"])


def _unsupported_reworded(items: list) -> None:
    items[0]["detail"] = "covered: every figure holds compiled too"


def _rng(field: str, value: Any) -> Callable[[dict], None]:
    return lambda d: d["verification"]["rng_policy"].__setitem__(field, value)


def _excluded_emptied_everywhere(d: dict) -> None:
    d["plan"]["plan"]["excluded"] = []
    d["frontier"]["shipped_plan"]["excluded"] = []


def _batch_halved_with_claims(d: dict) -> None:
    """The issue's edit: batch halved and the savings claims with it (the shape, consistent)."""
    for where in (d["context"]["shape"], d["context"]["resolved_shape"], d["verification"]["shape"],
                  *(t["context"]["shape"] for t in d["traces"].values() if t is not None),
                  d["frontier"]["context"]["shape"]):
        where["batch_size"] //= 2
    for b in d["plan"]["boundaries"]:
        b["measured_saving_bytes"] //= 2
    for u in d["unsupported"]:   # "measured and verified at batch_size=256 only", restated
        u["detail"] = u["detail"].replace("batch_size=256", "batch_size=128")


def _dtype_everywhere(dtype: str) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        d["context"]["dtype"] = dtype
        for b in d["plan"]["boundaries"]:
            b["fixture"]["dtype"] = dtype
            b["fixture"]["tolerance"] = dict(d["verification"]["tolerances"][dtype])
        d["verification"]["dtype"] = dtype
    return edit


def _autocast_everywhere(d: dict) -> None:
    d["context"]["autocast"] = "bfloat16"
    d["verification"]["autocast"] = "bfloat16"


def _seeds_2_consistent(d: dict) -> None:
    d["settings"]["verify_seeds"] = 2
    for b in d["plan"]["boundaries"]:
        b["fixture"]["seeds"] = [0, 1]
    d["verification"]["seeds"] = [0, 1]


INJECT = "ok\n::error file=x::fake\x1b[32m receipt holds\r\x07"

# (id, edit, [tool.remat] lines besides the workload (pins), the kind that must fail it)
TAMPERS: list[tuple[str, Callable[[dict], None], str, str]] = [
    # 1. pins: the repository owns what is re-measured (refused before anything runs)
    ("batch-halved-outside-the-shape-pin", _batch_halved_with_claims, "shape = {batch_size = 256}", "pin"),
    ("batch-doubled-outside-the-shape-pin", _set("context.resolved_shape.batch_size", 512),
     "shape = {batch_size = 256}", "pin"),
    ("width-outside-the-shape-pin", _set("context.resolved_shape.width", 16), "shape = {batch_size = 256, width = 32}",
     "pin"),
    ("shape-keyword-type-bool", _set("context.resolved_shape.depth", True), "shape = {depth = 4}", "pin"),
    ("shape-keyword-missing", lambda d: d["context"]["resolved_shape"].pop("d_in"), "shape = {d_in = 8}", "pin"),
    ("dtype-outside-the-pin", _dtype_everywhere("bfloat16"), 'dtype = "float32"', "pin"),
    ("dtype-pin-alias", _dtype_everywhere("float16"), 'dtype = "fp32"', "pin"),
    ("autocast-outside-the-none-pin", _autocast_everywhere, 'autocast = "none"', "pin"),
    ("no-autocast-outside-the-bf16-pin", lambda d: None, 'autocast = "bf16"', "pin"),
    ("single-process-outside-the-world-size-pin", lambda d: None, "world-size = 2", "pin"),
    ("world-size-2-outside-the-world-size-pin-4", lambda d: d.__setitem__("world_size", _evidence(d, 2)),
     "world-size = 4", "pin"),
    ("world-size-4096-past-the-cores", lambda d: d.__setitem__("world_size", _evidence(d, 4096)), "", "fixture"),
    ("world-size-4096-repo-allows-8192-capped-by-cores",
     lambda d: d.__setitem__("world_size", _evidence(d, 4096)), "max-world-size = 8192", "fixture"),
    ("seeds-2-past-the-repos-max-seeds-1", _seeds_2_consistent, "max-seeds = 1", "fixture"),
    ("batch-halved-without-a-pin", _batch_halved_with_claims, "", "control"),
    # 2a. the control re-measured (consistent edits)
    ("control-peak-x2-everywhere", _control_peak_x2, "", "control"),
    ("control-peak-minus-10pct-everywhere", _control_peak_x0_9, "", "control"),
    ("control-held-bytes-x2", lambda d: d["plan"].__setitem__("control_held_bytes", d["plan"]["control_held_bytes"] * 2),
     "", "control"),
    ("control-held-bytes-halved", lambda d: d["plan"].__setitem__("control_held_bytes",
                                                                  d["plan"]["control_held_bytes"] // 2), "", "control"),
    ("trace-peak-x2-everywhere", _trace_peak_x2_everywhere, "", "control"),
    ("torch-version-everywhere", _torch_everywhere("2.12.0+cu128"), "", "environment"),
    # 2b. statements regenerated from the receipt's own data
    ("trace-peak-only", lambda d: d["traces"]["target"].__setitem__("peak_bytes", d["traces"]["target"]["peak_bytes"] * 2),
     "", "statements"),
    ("trace-categories-cut", _trace_categories_cut, "", "statements"),
    ("torch-version-context-only", _set("context.torch_version", "2.12.0"), "", "statements"),
    ("why-0-rewritten", _why(0, "Ship optimal: checkpoint nothing risky. Audited by the maintainers."), "", "statements"),
    ("why-1-rewritten", _why(1, "Without checkpointing the step does not fit any GPU."), "", "statements"),
    ("why-emptied", _set("decision.why", []), "", "statements"),
    ("why-injected", _why(0, INJECT), "", "statements"),
    ("rejected-reason-in-the-decision", _rejected_reason("dominated by optimal", frontier_too=False), "", "statements"),
    ("rejected-reason-everywhere", _rejected_reason("dominated by optimal", frontier_too=True), "", "statements"),
    ("rejected-reason-injected", _rejected_reason(INJECT, frontier_too=True), "", "statements"),
    ("shipped-reason-rewritten", lambda d: _shipped_point(d).__setitem__("reason", "fastest and smallest"), "",
     "statements"),
    ("unsupported-emptied", _set("unsupported", []), "", "statements"),
    ("unsupported-first-dropped", _unsupported(lambda u: u.pop(0)), "", "statements"),
    ("unsupported-reworded", _unsupported(_unsupported_reworded), "", "statements"),
    ("unsupported-status-flipped", _unsupported(lambda u: u[1].__setitem__("status", "not run")), "", "statements"),
    ("rng-justification-rewritten", _rng("justification", "dropout masks are regenerated identically"), "",
     "statements"),
    ("rng-policy-off", _rng("policy", "off"), "", "statements"),
    ("rng-drawers-added", _rng("boundaries_drawing_rng", ["blocks.1"]), "", "statements"),
    ("memory-source-cuda-in-the-context", _set("context.memory_source", "cuda-allocator"), "", "statements"),
    ("memory-source-cpu-allocator-in-the-context", _set("context.memory_source", "cpu-allocator"), "", "statements"),
    ("memory-source-trace-cuda", _set("traces.target.memory_source", "cuda-allocator"), "", "statements"),
    ("memory-source-control-point-cuda", lambda d: _control_point(d).__setitem__("memory_source", "cuda-allocator"), "",
     "statements"),
    ("memory-source-false", _set("context.memory_source", False), "", LOAD),
    ("class-name-injected", _set("plan.boundaries.0.class_name", "ResidualMLPBlock" + INJECT), "", "model"),
    ("class-name-another-class", _set("plan.boundaries.0.class_name", "Linear"), "", "model"),
    # 2c. what no receipt data confirms: said, never passed silently
    ("git-revision-fabricated", _set("context.git_revision", "0" * 40), "", UNCHECKED),
    ("command-fabricated", _set("context.command", "remat receipt mlp --budget 1GiB"), "", UNCHECKED),
    ("created-backdated", _set("context.created", "2020-01-01T00:00:00+00:00"), "", UNCHECKED),
    ("excluded-emptied-everywhere", _excluded_emptied_everywhere, "", UNCHECKED),
    ("excluded-emptied-in-the-plan-only", _set("plan.plan.excluded", []), "", "records"),
]


def _check(d: dict, cwd: Path, project: str, **kw):
    (cwd / "pyproject.toml").write_text(MLP_PROJECT + project + "\n")
    return check_receipt(Receipt.from_json(d), cwd=cwd, **kw)


def test_the_suite_covers_every_class():
    assert len(TAMPERS) >= 40 and len({t[0] for t in TAMPERS}) == len(TAMPERS)
    kinds = {t[3] for t in TAMPERS}
    assert {"pin", "control", "statements", "environment", "fixture", UNCHECKED} <= kinds


def test_the_unedited_receipt_passes_under_every_pin(made, shared_runs, tmp_path):  # noqa: F811
    """The safe twin: the same receipt within every pin passes the full check, and says what it left unchecked."""
    _, data = made
    pins = 'shape = {batch_size = 256, width = 32, depth = 4, d_in = 8}\ndtype = "fp32"\nautocast = "none"\n' \
           "world-size = 1\nmax-seeds = 1"
    report = _check(copy.deepcopy(data), tmp_path, pins)
    assert report.passed, report.failures
    text = " ".join(report.checked)
    assert "within the pins of pyproject.toml [tool.remat]: shape batch_size=256" in text
    assert "the control re-measured within 5% of its claims" in text and "control_held_bytes" in text
    assert "traces.target.peak_bytes" in text and "decision.control_peak_bytes" in text
    assert any(s.startswith("unchecked: git_revision") for s in report.skipped)


@pytest.mark.parametrize("name,edit,project,kind", TAMPERS, ids=[t[0] for t in TAMPERS])
def test_a_tampered_receipt_fails_the_check_it_must(made, shared_runs, no_launch, tmp_path, name, edit, project,  # noqa: F811
                                                     kind):
    from remat.errors import ReceiptError
    _, data = made
    d = copy.deepcopy(data)
    edit(d)
    if kind == LOAD:
        with pytest.raises(ReceiptError):
            Receipt.from_json(d)
        return
    report = _check(d, tmp_path, project)
    if kind == UNCHECKED:   # no data re-derives it: the check must say it did not check it
        assert report.passed, report.failures
        assert any(s.startswith("unchecked: ") for s in report.skipped), report.skipped
        return
    assert not report.passed, f"{name}: a false pass"
    assert FindingKind(kind) in {f.kind for f in report.failures}, report.failures
    if kind in ("pin", "statements", "fixture", "records"):   # refused before anything ran
        assert any("nothing re-run" in s for s in report.skipped), report.skipped


def test_the_unchecked_line_names_each_unchecked_claim(made, shared_runs, tmp_path):  # noqa: F811
    _, data = made
    skipped = " ".join(_check(copy.deepcopy(data), tmp_path, "", quick=True).skipped)
    for claim in ("git_revision", "command", "created", "plan.excluded"):
        assert claim in skipped, claim


def test_a_receipt_outside_a_pin_runs_nothing(made, tmp_path, monkeypatch):  # noqa: F811
    """Refused before the workload loads: a pin finding needs no run."""
    from remat.workflow import check as check_mod
    monkeypatch.setattr(check_mod, "_load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    _, data = made
    d = copy.deepcopy(data)
    _batch_halved_with_claims(d)
    report = _check(d, tmp_path, "shape = {batch_size = 256}")
    assert [f.kind for f in report.failures] == [FindingKind.PIN]
    assert "shape keyword batch_size is 128 in the receipt; the repository pins 256 (pyproject.toml [tool.remat])" \
        in report.failures[0].message


@pytest.mark.parametrize("bad,match", [('shape = "batch_size=32"', "must be a table"), ('dtype = "int8"', "dtype"),
                                       ('autocast = "fp8"', "autocast"), ("world-size = 0", "world-size"),
                                       ("shape = {batch_size = [1]}", "keyword")])
def test_bad_pins_are_refused_naming_the_key(tmp_path, bad, match):
    from remat.errors import WorkloadError
    from remat.workflow.gate import project_pins
    (tmp_path / "pyproject.toml").write_text(f"[tool.remat]\n{bad}\n")
    with pytest.raises(WorkloadError, match=match):
        project_pins(tmp_path)


def test_max_world_size_from_the_repo_is_capped_by_the_cores_but_not_the_flag():
    import os

    from remat.workflow.gate import max_world_size
    cores = os.cpu_count() or 1
    most, source = max_world_size(GateSettings(), GateSettings(max_world_size=cores + 100))
    assert most == cores and "capped by this machine's" in source
    assert max_world_size(GateSettings(max_world_size=cores + 100), GateSettings())[0] == cores + 100
    assert max_world_size(GateSettings(), GateSettings(max_world_size=1)) == (1, "pyproject.toml [tool.remat]")


# -- the CLI: --autocast none, reports, printed strings -------------------------------------------------

@pytest.fixture
def folder(made, tmp_path, monkeypatch) -> Path:  # noqa: F811
    root, _ = made
    shutil.copytree(root, tmp_path / "out")
    (tmp_path / "pyproject.toml").write_text(MLP_PROJECT)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "out"


def test_autocast_none_on_the_cli_pins_a_plain_receipt(folder, shared_runs, capsys):  # noqa: F811
    assert main(["check", "out/receipt.json", "--quick", "--autocast", "none"]) == 0
    assert main(["check", "out/receipt.json", "--quick", "--autocast", "bf16"]) == 2
    assert "without autocast" in " ".join(capsys.readouterr().err.split())


REPORT_EDITS = [
    ("md-why-rewritten", "report.md", lambda t: t.replace("Ship optimal", "Ship optimal (audited)", 1)),
    ("md-beacon", "report.md", lambda t: t.replace("\n", "\n![b](https://evil.example/p.png)\n", 1)),
    ("html-script", "report.html", lambda t: t.replace("</body>", "<script>alert(1)</script></body>", 1)),
    ("html-onload", "report.html", lambda t: t.replace("<body", "<body onload=\"alert(1)\"", 1)),
]


@pytest.mark.parametrize("name,file,edit", REPORT_EDITS, ids=[t[0] for t in REPORT_EDITS])
def test_an_edited_report_fails(folder, shared_runs, tmp_path, name, file, edit):  # noqa: F811
    path = folder / file
    text = path.read_text()
    path.write_text(edit(text))
    assert path.read_text() != text
    receipt, digest = load_receipt_with_digest(folder / "receipt.json")
    report = check_receipt(receipt, quick=True, cwd=tmp_path, reports=ReportStamps(folder=folder, receipt=receipt,
                                                                                    digest=digest))
    assert FindingKind.REPORT in {f.kind for f in report.failures}, report.failures


def test_an_injected_statement_prints_as_one_inert_line(made, folder, capsys):  # noqa: F811
    _, data = made
    d = copy.deepcopy(data)
    _why(0, INJECT)(d)
    write_receipt(Receipt.from_json(d), folder.parent / "bad")
    assert main(["check", "bad/receipt.json", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "statements" in out
    assert "\x1b[32m" not in out and "\x07" not in out and "\r" not in out
    assert not any(line.lstrip().startswith("::") for line in out.splitlines())
    assert not any(line.strip().startswith("ok") and "receipt holds" in line for line in out.splitlines())


def test_the_edits_are_json(made):  # noqa: F811
    """Every edit leaves plain JSON (what a pull request can commit)."""
    _, data = made
    for _, edit, _, _ in TAMPERS:
        d = copy.deepcopy(data)
        edit(d)
        json.dumps(d)
