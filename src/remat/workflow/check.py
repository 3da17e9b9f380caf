"""``check_receipt``: re-run the fixtures a receipt names and say what no longer holds.

What is checked, in order (``quick`` stops after 3):
1. the shape: every keyword of the factory, defaults included, as the receipt recorded it;
2. the model: each boundary's module still exists and its revision hash (class sources +
   parameter shapes) is unchanged; the whole-model fingerprint the plan is bound to;
3. equivalence: the receipt's paired-step fixture (same seeds, steps, tolerance), hazards
   and negative controls included (``remat.verify.verify_plan``);
4. the peak with the plan applied still clears budget x (1 - reserve);
5. each boundary's measured saving (NOTE [measured saving] in workflow/build.py) has not fallen by
   more than its stated tolerance.
If the model changed (2), 3-5 are skipped: the plan is bound to the model it was made
for, and the failure list already says what to do (re-run ``remat receipt``).

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
which must name the receipt's sha256 (NOTE [atomic receipt folder] in receipt/write.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
import time
import tomllib
from pathlib import Path
from typing import Any

from torch import nn

from .._json import read_bounded_bytes
from ..closed_loop import measure_plan
from ..wrap import boundary_module
from ..errors import CandidateError, ReceiptError, WorkloadError
from ..plan import Plan
from ..profile import FingerprintDiff, fingerprint, module_revision
from ..types import ProgressFn, no_progress
from ..units import mib
from ..verify import verify_plan
from ..workload import BUILTINS, LoadedWorkload, load_workload
from .build import measure_savings
from ..receipt.model import BoundaryRecord, Receipt, ShipStatus, resolved_shape
from ..receipt.write import HTML_FILE, MD_FILE

PYPROJECT = "pyproject.toml"
MAX_PYPROJECT_BYTES = 2 ** 20
MAX_REPORT_BYTES = 64 * 2 ** 20
_STAMP = re.compile(r"receipt\.json sha256 ([0-9a-f]{64})")



class FindingKind(str, enum.Enum):
    """What a failed check is about (the order ``check_receipt`` checks in)."""

    WORKLOAD = "workload"         # the receipt names other code than the user's
    REPORT = "report"             # report.html/report.md beside it show another receipt
    SHAPE = "shape"               # a shape keyword (or its default) changed
    MODEL = "model"               # a boundary's module changed or is gone; the fingerprint differs
    DECISION = "decision"         # the receipt ships nothing
    EQUIVALENCE = "equivalence"   # the paired-step fixture fails
    PEAK = "peak"                 # the peak no longer clears budget x (1 - reserve)
    SAVING = "saving"             # a boundary saves less than its tolerance allows

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckFinding:
    """One thing that no longer holds. ``boundary`` names the module when it is about one."""

    kind: FindingKind
    message: str
    boundary: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FindingKind(self.kind))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "message": self.message, "boundary": self.boundary}


@dataclasses.dataclass(kw_only=True)
class CheckReport:
    passed: bool
    quick: bool
    workload: str
    failures: list[CheckFinding]
    checked: list[str]       # what held, one line each
    skipped: list[str]       # what was not re-run, and why
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "quick": self.quick, "workload": self.workload,
                "failures": [f.to_json() for f in self.failures], "checked": list(self.checked),
                "skipped": list(self.skipped), "wall_s": self.wall_s}


# -- the workload spec policy (NOTE [workload spec policy]) ----------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class ChosenWorkload:
    spec: str
    source: str     # "--workload", "pyproject.toml [tool.remat]", "built-in"


def project_workload(cwd: Path | None = None) -> str | None:
    """``[tool.remat] workload`` from ``pyproject.toml`` in ``cwd``; None when there is none."""
    path = (cwd or Path.cwd()) / PYPROJECT
    if not path.is_file():
        return None
    data = read_bounded_bytes(path, error=WorkloadError, what=PYPROJECT, max_bytes=MAX_PYPROJECT_BYTES)
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path} is not valid TOML: {exc}") from None
    spec = table.get("tool", {}).get("remat", {}).get("workload") if isinstance(table.get("tool"), dict) else None
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip() or len(spec) > 4096:
        raise WorkloadError(f"{path}: [tool.remat] workload must be a workload spec string, got {str(spec)[:60]!r}")
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
        return load_workload(spec, dict(ctx.shape), device=ctx.device, dtype=ctx.dtype)
    except WorkloadError as exc:
        if exc.traceback_text:          # the user's own code raised: theirs to see, as in every command
            raise
        raise ReceiptError(f"the receipt's workload does not load here: {exc.message}",
                           tip=exc.tip or "run remat check where remat receipt ran, or pass --workload") from exc


class CheckLedger:
    """What a check has found, checked and skipped so far (both receipt kinds); ``report()`` is the
    :class:`CheckReport`. Starts with the reports' stamps when ``reports`` names a folder."""

    def __init__(self, spec: str, quick: bool, reports: tuple[Path, str] | None) -> None:
        self.t0 = time.perf_counter()
        self.spec, self.quick = spec, quick
        self.failures: list[CheckFinding] = []
        self.checked: list[str] = []
        self.skipped: list[str] = []
        if reports is not None:
            f, c, sk = report_findings(*reports)
            self.failures += f
            self.checked += c
            self.skipped += sk

    def report(self) -> CheckReport:
        return CheckReport(passed=not self.failures, quick=self.quick, workload=self.spec, failures=self.failures,
                           checked=self.checked, skipped=self.skipped, wall_s=time.perf_counter() - self.t0)


