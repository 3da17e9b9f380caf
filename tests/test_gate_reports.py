"""The gate against what a pull request can bend besides the receipt's figures: the reports beside it
(NOTE [reports checked against the receipt] in remat/workflow/check.py), Markdown in them (NOTE
[markdown escaping] in remat/receipt/render.py), what the CLI prints (NOTE [printed receipt strings] in
remat/cli/render.py) and the world size it launches (NOTE [gate thresholds] in remat/workflow/gate.py).

Every case edits the one real receipt ``tests/test_check_tamper.py`` makes (its module fixture, reused:
nothing here makes another), and each edit is mapped to the finding that must fail it; the unedited
receipt (the safe twin) passes."""

from __future__ import annotations

import base64
import copy
import io
import os
import re
import shutil
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Callable

import pytest

from rich.console import Console

from remat.cli.main import main
from remat.cli.render import untrusted
from remat.distributed.config import Engine
from remat.receipt.model import load_receipt_with_digest
from remat.distributed.report import DistributedReport, Equivalence, RankFigures, SideReport
from remat.receipt import Receipt, render_html, render_markdown, write_receipt
from remat.receipt.world_size import WorldSizeEvidence
from remat.types import MemorySource
from remat.workflow import FindingKind, GateSettings, ReportStamps, check_receipt, fixture_plan, report_findings
from remat.workflow import world_size as world_size_mod

from .test_check_tamper import made, shared_runs  # noqa: F401 - the one receipt, and its shared re-runs

REPORTS = ("report.html", "report.md")


@pytest.fixture
def folder(made, tmp_path, monkeypatch) -> Path:  # noqa: F811
    """A copy of the receipt folder, with a pyproject.toml naming the workload, as the current directory."""
    root, _ = made
    shutil.copytree(root, tmp_path / "out")
    (tmp_path / "pyproject.toml").write_text('[tool.remat]\nworkload = "mlp"\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path / "out"


def _stamps(folder: Path) -> ReportStamps:
    receipt, digest = load_receipt_with_digest(folder / "receipt.json")
    return ReportStamps(folder=folder, receipt=receipt, digest=digest)


# -- A. the reports, rendered again and compared -------------------------------------------------------

def _sub(pattern: str, repl: str, count: int = 1) -> Callable[[str], str]:
    def edit(text: str) -> str:
        out, n = re.subn(pattern, repl, text, count=count)
        assert n, f"{pattern!r} not in the report"
        return out
    return edit


_A_PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n another plot").decode("ascii")

# (id, file, edit of its text): each must fail with a REPORT finding naming the file
REPORT_EDITS: list[tuple[str, str, Callable[[str], str]]] = [
    ("md-figures-rewritten", "report.md", _sub(r"\d+\.\d+ MiB", "0.01 MiB", count=0)),
    ("md-headline-rewritten", "report.md", _sub(r"\*\*SHIP [^*]*\*\*", "**SHIP all: checkpointing saves 90%**")),
    ("md-image-beacon-added", "report.md", _sub(r"\n### Boundaries", "\n![t](https://evil.example/b.png)\n### Boundaries")),
    ("md-link-added", "report.md", _sub(r"\n### Hazards", "\n[click](javascript:alert(1))\n### Hazards")),
    ("md-body-cut-stamp-kept", "report.md", lambda t: t[:40] + t[t.index("<sub>receipt.json sha256"):]),
    ("md-trailing-line", "report.md", lambda t: t + "All figures verified by the maintainers.\n"),
    ("html-script-injected", "report.html", _sub(r"</body>", "<script>fetch('https://evil.example')</script></body>")),
    ("html-onload-on-img", "report.html", _sub(r"<img alt=", "<img onload=\"alert(1)\" alt=")),
    ("html-figure-rewritten", "report.html", _sub(r"\d+\.\d+ MiB", "0.01 MiB", count=0)),
    ("html-img-from-the-network", "report.html", _sub(r"data:image/png;base64,[A-Za-z0-9+/=]*",
                                                      "https://evil.example/plot.png")),
    ("html-extra-img", "report.html", _sub(r"</body>", f'<img src="data:image/png;base64,{_A_PNG}"></body>')),
    ("html-verdict-rewritten", "report.html", _sub(r"NOTHING SHIPS|SHIP [^<]*", "SHIP everything, verified")),
]


def test_the_unedited_reports_are_the_ones_rendered_from_the_receipt(folder):
    failures, checked, skipped = report_findings(_stamps(folder))
    assert failures == [] and skipped == [], (failures, skipped)
    assert [c.split(" is the report")[0] for c in checked] == list(REPORTS)


def test_rendering_is_deterministic_plots_included(made):
    """The same receipt renders the same bytes, its PNGs too (NOTE [reports checked against the receipt])."""
    _, data = made
    receipt = Receipt.from_json(data)
    assert render_html(receipt) == render_html(Receipt.from_json(copy.deepcopy(data)))
    assert render_markdown(receipt) == render_markdown(data)


@pytest.mark.parametrize("name,report,edit", REPORT_EDITS, ids=[t[0] for t in REPORT_EDITS])
def test_an_edited_report_fails_with_a_report_finding_naming_it(folder, name, report, edit):
    path = folder / report
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")
    failures, checked, _ = report_findings(_stamps(folder))
    assert [f.kind for f in failures] == [FindingKind.REPORT], f"{name}: a false pass"
    assert failures[0].message.startswith(f"{report} is not the report rendered from receipt.json"), failures
    other = next(r for r in REPORTS if r != report)
    assert any(c.startswith(f"{other} is the report") for c in checked)


def test_a_report_of_another_receipt_names_the_stamp(folder):
    path = folder / "report.md"
    text = path.read_text()
    path.write_text(re.sub(r"sha256 [0-9a-f]{64}", "sha256 " + "0" * 64, text))
    failures, _, _ = report_findings(_stamps(folder))
    assert [f.kind for f in failures] == [FindingKind.REPORT] and "names receipt sha256 000000000000" in failures[0].message


def test_another_plot_is_masked_and_said(folder):
    """The documented limit: PNG bytes change with matplotlib's version, so a plot is compared masked."""
    path = folder / "report.html"
    path.write_text(re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]*", f"data:image/png;base64,{_A_PNG}",
                           path.read_text(), count=1))
    failures, checked, skipped = report_findings(_stamps(folder))
    assert failures == [] and len(checked) == 2
    assert skipped == ["report.html: its embedded plots are not byte for byte the ones rendered here (PNG bytes "
                       "change with matplotlib's version): compared without them"]


