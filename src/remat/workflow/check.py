"""``check_receipt``: re-run the fixtures a receipt names and say what no longer holds.

What is checked, in order (``quick`` stops after 4):
0. the receipt against the repository's pins (shape, dtype, autocast, world size: NOTE [gate
   pins] in workflow/gate.py): a receipt outside them is refused before anything else;
1. the receipt against itself (NOTE [receipt consistency] in workflow/consistency.py): a receipt
   that contradicts itself is refused before anything runs; then the gate's thresholds are
   chosen (NOTE [gate thresholds] in workflow/gate.py), never from the receipt alone;
2. the shape: every keyword of the factory, defaults included, as the receipt recorded it;
3. the model: each boundary's module still exists and its revision hash (class sources +
   parameter shapes) is unchanged; the whole-model fingerprint the plan is bound to;
4. equivalence: the receipt's paired-step fixture (same seeds, steps, tolerance), hazards
   and negative controls included (``remat.verify.verify_plan``);
5. the peak with the plan applied clears the gate's budget x (1 - reserve), and exceeds the
   receipt's claimed peak by no more than the peak tolerance;
6. each boundary's measured saving (NOTE [measured saving] in workflow/build.py) is not below
   its claim by more than the saving tolerance;
7. the step time, interleaved against the control (NOTE [re-measured overhead]);
8. the unplanned step itself (NOTE [re-measured control]): its peak, its target trace's peak and its
   held bytes at the start of backward.
If the model changed (3), 4-7 are skipped: the plan is bound to the model it was made
for, and the failure list already says what to do (re-run ``remat receipt``).
The whole check runs under a time limit (:class:`Deadline`, ``--timeout``).

NOTE [workload spec policy]
A receipt is data from a pull request: it never chooses what code runs. ``remat check``
runs the workload the *user* names, found in this order:
1. ``--workload`` on the command line;
2. ``[tool.remat] workload = "..."`` in ``pyproject.toml`` in the current directory (a file
   the repository's owners control, and review like code);
3. a built-in name (``gpt``, ``cnn``, ``mlp``) when the receipt records one: that is remat's
   own code, whatever the receipt says about it.
Otherwise check stops (exit 2) before anything is imported. The receipt's workload string
is only *compared* with the one chosen: a mismatch fails the check (exit 1) naming both,
before anything runs. The receipt's shape keywords are passed to the chosen factory only
after each is checked against the type the factory declares (NOTE [shape conformance] in
remat/workload/loader.py), and the schema bounds them (integers within +-2**31). Nothing
else read from a receipt names a path, module or callable that remat opens or imports;
the only other files check reads are ``report.html`` and ``report.md`` beside the receipt,
which must exist (unless ``--no-reports``) and be the reports rendered from it (NOTE [reports
checked against the receipt]).

NOTE [reports checked against the receipt]
A reviewer reads ``report.md`` (often posted as a comment) and ``report.html``, not the JSON, so
a pull request that edits only a report (false figures, a ``<script>``, an ``onload``) must fail
as surely as one that edits the receipt. Both reports are functions of the receipt alone
(remat/receipt/render.py, a pipeline run's too), so check
renders them again from the receipt it loaded, stamps them with its sha256 as ``remat receipt``
does (``stamped_reports`` in remat/receipt/write.py), and compares each file with its rendering,
character for character: a report that names another receipt's sha256, or differs anywhere else,
is a REPORT finding naming the file and where it first differs. One thing is left out of the
comparison: the plots ``report.html`` embeds as base64 PNG. Rendering is deterministic for one
matplotlib and one FreeType (the same receipt gives the same bytes, twice in one process or in
two), but the bytes change with their versions (matplotlib writes its version into every PNG),
and the machine that made the receipt need not be the one that checks it. So each PNG payload is
masked before the comparison (the ``<img>`` tags around it, their number and their place are
still compared), and when the masked payloads differ from the ones rendered here the check says
so on a "skip" line: a plot is drawn from figures the rest of the check does compare, but a
forged plot is not caught. A report made by another version of remat whose rendering changed
differs too, and fails: re-run ``remat receipt`` (the finding names both versions).

NOTE [re-measured control]
The control's figures are claims like the plan's: doubling the unplanned peak everywhere says a
plan is needed when none is, and every copy of it agrees, so no consistency check sees it. The full
check re-measures the unplanned step (a fresh build, as the frontier measured it) and compares, in
both directions (a claim too high is as false as one too low), within the peak tolerance:
- ``decision.control_peak_bytes`` (the frontier's control point) with the step's peak;
- ``traces.target.peak_bytes`` with the peak of a trace made as ``remat receipt`` made it (its
  warm-up and steps), at the target shape (a blocked receipt's: at the verified batch, where it was
  traced);
- ``plan.control_held_bytes`` with the held bytes the saving measurement starts from.
A difference is a CONTROL finding. A blocked receipt has no control peak at the target (the step does
not fit); that it still does not fit is checked instead. The torch release the receipt names must be
the one checking it (``torch_version``, an ENVIRONMENT finding: figures move between releases; a local
build tag such as ``+cpu`` or ``+cu128`` is not compared). Everything else the receipt states is
re-measured (5-8), derived from what was re-measured or from other receipt data (NOTE [receipt
consistency], NOTE [receipt statements]), or named on the check's "unchecked" line (:data:`UNCHECKED`).

NOTE [re-measured overhead]
The control and the plan are built fresh and timed in one interleaved round-robin (NOTE
[interleaved timing] in remat/measure/run.py), ``max(frontier_steps, MIN_TIME_STEPS)`` warm
rounds after ``frontier_warmup``. The overhead is the p50 difference over the control's p50,
with the bootstrap confidence interval of NOTE [resolved differences] (frontier/pareto.py).
The claim is itself a noisy figure (a few frontier rounds), so it is allowed the time tolerance
plus its own noise: how far its interval (the frontier's shipped samples against the control's)
reaches above it, at most one more tolerance, so that wide samples cannot buy a looser gate.
The check fails only when the plan's steps are *resolved* slower (NOTE [resolved differences]:
the bootstrap interval excludes zero and the per-round sign test agrees, so at least 6 rounds
all one way) than the control's scaled by 1 + (claimed overhead + that allowance): worse than
the claim beyond the tolerance, and outside the noise. A worse point estimate that is not
resolved is said to be within the noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import os
import re
import time
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .. import __version__
from .._codec import JsonCodec
from .._json import read_bounded_bytes
from ..closed_loop import measure_plan, sample_peaks
from ..memory.capacity import clear_refusal, last_refusal, step_capacity
from ..profile.blocked import BATCH_KEY
from ..profile.model import describe_refusal
from ..profile.sample import sample_workloads
from ..percentile import percentile
from ..frontier.pareto import CONFIDENCE, p50_difference
from ..measure import prepare_arm, time_round_robin
from ..wrap import PlanArm, boundary_module
from ..errors import CandidateError, CheckTimeout, ReceiptError, WorkloadError
from ..plan import Plan
from ..profile import DiffKind, FingerprintDiff, fingerprint, module_revision
from ..types import ProgressFn, no_progress
from ..units import mib
from ..trace import trace_workload
from ..verify import verify_plan
from ..workload import BUILTINS, LoadedWorkload, load_workload, shape_text
from .build import measure_savings
from .consistency import FixtureLimits, consistency_findings
from .findings import CheckFinding, FindingKind
from .gate import (PYPROJECT, GateSettings, Pins, Thresholds, limit, max_world_size, merge_pins, pin_mismatches,
                   project_gate, project_pins, resolve_thresholds, tool_remat)
from ..receipt.model import BoundaryRecord, Receipt, ShipStatus, resolved_shape
from ..receipt.write import HTML_FILE, MD_FILE, stamped_reports

MAX_REPORT_BYTES = 64 * 2 ** 20
PROCESS_START_S = 2.0  # a process the check starts, to import torch and join the job (s; an estimate)
MIN_TIME_STEPS = 8     # interleaved rounds the overhead is re-measured over, at least (a sign test
                       # resolves nothing in fewer than 6: NOTE [resolved differences])
# what no re-measurement or receipt data can confirm: said on the check's "unchecked" line, never passed silently
UNCHECKED = ("git_revision, git_dirty, command, created, hostname, platform, python_version and the notes (the "
             "receipt's word only)", "the planner's exclusions and their reasons (plan.excluded: compared between "
             "the plan and the frontier's copy, not re-derived)", "the figures of frontier points other than the "
             "control and the shipped plan (compared between copies, not re-measured)", "the trace timelines, "
             "phases and breakdowns at the peak (compared with the peak, not re-measured)", "the predicted figures "
             "and replay times (the planner's model, not a measurement)")
_STAMP = re.compile(r"receipt\.json sha256 ([0-9a-f]{64})")

__all__ = ["CheckLedger", "CheckReport", "ChosenWorkload", "Deadline", "FixturePlan",
           "ReadyCheck", "ReportStamps", "check_receipt", "choose_workload", "fixture_plan", "project_workload",
           "report_findings", "rerun_check", "same_workload", "start_check"]


@dataclasses.dataclass(kw_only=True)
class CheckReport(JsonCodec):
    passed: bool
    quick: bool
    workload: str
    failures: list[CheckFinding]
    checked: list[str]       # what held, one line each
    skipped: list[str]       # what was not re-run, and why
    wall_s: float


# -- the workload spec policy (NOTE [workload spec policy]) ----------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class ChosenWorkload:
    spec: str
    source: str     # "--workload", "pyproject.toml [tool.remat]", "built-in"


def project_workload(cwd: Path | None = None) -> str | None:
    """``[tool.remat] workload`` from ``pyproject.toml`` in ``cwd``; None when there is none."""
    spec = tool_remat(cwd).get("workload")
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip() or len(spec) > 4096:
        raise WorkloadError(f"{PYPROJECT} [tool.remat] workload must be a workload spec string, got {str(spec)[:60]!r}")
    return spec.strip()


def choose_workload(receipt_spec: str, given: str | None, *, cwd: Path | None = None) -> ChosenWorkload:
    """The workload ``check`` runs (NOTE [workload spec policy]); never the receipt's, unless it is a built-in."""
    if given:
        return ChosenWorkload(spec=given, source="--workload")
    project = project_workload(cwd)
    if project is not None:
        return ChosenWorkload(spec=project, source=f"{PYPROJECT} [tool.remat]")
    if receipt_spec in BUILTINS:
        return ChosenWorkload(spec=receipt_spec, source="built-in")
    shown = receipt_spec if len(receipt_spec) <= 120 else receipt_spec[:117] + "..."
    raise ReceiptError(
        f"the receipt names the workload {shown!r}; remat check never imports code a receipt names",
        tip=f"name your workload yourself: --workload SPEC, or [tool.remat] workload = \"SPEC\" in {PYPROJECT} "
            "here; check then compares it with the receipt's")