def report_findings(folder: Path, digest: str) -> tuple[list[CheckFinding], list[str], list[str]]:
    """(failures, checked, skipped): each report beside the receipt must name the receipt's sha256."""
    failures: list[CheckFinding] = []
    checked: list[str] = []
    skipped: list[str] = []
    for name in (HTML_FILE, MD_FILE):
        path = folder / name
        if not path.exists() and not path.is_symlink():
            skipped.append(f"{name}: none beside the receipt")
            continue
        try:
            text = read_bounded_bytes(path, error=ReceiptError, what=name, max_bytes=MAX_REPORT_BYTES
                                      ).decode("utf-8", "replace")
        except ReceiptError as exc:
            failures.append(CheckFinding(kind=FindingKind.REPORT, message=exc.message))
            continue
        named = set(_STAMP.findall(text))
        if named == {digest}:
            checked.append(f"{name} was rendered from this receipt (sha256 {digest[:12]}...)")
        else:
            what = (f"names receipt sha256 {', '.join(sorted(d[:12] + '...' for d in named))}" if named
                    else "names no receipt sha256")
            failures.append(CheckFinding(
                kind=FindingKind.REPORT, message=f"{name} {what}, but receipt.json beside it has sha256 {digest[:12]}...: "
                                       "the report shows figures from another receipt (re-run remat receipt, or "
                                       "commit the report written with this receipt)"))
    return failures, checked, skipped


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
    if rev == b.revision:
        return [], []
    classes = {type(m).__qualname__ for m in module.modules()}
    mine = [d for d in fp_diffs if d.under(b.module, strictly=True) or (d.kind == "class" and d.name in classes)]
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
    compiled control (NOTE [compiled receipts]), a torch-budget plan too."""
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
    ledger.checked.append(f"equivalence{how}: {seeds} seed{'s' * (seeds != 1)} x {steps} "
                          f"step{'s' * (steps != 1)} + eval "
                          f"{'bitwise equal' if bitwise else 'within tolerance'}; negative controls rejected")


def _check_peak(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, plan: Plan) -> None:
    """4. the peak with the plan applied still clears budget x (1 - reserve) (bytes)."""
    d = receipt.decision
    limit = d.effective_budget_bytes
    peak = measure_plan(loaded, plan, warmup=receipt.settings.frontier_warmup, steps=0).peak_bytes
    if peak <= limit:
        ledger.checked.append(f"peak {mib(peak)} clears {mib(limit)} (receipt: {mib(d.shipped_peak_bytes)})")
        return
    names = ", ".join(b.module for b in plan.boundaries) or "no boundaries"
    ledger.failures.append(CheckFinding(
        kind=FindingKind.PEAK, boundary=plan.boundaries[0].module if len(plan.boundaries) == 1 else None,
        message=f"peak {mib(peak)} with the plan ({names}) no longer clears {mib(limit)} (budget "
                f"{mib(d.budget_bytes)} less the required {d.reserve:.0%} reserve); the receipt measured "
                f"{mib(d.shipped_peak_bytes)}"))


def _check_savings(ledger: CheckLedger, receipt: Receipt, loaded: LoadedWorkload, plan: Plan,
                   progress: ProgressFn) -> None:
    """5. each boundary's measured saving (bytes) has not fallen by more than its tolerance."""
    if not plan.boundaries:
        return
    _, savings = measure_savings(loaded, plan, warmup=receipt.settings.saving_warmup, progress=progress)
    ok = []
    for b in receipt.plan.boundaries:
        now = savings[b.module]
        floor = b.measured_saving_bytes - b.saving_tolerance * abs(b.measured_saving_bytes)
        if now < floor:
            ledger.failures.append(CheckFinding(
                kind=FindingKind.SAVING, boundary=b.module,
                message=f"boundary {b.module}: saves {mib(now)}, down from {mib(b.measured_saving_bytes)} "
                        f"(more than the {b.saving_tolerance:.0%} tolerance)"))
        else:
            ok.append(f"{b.module} {mib(now)}")
    if ok:
        ledger.checked.append(f"savings within tolerance: {', '.join(ok)}")


def check_receipt(receipt: Receipt, *, quick: bool = False, workload: str | None = None,
                  reports: tuple[Path, str] | None = None, cwd: Path | None = None,
                  progress: ProgressFn = no_progress) -> CheckReport:
    """Re-run what ``receipt`` names on the user's workload; the report lists every failure (module docstring).

    ``workload`` is the user's spec (``--workload``); without it, ``pyproject.toml``'s
    ``[tool.remat] workload`` in ``cwd``, or the receipt's when it is a built-in (NOTE
    [workload spec policy]). ``reports``: (the receipt's folder, the sha256 of its bytes), to
    check the reports beside it. Raises :class:`ReceiptError` when no workload is named or it
    cannot be loaded here; check failures are data (``report.passed``), for the CLI to turn
    into exit code 1.
    """
    chosen = choose_workload(receipt.context.workload, workload, cwd=cwd)
    ledger = CheckLedger(chosen.spec, quick, reports)
    if not _workload_is_the_receipts(ledger, receipt, chosen, cwd):
        return ledger.report()
    plan = _shipped_plan(ledger, receipt)
    if plan is None:
        return ledger.report()
    loaded = _load(receipt, chosen.spec)
    progress("check", 1, 5)
    _check_shape(ledger, receipt, chosen.spec)
    if not _check_model(ledger, receipt, loaded, plan):
        return ledger.report()
    progress("check", 2, 5)
    _check_equivalence(ledger, receipt, loaded, plan, progress)
    progress("check", 3, 5)
    if quick:
        ledger.skipped.append("peak and per-boundary savings not re-measured (--quick)")
        return ledger.report()
    _check_peak(ledger, receipt, loaded, plan)
    progress("check", 4, 5)
    _check_savings(ledger, receipt, loaded, plan, progress)
    progress("check", 5, 5)
    return ledger.report()