def test_the_cli_fails_an_injected_script_and_passes_the_safe_twin(folder, shared_runs, capsys):  # noqa: F811
    assert main(["check", "out/receipt.json", "--quick"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ok report.html is the report rendered from this receipt" in out and "receipt holds" in out
    path = folder / "report.html"
    path.write_text(path.read_text().replace("</body>", "<script>alert(1)</script></body>"))
    assert main(["check", "out/receipt.json", "--quick"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "FAIL report: report.html is not the report rendered from receipt.json" in out
    assert main(["check", "out/receipt.json", "--quick", "--no-reports"]) == 1   # present reports are still compared
    (folder / "report.html").unlink()
    (folder / "report.md").unlink()
    assert main(["check", "out/receipt.json", "--quick", "--no-reports"]) == 0


# -- B. Markdown: every receipt string is text ------------------------------------------------------

BEACON = "![t](https://evil.example/b.png)"
SCRIPT_LINK = "[c](javascript:alert(1))"
HOSTILE = (f"{BEACON} {SCRIPT_LINK} <img src=x onerror=alert(1)> <script>x</script> \" onload=\"alert(1) "
           "<https://evil.example> www.evil.example @org/team #1 **b** `c` a|b")
LINE_STARTS = f"mlp\r\n\n{BEACON}\u2028# heading\n- item\n1. item\n---\n> quote"


def _at(*path: str | int) -> Callable[[dict, str], None]:
    def edit(d: dict, text: str) -> None:
        node: Any = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = text
    return edit


def _workload(d: dict, text: str) -> None:
    d["context"]["workload"] = d["traces"]["target"]["context"]["workload"] = text


def _failure(d: dict, text: str) -> None:
    d["verification"]["failures"] = [text]


# receipt strings a pull request may write: (id, how to set it, the string)
MD_EDITS: list[tuple[str, Callable[[dict, str], None], str]] = [
    ("decision-why", _at("decision", "why", 0), HOSTILE),
    ("class-name", _at("plan", "boundaries", 0, "class_name"), HOSTILE),
    ("verification-failure", _failure, HOSTILE),
    ("unsupported-detail", _at("unsupported", 0, "detail"), HOSTILE),
    ("unsupported-mode", _at("unsupported", 0, "mode"), HOSTILE),
    ("rng-justification", _at("verification", "rng_policy", "justification"), HOSTILE),
    ("negative-control-detail", _at("verification", "negative_controls", 0, "detail"), HOSTILE),
    ("frontier-reason", _at("frontier", "points", 0, "reason"), HOSTILE),
    ("torch-version", _at("context", "torch_version"), HOSTILE),
    ("workload-line-starts", _workload, LINE_STARTS),
    ("command", _at("context", "command"), HOSTILE),
    ("created", _at("context", "created"), HOSTILE),
    ("hostname", _at("context", "hostname"), HOSTILE),
    ("settings-note", _at("settings", "note"), HOSTILE),
    ("why-line-starts", _at("decision", "why", 0), LINE_STARTS),
    ("class-name-line-starts", _at("plan", "boundaries", 0, "class_name"), LINE_STARTS),
]


def _markdown_html(text: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    return markdown_it.MarkdownIt("commonmark").enable("table").render(text)


class _Elements(HTMLParser):
    """Every element and attribute name a page has, in order: its structure."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[str, ...]]] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.append((tag, tuple(name for name, _ in attrs)))


def _edited(data: dict, edit: Callable[[dict, str], None], text: str) -> Receipt:
    d = copy.deepcopy(data)
    edit(d, text)
    return Receipt.from_json(d)


def test_the_markdown_parser_would_render_the_raw_strings_as_image_and_link():
    """The negative control: unescaped, these strings are an image and a link, and the structure test sees it."""
    assert "<img" in _markdown_html(f"x {BEACON}")
    assert _Elements(_markdown_html("x [c](https://e.example/)")).seen.count(("a", ("href",))) == 1


@pytest.mark.parametrize("name,edit,text", MD_EDITS, ids=[t[0] for t in MD_EDITS])
def test_every_receipt_string_in_report_md_is_escaped(made, name, edit, text):
    """report.md renders exactly the elements it renders with a plain string in the same place: no image,
    link, heading, list item, quote or table row of the receipt's making."""
    _, data = made
    hostile = _markdown_html(render_markdown(_edited(data, edit, text)))
    plain = _markdown_html(render_markdown(_edited(data, edit, "plain")))
    assert _Elements(hostile).seen == _Elements(plain).seen, f"{name}: markup in report.md"


@pytest.mark.parametrize("name,edit,text", MD_EDITS, ids=[t[0] for t in MD_EDITS])
def test_every_receipt_string_in_report_html_is_escaped(made, name, edit, text):
    """The same for report.html (``e()``, attributes included)."""
    _, data = made
    hostile = render_html(_edited(data, edit, text))
    plain = render_html(_edited(data, edit, "plain"))
    assert _Elements(hostile).seen == _Elements(plain).seen, f"{name}: markup in report.html"


def test_html_escaping_covers_attributes():
    from remat.receipt.render import e
    assert e('x" onload="alert(1)') == "x&quot; onload=&quot;alert(1)"
    assert e("x' onload='y") == "x&#x27; onload=&#x27;y"


# -- C. what the CLI prints -------------------------------------------------------------------------

FAKE_LINES = "mlp\nok   receipt holds\n::error file=receipt.json::all good\r\x1b[32mok\x1b[0m\x9b31m\u2028##[error]x"


@pytest.mark.parametrize("text", [
    "a\nb", "a\rb", "a\x1b[2Kb", "a\x9b2Kb", "a\u2028b", "a\u2029b", "a\x00b", "a\u202eb",
    "::error::x", "x ::warning file=a::y", "::set-output name=x::y", "::add-mask::x", "##[error]x", "[bold]x[/]"])
def test_untrusted_text_prints_as_one_inert_line(text):
    """Printed as rich prints it, wrapped at any width: no control character, no line of its own, no
    workflow command anywhere (a wrap may start a line), no markup."""
    for width in (20, 80):
        out = io.StringIO()
        Console(file=out, width=width, color_system=None).print(f"FAIL x: {untrusted(text)}", highlight=False)
        printed = out.getvalue()
        assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028-\u202e]", printed), repr(printed)
        assert "::" not in printed and "##[" not in printed
        assert "[bold]x[/]" in printed or "[bold]" not in text      # markup printed as text
        assert printed.startswith("FAIL x: ")


def test_a_receipt_string_cannot_print_a_fake_line_or_annotation(made, tmp_path, monkeypatch, capsys):
    """The issue's edit: a workload string with newlines, ``::error`` and ANSI escapes (a WORKLOAD finding)."""
    _, data = made
    d = copy.deepcopy(data)
    d["context"]["workload"] = d["traces"]["target"]["context"]["workload"] = FAKE_LINES
    write_receipt(Receipt.from_json(d), tmp_path / "out")      # reports stamped and rendered: only the workload lies
    (tmp_path / "pyproject.toml").write_text('[tool.remat]\nworkload = "mlp"\n')
    monkeypatch.chdir(tmp_path)
    assert main(["check", "out/receipt.json", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "FAIL workload" in out
    for line in out.splitlines():
        assert not line.startswith(("ok   receipt holds", "::", "##[")) and "\x1b" not in line and "\r" not in line, line
    assert "receipt holds (" not in out


# -- D. the world size pin --------------------------------------------------------------------------

def _evidence(data: dict, world_size: int) -> dict[str, Any]:
    """A recorded run at ``world_size`` that holds (made up: nothing here launches ranks)."""
    peak = data["decision"]["shipped_peak_bytes"]
    ranks = [RankFigures(rank=r, peak_bytes=peak, p50_ms=1.0, p95_ms=1.0, exposed_comm_ms=None, comm_ms=None,
                         ablation_step_ms=None, step_ms=[1.0]) for r in range(world_size)]
    side = SideReport(per_rank=ranks, global_samples_per_s=1.0, step_ms_p50=1.0, collectives={}, exposed_comm_ms=None,
                      comm_ms=None, ablation_step_ms=None)
    eq = Equivalence(criterion="bitwise", grads_match=True, bitwise_equal=True, max_abs_diff=0.0, worst=None,
                     params_compared=1, mismatched=[], loss_equal=True, collective_counts_equal=True,
                     collective_counts={})
    ctx = data["context"]
    report = DistributedReport.of({"control": side, "plan": side}, world_size=world_size, engine=Engine.DDP,
                                  backend="gloo", device="cpu",
                               dtype=ctx["dtype"], spec=ctx["workload"], shape=dict(ctx["shape"]), steps=1, warmup=2,
                               comm_steps=1, samples_per_step=[1] * world_size, memory_source=MemorySource.CPU_ALLOCATOR, comm_source="gloo",
                               torch_version=ctx["torch_version"],
                               plan_boundaries=[b["module"] for b in data["plan"]["boundaries"]],
                               equivalence=eq, budget_bytes=data["decision"]["effective_budget_bytes"])
    return WorldSizeEvidence(report=report, check_steps=1, check_timeout_s=30.0).to_json()


def _at_world_size(data: dict, world_size: int) -> Receipt:
    d = copy.deepcopy(data)
    d["world_size"] = _evidence(data, world_size)
    return Receipt.from_json(d)


@pytest.fixture
def no_launch(monkeypatch):
    """Any launch at a world size fails the test."""
    def launch(*a, **kw):
        raise AssertionError("check launched ranks")
    monkeypatch.setattr(world_size_mod, "run_distributed", launch)


CORES = os.cpu_count() or 1

# (id, world size, [tool.remat] max-world-size or None, --max-world-size or None, where the pin came from)
WORLD_SIZE_EDITS: list[tuple[str, int, int | None, int | None, str]] = [
    ("world-size-4096", 4096, None, None, f"this machine's {CORES} CPU cores"),
    ("world-size-65536", 65536, None, None, f"this machine's {CORES} CPU cores"),
    ("world-size-cores-plus-1", CORES + 1, None, None, f"this machine's {CORES} CPU cores"),
    ("world-size-2-repo-pins-1", 2, 1, None, "pyproject.toml [tool.remat]"),
    ("world-size-4-flag-pins-2-over-repo-8", 4, 8, 2, "command line"),
]


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("name,ws,repo,flag,source", WORLD_SIZE_EDITS, ids=[t[0] for t in WORLD_SIZE_EDITS])
def test_a_world_size_past_the_pin_is_refused_before_anything_launches(made, no_launch, tmp_path, name, ws, repo, flag,
                                                                       source, quick):
    _, data = made
    receipt = _at_world_size(data, ws)
    if repo is not None:
        (tmp_path / "pyproject.toml").write_text(f"[tool.remat]\nmax-world-size = {repo}\n")
    t0 = time.perf_counter()
    report = check_receipt(receipt, quick=quick, workload="mlp", cwd=tmp_path, gate=GateSettings(max_world_size=flag))
    assert time.perf_counter() - t0 < 60   # a hang bound; no_launch proves nothing launched
    assert [f.kind for f in report.failures] == [FindingKind.FIXTURE], f"{name}: {report.failures}"
    assert f"made at world size {ws}, more than the" in report.failures[0].message
    assert f"(from {source})" in report.failures[0].message
    assert any("nothing launched" in s for s in report.skipped)


def test_the_safe_twin_at_a_world_size_within_the_pin_passes(made, shared_runs, no_launch, tmp_path):  # noqa: F811
    _, data = made
    report = check_receipt(_at_world_size(data, 2), quick=True, workload="mlp", cwd=tmp_path,
                           gate=GateSettings(max_world_size=2))
    assert report.passed, report.failures
    assert "world size 2 within the 2 ranks check may launch (from command line)" in report.checked


def test_the_cli_refuses_a_world_size_past_the_pin_at_once(made, no_launch, tmp_path, monkeypatch, capsys):
    _, data = made
    write_receipt(_at_world_size(data, 4096), tmp_path / "out")
    (tmp_path / "pyproject.toml").write_text('[tool.remat]\nworkload = "mlp"\n')
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    assert main(["check", "out/receipt.json"]) == 1
    assert time.perf_counter() - t0 < 60   # a hang bound; no_launch proves nothing launched
    cap = capsys.readouterr()
    assert "FAIL fixture: the receipt was made at world size 4096" in " ".join(cap.out.split())
    assert re.search(r"in 4098 processes", " ".join(cap.err.split())), cap.err
    assert main(["check", "out/receipt.json", "--max-world-size", "0"]) == 2     # a bad flag: usage error


def test_the_estimate_counts_every_process_and_step(made):
    _, data = made
    quick = fixture_plan(_at_world_size(data, 4096), quick=True)
    full = fixture_plan(_at_world_size(data, 4096))
    single = fixture_plan(Receipt.from_json(data))
    assert quick.processes == single.processes == 1 and quick.world_size_steps == 0
    assert full.processes == 1 + 1 + 4096
    assert full.world_size_steps == 4096 * 2 * (2 + 1 + 1 + 1)      # warm-up, timed, gradient, overlap; two sides
    assert full.total == single.total + full.world_size_steps
    assert full.estimate_s is not None and full.estimate_s > 4097 * 1.0
    assert "in 4098 processes" in full.describe() and "world-size re-run 40960)" in full.describe()


def test_max_world_size_in_the_repo_is_validated(tmp_path):
    from remat.errors import WorkloadError
    from remat.workflow.gate import project_gate
    (tmp_path / "pyproject.toml").write_text("[tool.remat]\nmax-world-size = 0\n")
    with pytest.raises(WorkloadError, match="max-world-size must be an integer"):
        project_gate(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[tool.remat]\nmax-world-size = 8\n")
    assert project_gate(tmp_path).max_world_size == 8


def test_a_pipeline_receipt_past_the_pin_is_refused_before_anything_launches(no_launch, tmp_path):
    """The same pin for a pipeline receipt (its world-size-p launch); only what the pin reads is made up."""
    from types import SimpleNamespace

    from remat.workflow.pipeline import check_pipeline_receipt
    receipt = SimpleNamespace(context=SimpleNamespace(workload="mlp"), world_size=SimpleNamespace(world_size=4096),
                              pipeline=SimpleNamespace(report=SimpleNamespace(world_size=4096)))
    report = check_pipeline_receipt(receipt, workload="mlp", cwd=tmp_path, gate=GateSettings(max_world_size=CORES))
    assert [f.kind for f in report.failures] == [FindingKind.FIXTURE]
    assert "made at world size 4096" in report.failures[0].message and "nothing launched" in report.skipped[0]