def _normal(spec: str, cwd: Path) -> str:
    """Lexically normal form (nothing is opened or resolved): ``./work.py:build`` == ``work.py:build``."""
    where, sep, attr = spec.rpartition(":")
    if sep and (where.endswith(".py") or "/" in where or "\\" in where):
        return os.path.normpath(os.path.join(str(cwd), where)) + ":" + attr
    return spec


def same_workload(a: str, b: str, *, cwd: Path | None = None) -> bool:
    root = cwd or Path.cwd()
    return a == b or _normal(a, root) == _normal(b, root)


def _load(receipt: Receipt, spec: str) -> LoadedWorkload:
    ctx = receipt.context
    try:
        return load_workload(spec, dict(ctx.shape), device=ctx.device, dtype=ctx.dtype, autocast=ctx.autocast)
    except WorkloadError as exc:
        if exc.traceback_text:          # the user's own code raised: theirs to see, as in every command
            raise
        raise ReceiptError(f"the receipt's workload does not load here: {exc.message}",
                           tip=exc.tip or "run remat check where remat receipt ran, or pass --workload") from exc


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportStamps:
    """The reports beside a receipt to check: its folder, the receipt as loaded and the sha256 of its bytes,
    and whether a missing report fails (``required``; ``--no-reports`` turns it off)."""

    folder: Path
    receipt: Receipt
    digest: str
    required: bool = True

    @functools.cached_property
    def rendered(self) -> dict[str, str]:
        """{file name: text}: the reports as ``remat receipt`` writes them for this receipt (NOTE [reports
        checked against the receipt]); rendered once, when a report is first compared."""
        from ..receipt.render import render_html, render_markdown
        return stamped_reports(self.digest, render_html(self.receipt), render_markdown(self.receipt))


class CheckLedger:
    """What a check has found, checked and skipped so far (both receipt kinds); ``report()`` is the
    :class:`CheckReport`. Starts with the reports' stamps when ``reports`` names a folder."""

    def __init__(self, spec: str, quick: bool, reports: ReportStamps | None) -> None:
        self.t0 = time.perf_counter()
        self.spec, self.quick = spec, quick
        self.failures: list[CheckFinding] = []
        self.checked: list[str] = []
        self.skipped: list[str] = []
        if reports is not None:
            f, c, sk = report_findings(reports)
            self.failures += f
            self.checked += c
            self.skipped += sk

    def report(self) -> CheckReport:
        return CheckReport(passed=not self.failures, quick=self.quick, workload=self.spec, failures=self.failures,
                           checked=self.checked, skipped=self.skipped, wall_s=time.perf_counter() - self.t0)


def _stamp_finding(name: str, text: str, digest: str) -> CheckFinding | None:
    """None when the report names exactly this receipt's sha256; else what it names instead."""
    named = set(_STAMP.findall(text))
    if named == {digest}:
        return None
    what = (f"names receipt sha256 {', '.join(sorted(d[:12] + '...' for d in named))}" if named
            else "names no receipt sha256")
    return CheckFinding(kind=FindingKind.REPORT, message=f"{name} {what}, but receipt.json beside it has sha256 "
                                                         f"{digest[:12]}...: the report shows figures from another "
                                                         "receipt (re-run remat receipt, or commit the report written "
                                                         "with this receipt)")


_PNG = re.compile(r"data:image/png;base64,[A-Za-z0-9+/=]*")
_PNG_MASK = "data:image/png;base64,"


def _first_difference(text: str, expected: str) -> str:
    """Where ``text`` first differs from ``expected``: its line and column, and what the file has there."""
    i = next((k for k, (a, b) in enumerate(zip(text, expected)) if a != b), min(len(text), len(expected)))
    line = text.count("\n", 0, i) + 1
    column = i - (text.rfind("\n", 0, i) + 1) + 1
    found = text[i:i + 40]
    return f"line {line}, column {column}" + (f": {found!r}" if found else ": the file ends there")


def _rewritten_finding(name: str, text: str, reports: ReportStamps) -> CheckFinding | None:
    """None when ``text`` is the report rendered from the receipt, its plots masked (NOTE [reports checked
    against the receipt]); else a REPORT finding saying where it first differs."""
    masked, want = _PNG.sub(_PNG_MASK, text), _PNG.sub(_PNG_MASK, reports.rendered[name])
    if masked == want:
        return None
    r = reports.receipt
    made_by = r.context.remat_version if isinstance(r, Receipt) else None
    versions = "" if made_by is None or made_by == __version__ else \
        f" (the receipt says remat {made_by} made it; this is remat {__version__})"
    return CheckFinding(kind=FindingKind.REPORT, message=(
        f"{name} is not the report rendered from receipt.json beside it{versions}: it first differs at "
        f"{_first_difference(masked, want)} (re-run remat receipt and commit the reports it writes; never edit "
        "them by hand)"))


def _read_report(path: Path, name: str) -> str:
    return read_bounded_bytes(path, error=ReceiptError, what=name, max_bytes=MAX_REPORT_BYTES).decode("utf-8", "replace")


def report_findings(reports: ReportStamps) -> tuple[list[CheckFinding], list[str], list[str]]:
    """(failures, checked, skipped): each report beside the receipt must exist (when required), name the
    receipt's sha256 and be the report rendered from it (NOTE [reports checked against the receipt])."""
    failures: list[CheckFinding] = []
    checked: list[str] = []
    skipped: list[str] = []
    for name in (HTML_FILE, MD_FILE):
        path = reports.folder / name
        if not path.exists() and not path.is_symlink():
            if reports.required:
                failures.append(CheckFinding(kind=FindingKind.REPORT, message=(
                    f"{name}: none beside the receipt (commit the reports remat receipt wrote, or pass --no-reports)")))
            else:
                skipped.append(f"{name}: none beside the receipt (--no-reports)")
            continue
        try:
            text = _read_report(path, name)
        except ReceiptError as exc:
            failures.append(CheckFinding(kind=FindingKind.REPORT, message=exc.message))
            continue
        found = _stamp_finding(name, text, reports.digest) or _rewritten_finding(name, text, reports)
        if found is not None:
            failures.append(found)
            continue
        checked.append(f"{name} is the report rendered from this receipt (sha256 {reports.digest[:12]}...)")
        if _PNG.findall(text) != _PNG.findall(reports.rendered[name]):
            skipped.append(f"{name}: its embedded plots are not byte for byte the ones rendered here (PNG bytes "
                           "change with matplotlib's version): compared without them")
    return failures, checked, skipped


# -- the time limit and what will run --------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class FixturePlan:
    """How many steps the check will run and how many processes it starts, and about how long that takes at
    the receipt's step time."""

    equivalence_steps: int      # control + planned, every seed, train steps + the eval step
    peak_steps: int             # the plan's peak (each sampled step), the control's peak and its trace
    saving_steps: int
    time_steps: int             # interleaved rounds x 2 arms
    world_size_steps: int = 0   # the re-run at the receipt's world size: every rank's steps, both sides
    processes: int = 1          # this one, and the launcher and its ranks for the world-size re-run
    step_ms: float | None       # the receipt's control p50 (an estimate: the receipt says so)

    @property
    def total(self) -> int:
        return self.equivalence_steps + self.peak_steps + self.saving_steps + self.time_steps + self.world_size_steps

    @property
    def estimate_s(self) -> float | None:
        """Every step at the receipt's step time (ranks on one machine share its cores), and each started
        process's import of torch (:data:`PROCESS_START_S`)."""
        if self.step_ms is None:
            return None
        return self.total * self.step_ms / 1000.0 + (self.processes - 1) * PROCESS_START_S

    def describe(self) -> str:
        when = "" if self.estimate_s is None else f", about {self.estimate_s:.1f} s at the receipt's {self.step_ms:.1f} ms a step"
        ranks = f", world-size re-run {self.world_size_steps}" if self.world_size_steps else ""
        started = f" in {self.processes} processes" if self.processes > 1 else ""
        return (f"{self.total} fixture steps will run{started} (equivalence {self.equivalence_steps}, peak "
                f"{self.peak_steps}, savings {self.saving_steps}, time {self.time_steps}{ranks}){when}")


def _later_points(plan: Plan | None) -> int:
    """Sampled steps after the first that the peak is re-measured at (2 steps each: NOTE [step sample])."""
    return 0 if plan is None or plan.sample is None else len(plan.sample.sample.points()) - 1


def fixture_plan(receipt: Receipt, *, quick: bool = False) -> FixturePlan:
    """What ``check_receipt`` will run for ``receipt`` (the progress line the CLI prints first)."""
    s, plan, ws = receipt.settings, receipt.plan.plan, receipt.world_size
    n = len(plan.boundaries) if plan is not None else 0
    full = not quick and plan is not None
    return FixturePlan(equivalence_steps=2 * s.verify_seeds * (s.verify_steps + 1) if n else 0,
                       # the plan's peak at each sampled step, then the control's peak and its trace (NOTE
                       # [re-measured control])
                       peak_steps=s.frontier_warmup + 1 + 2 * _later_points(plan) + (
                           s.frontier_warmup + 1 if receipt.blocked is None else 0) + s.trace_warmup + s.trace_steps
                       if full else 0,
                       saving_steps=(s.saving_warmup + 1) * (n + 1) if full and n else 0,
                       time_steps=2 * (s.frontier_warmup + max(s.frontier_steps, MIN_TIME_STEPS)) if full and n else 0,
                       world_size_steps=ws.rerun_steps if full and ws is not None else 0,
                       processes=1 + (ws.rerun_processes if full and ws is not None else 0),
                       step_ms=receipt.decision.control_p50_ms)


_TIMEOUT_TIP = "raise --timeout (or timeout in [tool.remat]), or make the receipt's fixtures smaller"


class Deadline:
    """The whole check's time limit (s): :meth:`check` raises :class:`CheckTimeout` once it is past,
    and :meth:`guard` checks it at every progress report of the stages it runs."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.t0 = time.perf_counter()

    def check(self, what: str) -> None:
        if self.timeout_s is None:
            return
        spent = time.perf_counter() - self.t0
        if spent > self.timeout_s:
            raise CheckTimeout(f"remat check ran past its {self.timeout_s:g} s limit ({spent:.0f} s, at {what}): "
                               "nothing was decided", tip=_TIMEOUT_TIP)

    def refuse_estimate(self, plan: FixturePlan) -> None:
        """Refuse up front a check whose fixtures, at the receipt's own step time, need more than the limit."""
        est = plan.estimate_s
        if self.timeout_s is not None and est is not None and est > self.timeout_s:
            raise CheckTimeout(f"{plan.describe()}: more than the {self.timeout_s:g} s limit; nothing was run",
                               tip=_TIMEOUT_TIP)

    def guard(self, progress: ProgressFn) -> ProgressFn:
        def update(what: str, done: int, total: int) -> None:
            self.check(what)
            progress(what, done, total)
        return update


# -- the checks ------------------------------------------------------------------------------------

def _shape_findings(receipt: Receipt, spec: str) -> list[CheckFinding]:
    try:
        now = resolved_shape(spec, receipt.context.shape)
    except WorkloadError as exc:  # pragma: no cover - the same spec just loaded
        return [CheckFinding(kind=FindingKind.SHAPE, message=f"cannot read the factory's shape keywords: {exc.message}")]
    then = receipt.context.resolved_shape
    out = []
    for k in sorted(then.keys() | now.keys()):
        if then.get(k, "<absent>") != now.get(k, "<absent>"):
            out.append(CheckFinding(kind=FindingKind.SHAPE, message=f"shape keyword {k}: {then.get(k, '<absent>')} -> "
                                                          f"{now.get(k, '<absent>')} (the receipt's figures were "
                                                          f"measured at {then.get(k, '<absent>')})"))
    return out


def _boundary_findings(b: BoundaryRecord, model: nn.Module, named: list[str], fp_diffs: list[FingerprintDiff]
                       ) -> tuple[list[CheckFinding], list[FingerprintDiff]]:
    """What changed in one boundary (its module is gone, or its revision differs), and the fingerprint
    differences that explains."""
    try:
        module = boundary_module(model, b.module)   # a segment: its members (NOTE [segments])
    except CandidateError:
        module = None
    if module is None:
        close = difflib.get_close_matches(b.module, named, n=3)
        hint = f"; closest: {', '.join(close)}" if close else ""
        return ([CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                              message=f"boundary {b.module} ({b.class_name}): the module is gone{hint}")],
                [d for d in fp_diffs if d.under(b.module)])
    rev = module_revision(module)
    named_module = dict(model.named_modules(remove_duplicate=False)).get(b.module)   # None: a segment
    if named_module is not None and type(named_module).__qualname__ != b.class_name:
        # the class the reports name is a claim too (and a place to hide text): it is the module's own
        return ([CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                              message=f"boundary {b.module}: the receipt names class {b.class_name[:80]!r}, the module "
                                      f"is a {type(named_module).__qualname__}")], [])
    if rev == b.revision:
        return [], []
    classes = {type(m).__qualname__ for m in module.modules()}
    mine = [d for d in fp_diffs if d.under(b.module, strictly=True) or (d.kind is DiffKind.CLASS and d.name in classes)]
    why = "; ".join(str(d) for d in mine[:4]) or "its class source or parameter shapes changed"
    return ([CheckFinding(kind=FindingKind.MODEL, boundary=b.module,
                          message=f"boundary {b.module} ({b.class_name}): revision {b.revision} -> {rev} ({why})")],
            mine)


def _model_findings(receipt: Receipt, loaded: LoadedWorkload) -> list[CheckFinding]:
    """Each boundary's changes, then the fingerprint differences no boundary explains."""
    model = loaded.workload.model
    named = list(dict(model.named_modules(remove_duplicate=False)))
    plan = receipt.plan.plan
    assert plan is not None
    fp_diffs = plan.fingerprint.differences(fingerprint(model))
    out: list[CheckFinding] = []
    explained: set[FingerprintDiff] = set()
    for b in receipt.plan.boundaries:
        found, diffs = _boundary_findings(b, model, named, fp_diffs)
        out += found
        explained.update(diffs)
    rest = [d for d in fp_diffs if d not in explained]
    if rest:
        shown = "; ".join(str(d) for d in rest[:6]) + (f"; ... {len(rest) - 6} more" if len(rest) > 6 else "")
        out.append(CheckFinding(kind=FindingKind.MODEL, message=f"the model changed outside the boundaries: {shown}"))
    return out


def _workload_is_the_receipts(ledger: CheckLedger, receipt: Receipt, chosen: ChosenWorkload, cwd: Path | None) -> bool:
    """1. the chosen workload must be the one the receipt names (NOTE [workload spec policy])."""
    theirs = receipt.context.workload
    if not same_workload(chosen.spec, theirs, cwd=cwd):
        ledger.failures.append(CheckFinding(kind=FindingKind.WORKLOAD, message=(
            f"the receipt was made for workload {theirs!r}, but {chosen.source} names {chosen.spec!r}: "
            "nothing was run")))
        return False
    ledger.checked.append(f"workload {chosen.spec} ({chosen.source}) is the receipt's")
    return True


def _shipped_plan(ledger: CheckLedger, receipt: Receipt) -> Plan | None:
    """The plan the receipt ships; None (a DECISION failure) when it ships none."""
    d = receipt.decision
    plan = receipt.plan.plan
    if d.status is not ShipStatus.SHIP or plan is None:
        ledger.failures.append(CheckFinding(kind=FindingKind.DECISION,
                                            message="the receipt ships no plan: " + (d.why[0] if d.why else "")))
        return None
    return plan


def _check_shape(ledger: CheckLedger, receipt: Receipt, spec: str) -> None:
    """2. every shape keyword of the factory, defaults included."""
    shape = _shape_findings(receipt, spec)
    ledger.failures += shape
    if not shape:
        ledger.checked.append(f"shape unchanged ({', '.join(f'{k}={v}' for k, v in receipt.context.resolved_shape.items())})")


def _check_model(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, plan: Plan) -> bool:
    """2. the model the plan is bound to; False (3-5 skipped) when it changed."""
    model = _model_findings(receipt, loaded)
    ledger.failures += model
    if not plan.boundaries:
        ledger.checked.append("the receipt ships no checkpointing: no boundary to re-check")
    elif not model:
        ledger.checked.append(f"{len(plan.boundaries)} boundary revision{'s' * (len(plan.boundaries) != 1)} "
                              "unchanged: " + ", ".join(f"{b.module} {b.revision}" for b in receipt.plan.boundaries))
    if model:
        ledger.skipped.append("equivalence, peak and savings not re-run: the model is not the one the receipt was "
                              "made for (re-run remat receipt)")
    return not model


def _blamed_boundary(receipt: Receipt, blamed: str | None) -> str | None:
    """The boundary whose module (or a module inside it) diverged first."""
    return next((b.module for b in receipt.plan.boundaries
                 if blamed and (blamed == b.module or blamed.startswith(b.module + "."))), None)


def _check_equivalence(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, plan: Plan,
                       progress: ProgressFn) -> None:
    """3. the fixture the receipt names; a compiled plan (plan.compile) re-runs compiled against the
    compiled control (NOTE [compiled receipts]), a torch-budget plan too. ``loaded``: where the control
    fits (a blocked receipt's verified batch: NOTE [blocked receipt])."""
    torch_budget = plan.compile is not None and plan.compile.memory_budget is not None
    if not (plan.boundaries or torch_budget):
        return
    fx = receipt.plan.boundaries[0].fixture if receipt.plan.boundaries else None
    steps, seeds = (fx.steps, len(fx.seeds)) if fx else (receipt.settings.verify_steps, receipt.settings.verify_seeds)
    report = verify_plan(loaded, plan, steps=steps, seeds=seeds, timing_steps=0, progress=progress)
    if not report.passed:
        owner = _blamed_boundary(receipt, report.first_divergent_module)
        ledger.failures += [CheckFinding(kind=FindingKind.EQUIVALENCE, boundary=owner, message=f)
                            for f in report.failures]
        return
    bitwise = all(s.bitwise for s in report.per_step)
    how = f" (compiled: {plan.compile.describe()}, vs the compiled control)" if plan.compile else ""
    where = "" if receipt.blocked is None else f" at {shape_text(loaded.shape)}, where the control fits"
    ledger.checked.append(f"equivalence{how}{where}: {seeds} seed{'s' * (seeds != 1)} x {steps} "
                          f"step{'s' * (steps != 1)} + eval "
                          f"{'bitwise equal' if bitwise else 'within tolerance'}; negative controls rejected")


def _check_consistency(ledger: CheckLedger, receipt: Receipt, limits: FixtureLimits) -> bool:
    """1. the receipt against itself (NOTE [receipt consistency]); False (nothing runs) when it contradicts itself."""
    found = consistency_findings(receipt, limits)
    ledger.failures += found
    if found:
        ledger.skipped.append("nothing re-run: the receipt contradicts itself (an edited receipt; re-run remat receipt)")
        return False
    ledger.checked.append("the receipt agrees with itself (budget arithmetic, plan vs records, fixtures, claims)")
    return True


def _within_world_size(ledger: CheckLedger, receipt: Receipt, flags: GateSettings, project: GateSettings) -> bool:
    """The receipt's world size is within the gate's ``max-world-size`` (NOTE [gate thresholds]); False
    (nothing runs, nothing launches) when it is above it."""
    ws = receipt.world_size
    if ws is None:
        return True
    most, source = max_world_size(flags, project)
    if ws.world_size <= most:
        ledger.checked.append(f"world size {ws.world_size} within the {most} ranks check may launch (from {source})")
        return True
    ledger.failures.append(CheckFinding(kind=FindingKind.FIXTURE, message=(
        f"the receipt was made at world size {ws.world_size}, more than the {most} ranks check may launch (from "
        f"{source}); raise --max-world-size, or max-world-size in [tool.remat], if that is meant")))
    ledger.skipped.append(f"nothing re-run and nothing launched: the receipt's world size {ws.world_size} is above "
                          f"the gate's {most}")
    return False


def _within_pins(ledger: CheckLedger, receipt: Receipt, pins: Pins) -> bool:
    """0. the receipt was made at the repository's pins (NOTE [gate pins]); False (nothing runs) when it was not."""
    if not pins.describe():
        return True
    ctx = receipt.context
    wrong = pin_mismatches(pins, resolved_shape=dict(ctx.resolved_shape), dtype=ctx.dtype, autocast=ctx.autocast,
                           world_size=1 if receipt.world_size is None else receipt.world_size.world_size)
    if not wrong:
        ledger.checked.append(f"within the pins of {pins.source}: " + ", ".join(pins.describe()))
        return True
    ledger.failures += [CheckFinding(kind=FindingKind.PIN, message=f"{w} ({pins.source}): the receipt measured "
                                                                    "another step than the one the gate is for")
                        for w in wrong]
    ledger.skipped.append("nothing re-run and nothing launched: the receipt is outside the repository's pins "
                          "(re-run remat receipt at them)")
    return False


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def _check_torch_release(ledger: CheckLedger, receipt: Receipt) -> None:
    """The receipt's torch release is the one checking it (NOTE [re-measured control])."""
    made, now = receipt.context.torch_version, torch.__version__
    if _release(made) == _release(now):
        ledger.checked.append(f"torch {_release(now)}: the release the receipt was made with")
        return
    ledger.failures.append(CheckFinding(kind=FindingKind.ENVIRONMENT, message=(
        f"the receipt was made with torch {made}; this is torch {now}: its figures were measured under another "
        "release (re-run remat receipt with this one)")))


def _within(measured: int, claimed: int, tol: float) -> bool:
    """A re-measured figure within ``tol`` of its claim, in either direction (bytes)."""
    return abs(measured - claimed) <= tol * max(abs(claimed), 1)


def _check_control(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, proof: LoadedWorkload,
                   thresholds: Thresholds, held: int | None) -> None:
    """8. the unplanned step's peak, its target trace's peak and its held bytes (NOTE [re-measured control])."""
    tol = thresholds.peak_tolerance.value
    figures: list[tuple[str, int | None, int | None]] = []
    claimed = receipt.decision.control_peak_bytes
    if receipt.blocked is None and claimed is not None:
        peak = None
        with _fits_device(ledger, f"the control at {shape_text(loaded.shape)}", thresholds.capacity_bytes):
            peak = measure_plan(loaded, None, warmup=receipt.settings.frontier_warmup, steps=0).peak_bytes
        figures.append(("the unplanned step's peak (decision.control_peak_bytes)", claimed, peak))
    target = receipt.traces.target
    traced = None
    with _fits_device(ledger, f"the control's trace at {shape_text(proof.shape)}", thresholds.capacity_bytes):
        traced = _trace_peak(proof, warmup=target.context.warmup, steps=target.context.steps)
    figures.append(("the target trace's peak (traces.target.peak_bytes)", target.peak_bytes, traced))
    if receipt.plan.control_held_bytes is not None and held is not None:
        figures.append(("the unplanned step's held bytes at backward (plan.control_held_bytes)",
                        receipt.plan.control_held_bytes, held))
    ok = []
    for what, claim, now in figures:
        if claim is None or now is None:
            continue
        if _within(now, claim, tol):
            ok.append(f"{what} {mib(now)} (receipt: {mib(claim)})")
        else:
            ledger.failures.append(CheckFinding(kind=FindingKind.CONTROL, message=(
                f"{what}: re-measured {mib(now)}, the receipt claims {mib(claim)} (more than {tol:.0%} apart)")))
    if ok:
        ledger.checked.append(f"the control re-measured within {tol:.0%} of its claims: " + "; ".join(ok))


def _trace_peak(loaded: LoadedWorkload, *, warmup: int, steps: int) -> int:
    """The unplanned step's peak as ``remat receipt`` traced it (bytes)."""
    return trace_workload(loaded.rebuild(), warmup=warmup, steps=steps).peak_bytes   # a fresh build, as traced


def _claimed_peak(receipt: Receipt, plan: Plan) -> int:
    """The peak the receipt claims for the shipped plan (bytes): the control's when it ships no boundaries."""
    d = receipt.decision
    peak = d.shipped_peak_bytes if d.shipped_peak_bytes is not None else d.control_peak_bytes
    return peak if peak is not None else 0


def _peaks(receipt: Receipt, loaded: LoadedWorkload, plan: Plan) -> list[tuple[int, int, str]]:
    """(re-measured, claimed, where) peak bytes per point of the receipt's step sample (NOTE [step sample]):
    the first point's claim is the decision's, each later point's the one the plan's sample recorded."""
    first = measure_plan(loaded, plan, warmup=receipt.settings.frontier_warmup, steps=0).peak_bytes
    claimed = _claimed_peak(receipt, plan)
    if plan.sample is None or plan.sample.sample.is_single:
        return [(first, claimed, "")]
    points = plan.sample.sample.points()
    measured = sample_peaks(sample_workloads(loaded, plan.sample.sample), plan.sample.sample, plan, first)
    claims = [claimed, *plan.sample.point_peaks[1:]]
    return [(m, c, f" at the sampled step {p.label()}") for m, c, p in zip(measured, claims, points)]


def _check_peak(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, plan: Plan,
                thresholds: Thresholds) -> None:
    """5. the peak with the plan applied clears the gate's budget x (1 - reserve) and its claim (bytes),
    at every point of the step sample; under a device capacity, a step the capacity refuses fails."""
    limit_bytes = thresholds.effective_budget_bytes
    names = ", ".join(b.module for b in plan.boundaries) or "no boundaries"
    one = plan.boundaries[0].module if len(plan.boundaries) == 1 else None
    peaks: list[tuple[int, int, str]] = []
    with _fits_device(ledger, f"the step with the plan ({names})", thresholds.capacity_bytes):
        peaks = _peaks(receipt, loaded, plan)
    if not peaks:
        return
    tol = thresholds.peak_tolerance.value
    peak, claimed, where = max(peaks)
    if peak > limit_bytes:
        ledger.failures.append(CheckFinding(
            kind=FindingKind.PEAK, boundary=one,
            message=f"peak {mib(peak)}{where} with the plan ({names}) no longer clears {mib(limit_bytes)} (budget "
                    f"{mib(int(thresholds.budget_bytes.value))} less the required {thresholds.reserve.value:.0%} "
                    f"reserve); the receipt measured {mib(claimed)}"))
    else:
        ledger.checked.append(f"peak {mib(peak)}{where} clears {mib(limit_bytes)} (receipt: {mib(claimed)})")
    over = [(m, c, w) for m, c, w in peaks if m > c * (1.0 + tol)]
    for m, c, w in over[:1]:
        ledger.failures.append(CheckFinding(
            kind=FindingKind.PEAK_CLAIM, boundary=one,
            message=f"peak {mib(m)}{w} with the plan ({names}) is {m - c} bytes over the {mib(c)} the "
                    f"receipt claims (more than the {tol:.0%} tolerance)"))
    if not over:
        ledger.checked.append(f"peak {mib(peak)}{where} within {tol:.0%} of the claimed {mib(claimed)}"
                              + (f" (and at each of the {len(peaks)} sampled steps)" if len(peaks) > 1 else ""))


@contextlib.contextmanager
def _fits_device(ledger: CheckLedger, what: str, capacity_bytes: int | None) -> Iterator[None]:
    """Run a re-measurement; a step the device refuses (out of memory) is a DEVICE finding, not a crash."""
    clear_refusal()
    try:
        yield
    except torch.OutOfMemoryError as exc:
        refusal = last_refusal()
        device = "the device" if capacity_bytes is None else f"the device capacity of {mib(capacity_bytes)}"
        ledger.failures.append(CheckFinding(
            kind=FindingKind.DEVICE, message=f"{what} no longer fits {device} ("
            + (describe_refusal(refusal) if refusal else str(exc).splitlines()[0]) + ")"))


def _check_savings(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, plan: Plan,
                   thresholds: Thresholds, progress: ProgressFn) -> int | None:
    """6. each boundary's measured saving (bytes) is not below its claim by more than the tolerance; returns the
    control's held bytes the savings were measured from (None: not measured)."""
    if not plan.boundaries:
        return None
    savings: dict[str, int] | None = None
    held = None
    with _fits_device(ledger, f"the control at {shape_text(loaded.shape)}", thresholds.capacity_bytes):
        held, savings = measure_savings(loaded, plan, warmup=receipt.settings.saving_warmup, progress=progress)
    if savings is None:
        return None
    tol = thresholds.saving_tolerance.value
    ok = []
    for b in receipt.plan.boundaries:
        now = savings[b.module]
        floor = b.measured_saving_bytes - tol * abs(b.measured_saving_bytes)
        if now < floor:
            ledger.failures.append(CheckFinding(
                kind=FindingKind.SAVING, boundary=b.module,
                message=f"boundary {b.module}: saves {mib(now)}, down from {mib(b.measured_saving_bytes)} "
                        f"(more than the {tol:.0%} tolerance)"))
        else:
            ok.append(f"{b.module} {mib(now)}")
    if ok:
        ledger.checked.append(f"savings within {tol:.0%} of the claims: {', '.join(ok)}")
    return held


def _interleaved_ms(receipt: Receipt, loaded: LoadedWorkload, plan: Plan,
                    progress: ProgressFn) -> tuple[list[float], list[float]]:
    """(control, plan) warm step times (ms), fresh builds timed interleaved (NOTE [re-measured overhead])."""
    s = receipt.settings
    arms = [prepare_arm(loaded, PlanArm("control", None)), prepare_arm(loaded, PlanArm("plan", plan))]
    try:
        t = time_round_robin(arms, warmup=s.frontier_warmup, steps=max(s.frontier_steps, MIN_TIME_STEPS),
                             progress=progress, what="time vs control")
    finally:
        for a in arms:
            a.close()
    return t.step_ms["control"], t.step_ms["plan"]


def _frontier_samples(receipt: Receipt) -> tuple[list[float], list[float]] | None:
    """(shipped, control) warm step times (ms) the claimed overhead came from; None without them."""
    fr = receipt.frontier
    shipped = fr.shipped if fr is not None else None
    control = next((p for p in fr.points if p.plan == fr.control), None) if fr is not None else None
    if shipped is None or control is None or not shipped.step_ms or not control.step_ms:
        return None
    return shipped.step_ms, control.step_ms


def _claim_noise(receipt: Receipt) -> float:
    """How far above the claimed overhead its own interval reaches (% of the control's step; 0 without
    samples): the frontier's samples of the shipped point against the control's (NOTE [re-measured overhead])."""
    d, samples = receipt.decision, _frontier_samples(receipt)
    if samples is None or not d.control_p50_ms or d.overhead_pct is None:
        return 0.0
    high = p50_difference(*samples).high_ms
    return 0.0 if math.isnan(high) else max(0.0, 100.0 * high / d.control_p50_ms - d.overhead_pct)


def _time_verdict(control: list[float], planned: list[float], claimed: float, allowance: float) -> tuple[bool, str]:
    """(fails, what was found) for interleaved step times (ms) against the claimed overhead plus its
    allowance, both in % of the control's step (NOTE [re-measured overhead])."""
    base = percentile(control, 50.0) or 1e-9   # the control's p50 (ms)
    diff = p50_difference(planned, control)
    now, low, high = (100.0 * x / base for x in (diff.diff_ms, diff.low_ms, diff.high_ms))
    interval = "no interval" if math.isnan(low) else f"{CONFIDENCE:.0%} CI [{low:+.1f}%, {high:+.1f}%]"
    said = f"overhead {now:+.1f}% ({interval}, {diff.samples} interleaved rounds) vs the claimed {claimed:+.1f}%"
    allowed = 1.0 + (claimed + allowance) / 100.0     # the slowest step the claim allows, per control step
    excess = p50_difference(planned, [allowed * c for c in control])
    if excess.resolved and excess.diff_ms > 0:
        return True, f"{said}: resolved slower than the claim {allowance:+.0f} points (tolerance and the claim's noise)"
    if now <= claimed:
        return False, f"{said}: no worse than claimed"
    return False, f"{said}: {'within the noise' if now > claimed + allowance else 'within tolerance'}"


def _check_time(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, plan: Plan,
                thresholds: Thresholds, progress: ProgressFn) -> None:
    """7. the overhead against the control, with its interval (NOTE [re-measured overhead])."""
    claimed = receipt.decision.overhead_pct
    if not plan.boundaries or claimed is None:
        return
    control, planned = _interleaved_ms(receipt, loaded, plan, progress)
    tol = 100.0 * thresholds.time_tolerance.value
    fails, said = _time_verdict(control, planned, claimed, tol + min(_claim_noise(receipt), tol))
    if fails:
        ledger.failures.append(CheckFinding(kind=FindingKind.TIME, message=said))
    else:
        ledger.checked.append(said)


def _thresholds(ledger: CheckLedger, receipt: Receipt, flags: GateSettings, project: GateSettings) -> Thresholds:
    """The gate's thresholds (NOTE [gate thresholds]), each said with where it came from."""
    thresholds = resolve_thresholds(receipt, flags, project)
    ledger.checked.append("thresholds: " + "; ".join(thresholds.describe()))
    return thresholds


def _remeasure(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, proof: LoadedWorkload, plan: Plan,
               thresholds: Thresholds, progress: ProgressFn) -> None:
    """5-7: peak, savings and time, each against the receipt's claim; the peak at the target, the savings
    where the control fits (``proof``: NOTE [blocked receipt])."""
    _check_peak(ledger, receipt, loaded, plan, thresholds)
    progress("check", 5, 7)
    held = _check_savings(ledger, receipt, proof, plan, thresholds, progress)
    _check_control(ledger, receipt, loaded, proof, thresholds, held)
    progress("check", 6, 7)
    if receipt.blocked is not None:
        _check_still_blocked(ledger, receipt, loaded)
        ledger.skipped.append("step time vs the control not re-measured: the control does not fit the device at the "
                              "target shape (NOTE [blocked receipt])")
    else:
        _check_time(ledger, receipt, loaded, plan, thresholds, progress)
    progress("check", 7, 7)


def _check_still_blocked(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload) -> None:
    """The receipt's other shape: the unplanned step at the target, under the capacity, is still refused
    (a step that now fits is said, not failed: the plan still holds, it may no longer be needed)."""
    clear_refusal()
    try:
        measure_plan(loaded, None, warmup=1, steps=0)
    except torch.OutOfMemoryError:
        refusal = last_refusal()
        ledger.checked.append(f"the unplanned step at {shape_text(loaded.shape)} still does not fit the device"
                              + (f" ({describe_refusal(refusal)})" if refusal else ""))
        return
    ledger.checked.append(f"the unplanned step at {shape_text(loaded.shape)} now fits the device: the plan may no "
                          "longer be needed (re-run remat receipt)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadyCheck:
    """What the re-run on the user's workload needs, all decided before any of the user's code runs
    (:func:`start_check`); :func:`rerun_check` runs it, here or in a child process (NOTE [workload in a
    child process] in workflow/child.py)."""

    receipt: Receipt
    spec: str                 # the user's workload (NOTE [workload spec policy])
    plan: Plan
    quick: bool
    thresholds: Thresholds
    deadline: Deadline


def start_check(receipt: Receipt, *, quick: bool = False, workload: str | None = None,
                reports: ReportStamps | None = None, cwd: Path | None = None, gate: GateSettings | None = None,
                pins: Pins | None = None) -> tuple[CheckLedger, ReadyCheck | None]:
    """1 and the gate (module docstring), running none of the user's code: (the ledger so far, what the
    re-run needs; None when the check is decided already: the receipt names other code, ships nothing,
    contradicts itself or is above the world size check may launch). Raises as :func:`check_receipt`."""
    flags, project = gate or GateSettings(), project_gate(cwd)
    deadline = Deadline(limit("timeout_s", flags, project))
    chosen = choose_workload(receipt.context.workload, workload, cwd=cwd)
    ledger = CheckLedger(chosen.spec, quick, reports)
    if not _workload_is_the_receipts(ledger, receipt, chosen, cwd) or not _within_pins(
            ledger, receipt, merge_pins(pins, project_pins(cwd))):
        return ledger, None
    plan = _shipped_plan(ledger, receipt)
    limits = FixtureLimits(max_seeds=limit("max_seeds", flags, project), max_steps=limit("max_steps", flags, project))
    if plan is None or not _check_consistency(ledger, receipt, limits) or not _within_world_size(
            ledger, receipt, flags, project):
        return ledger, None
    deadline.refuse_estimate(fixture_plan(receipt, quick=quick))
    _check_torch_release(ledger, receipt)
    ledger.skipped.append("unchecked: " + "; ".join(UNCHECKED))
    thresholds = _thresholds(ledger, receipt, flags, project)
    return ledger, ReadyCheck(receipt=receipt, spec=chosen.spec, plan=plan, quick=quick, thresholds=thresholds,
                              deadline=deadline)


def check_receipt(receipt: Receipt, *, quick: bool = False, workload: str | None = None,
                  reports: ReportStamps | None = None, cwd: Path | None = None, gate: GateSettings | None = None,
                  pins: Pins | None = None, progress: ProgressFn = no_progress) -> CheckReport:
    """Re-run what ``receipt`` names on the user's workload; the report lists every failure (module docstring).

    ``workload`` is the user's spec (``--workload``); without it, ``pyproject.toml``'s
    ``[tool.remat] workload`` in ``cwd``, or the receipt's when it is a built-in (NOTE
    [workload spec policy]). ``reports``: the reports beside the receipt to check. ``gate``: the
    thresholds the command line gives (NOTE [gate thresholds]), over ``[tool.remat]``'s; ``pins``: the pins it
    gives (NOTE [gate pins]), over ``[tool.remat]``'s. Raises
    :class:`ReceiptError` when no workload is named or it cannot be loaded here, and
    :class:`~remat.errors.CheckTimeout` when the fixtures would take, or take, longer than the
    time limit; check failures are data (``report.passed``), for the CLI to turn into exit code 1.
    Everything runs in this process; ``remat check`` runs the user's part in a child process
    (:func:`remat.workflow.check_child.check_receipt_in_child`). A pipeline run's receipt (NOTE [one receipt]
    in remat/receipt/model.py) is re-checked by :func:`remat.workflow.pipeline.check_pipeline_receipt`, held to
    the gate's time limit and ``max-world-size``.
    """
    if receipt.pipeline is not None:
        from .pipeline import check_pipeline_receipt
        flags, project = gate or GateSettings(), project_gate(cwd)
        return check_pipeline_receipt(receipt, quick=quick, workload=workload, reports=reports, cwd=cwd, gate=flags,
                                      progress=Deadline(limit("timeout_s", flags, project)).guard(progress))
    ledger, ready = start_check(receipt, quick=quick, workload=workload, reports=reports, cwd=cwd, gate=gate,
                                pins=pins)
    if ready is not None:
        rerun_check(ledger, ready, progress=ready.deadline.guard(progress))
    return ledger.report()


def rerun_check(ledger: CheckLedger, ready: ReadyCheck, *, progress: ProgressFn = no_progress) -> None:
    """2-7 (module docstring) on the user's workload: loads it and runs its steps, adding to ``ledger``."""
    receipt, plan, thresholds, quick = ready.receipt, ready.plan, ready.thresholds, ready.quick
    loaded = _load(receipt, ready.spec)
    progress("check", 1, 7)
    _check_shape(ledger, receipt, ready.spec)
    progress("check", 2, 7)
    if not _check_model(ledger, receipt, loaded, plan):
        return
    progress("check", 3, 7)
    blocked = receipt.blocked
    # NOTE [blocked receipt]: both shapes, every step under the gate's device capacity on the CPU
    with step_capacity(thresholds.capacity_bytes if loaded.device == "cpu" else None):
        proof = loaded if blocked is None else loaded.rebuild(**{BATCH_KEY: blocked.verified_batch})
        with _fits_device(ledger, f"the paired steps at {shape_text(proof.shape)}", thresholds.capacity_bytes):
            _check_equivalence(ledger, receipt, proof, plan, progress)
        progress("check", 4, 7)
        _check_world_size(ledger, receipt, plan, thresholds, None if quick else ready.spec, progress)
        if quick:
            ledger.skipped.append("peak, per-boundary savings and step time not re-measured (--quick)")
            return
        _remeasure(ledger, receipt, loaded, proof, plan, thresholds, progress)


def _check_world_size(ledger: CheckLedger, receipt: Receipt, plan: Plan, thresholds: Thresholds, spec: str | None,
                      progress: ProgressFn) -> None:
    """The run at the receipt's world size, recorded and (``spec`` given: not --quick) re-run on the user's
    workload (NOTE [receipt at a world size] in remat/receipt/world_size.py)."""
    if receipt.world_size is None:
        return
    from .world_size import check_recorded, check_rerun
    for failures, held in [check_recorded(receipt, thresholds)] + (
            [check_rerun(receipt, plan, thresholds, spec=spec, progress=progress)] if spec is not None else []):
        ledger.failures += failures
        ledger.checked += held
    if spec is None:
        ledger.skipped.append(f"the plan was not re-run at world size {receipt.world_size.world_size} (--quick)")
