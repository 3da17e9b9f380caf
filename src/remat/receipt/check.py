"""``check_receipt``: re-run the fixtures a receipt names and say what no longer holds.

What is checked, in order (``quick`` stops after 3):
1. the shape: every keyword of the factory, defaults included, as the receipt recorded it;
2. the model: each boundary's module still exists and its revision hash (class sources +
   parameter shapes) is unchanged; the whole-model fingerprint the plan is bound to;
3. equivalence: the receipt's paired-step fixture (same seeds, steps, tolerance), hazards
   and negative controls included (``remat.verify.verify_plan``);
4. the peak with the plan applied still clears budget x (1 - reserve);
5. each boundary's measured saving (NOTE [measured saving] in build.py) has not fallen by
   more than its stated tolerance.
If the model changed (2), 3-5 are skipped: the plan is bound to the model it was made
for, and the failure list already says what to do (re-run ``remat receipt``).

NOTE [workload spec policy]
``remat check`` re-runs the receipt's workload, so it imports the workload spec the
receipt names and calls its factory with the recorded shape keywords: that is the user's
own training code, by design. Nothing else in a receipt is executed, evaluated or
unpickled. Because a receipt is a file, the spec it names is held to a policy before
anything is imported: a built-in name; a ``file.py:fn`` inside the current working
directory (run check from the repository root); or a ``package.module:fn`` outside the
standard library and the libraries remat itself uses, naming a public Python function.
``--workload`` on the command line (which the user typed, so it is trusted) replaces the
receipt's spec.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import time
from pathlib import Path
from typing import Any

from ..apply.closed_loop import measure_plan
from ..errors import ReceiptError, WorkloadError
from ..profile import fingerprint, module_revision
from ..types import ProgressFn, no_progress
from ..verify import verify_plan
from ..workload import BUILTINS, LoadedWorkload, load_workload
from ..workload.loader import _resolve_factory
from ..units import mib
from .build import measure_savings
from .model import Receipt, resolved_shape

# Top-level packages a receipt may not name as its workload (besides the standard library).
_DENIED_PACKAGES = frozenset({"torch", "torchvision", "torchaudio", "numpy", "scipy", "matplotlib", "rich", "pip",
                              "setuptools", "pkg_resources", "pytest", "_pytest", "IPython", "jinja2"})
_REMAT_WORKLOADS = "remat.workload.builtins."



@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckFinding:
    """One thing that no longer holds. ``boundary`` names the module when it is about one."""

    kind: str               # "shape", "model", "equivalence", "peak", "saving", "decision"
    message: str
    boundary: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


# -- the workload spec policy ----------------------------------------------------------------------

def vet_workload_spec(spec: str, *, cwd: Path | None = None) -> str:
    """Refuse a receipt's workload spec that NOTE [workload spec policy] does not admit; return it."""
    if spec in BUILTINS:
        return spec
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr.isidentifier() or attr.startswith("_"):
        raise ReceiptError(f"the receipt's workload {spec!r} is not a built-in, file.py:fn or package.module:fn "
                           "naming a public function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        root = (cwd or Path.cwd()).resolve()
        path = (root / where).resolve() if not Path(where).is_absolute() else Path(where).resolve()
        if not path.is_relative_to(root):
            raise ReceiptError(f"the receipt's workload file {where!r} lies outside the working directory {root}",
                               tip="run remat check from the repository root, or name the workload yourself "
                                   "with --workload")
        if not path.is_file():
            raise ReceiptError(f"the receipt's workload file {where!r} does not exist here ({path})",
                               tip="run remat check from the directory remat receipt ran in, or pass --workload")
        return spec
    if where.startswith(_REMAT_WORKLOADS):
        return spec
    top = where.split(".")[0]
    if not all(part.isidentifier() for part in where.split(".")):
        raise ReceiptError(f"the receipt's workload module {where!r} is not a dotted module name")
    if top in sys.stdlib_module_names or top in _DENIED_PACKAGES or top == "remat":
        raise ReceiptError(f"the receipt names {spec!r} as its workload: a receipt may not call into {top!r}",
                           tip="workloads are the user's own factories; pass --workload to name one yourself")
    return spec


def _load(receipt: Receipt, spec: str, trusted: bool) -> LoadedWorkload:
    ctx = receipt.context
    try:
        if not trusted:
            vet_workload_spec(spec)
            factory = _resolve_factory(spec)
            if not inspect.isfunction(factory):
                raise ReceiptError(f"the receipt's workload {spec!r} is a {type(factory).__name__}, not a Python "
                                   "function returning remat.Workload")
        return load_workload(spec, dict(ctx.shape), device=ctx.device, dtype=ctx.dtype)
    except WorkloadError as exc:
        raise ReceiptError(f"the receipt's workload does not load here: {exc.message}",
                           tip=exc.tip or "run remat check where remat receipt ran, or pass --workload") from exc


# -- the checks ------------------------------------------------------------------------------------

def _shape_findings(receipt: Receipt, spec: str) -> list[CheckFinding]:
    try:
        now = resolved_shape(spec, receipt.context.shape)
    except WorkloadError as exc:  # pragma: no cover - the same spec just loaded
        return [CheckFinding(kind="shape", message=f"cannot read the factory's shape keywords: {exc.message}")]
    then = receipt.context.resolved_shape
    out = []
    for k in sorted(then.keys() | now.keys()):
        if then.get(k, "<absent>") != now.get(k, "<absent>"):
            out.append(CheckFinding(kind="shape", message=f"shape keyword {k}: {then.get(k, '<absent>')} -> "
                                                          f"{now.get(k, '<absent>')} (the receipt's figures were "
                                                          f"measured at {then.get(k, '<absent>')})"))
    return out


def _model_findings(receipt: Receipt, loaded: LoadedWorkload) -> list[CheckFinding]:
    model = loaded.workload.model
    named = dict(model.named_modules(remove_duplicate=False))
    plan = receipt.plan.plan
    assert plan is not None
    fp_diffs = plan.fingerprint.differences(fingerprint(model))
    out: list[CheckFinding] = []
    explained: set[str] = set()
    for b in receipt.plan.boundaries:
        if b.module not in named:
            close = difflib.get_close_matches(b.module, list(named), n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            out.append(CheckFinding(kind="model", boundary=b.module,
                                    message=f"boundary {b.module} ({b.class_name}): the module is gone{hint}"))
            explained.update(d for d in fp_diffs if b.module in d)
            continue
        module = named[b.module]
        rev = module_revision(module)
        if rev != b.revision:
            classes = {type(m).__qualname__ for m in module.modules()}
            mine = [d for d in fp_diffs if f" {b.module}." in f" {d.split(' ', 1)[-1]}"
                    or any(f"class {c} " in d for c in classes)]
            explained.update(mine)
            why = "; ".join(mine[:4]) or "its class source or parameter shapes changed"
            out.append(CheckFinding(kind="model", boundary=b.module,
                                    message=f"boundary {b.module} ({b.class_name}): revision {b.revision} -> {rev} "
                                            f"({why})"))
    rest = [d for d in fp_diffs if d not in explained]
    if rest:
        shown = "; ".join(rest[:6]) + (f"; ... {len(rest) - 6} more" if len(rest) > 6 else "")
        out.append(CheckFinding(kind="model", message=f"the model changed outside the boundaries: {shown}"))
    return out


def check_receipt(receipt: Receipt, *, quick: bool = False, workload: str | None = None,
                  progress: ProgressFn = no_progress) -> CheckReport:
    """Re-run what ``receipt`` names on its workload; the report lists every failure (module docstring).

    ``workload`` replaces the receipt's spec (NOTE [workload spec policy]). Raises
    :class:`ReceiptError` when the workload cannot be loaded here; check failures are data
    (``report.passed``), for the CLI to turn into exit code 1.
    """
    t0 = time.perf_counter()
    spec = workload or receipt.context.workload
    failures: list[CheckFinding] = []
    checked: list[str] = []
    skipped: list[str] = []

    def done() -> CheckReport:
        return CheckReport(passed=not failures, quick=quick, workload=spec, failures=failures, checked=checked,
                           skipped=skipped, wall_s=time.perf_counter() - t0)

    d = receipt.decision
    plan = receipt.plan.plan
    if d.status != "ship" or plan is None:
        failures.append(CheckFinding(kind="decision", message="the receipt ships no plan: " + (d.why[0] if d.why else "")))
        return done()
    loaded = _load(receipt, spec, trusted=workload is not None)
    progress("check", 1, 5)
    shape = _shape_findings(receipt, spec)
    failures += shape
    if not shape:
        checked.append(f"shape unchanged ({', '.join(f'{k}={v}' for k, v in receipt.context.resolved_shape.items())})")
    model = _model_findings(receipt, loaded)
    failures += model
    if not plan.boundaries:
        checked.append("the receipt ships no checkpointing: no boundary to re-check")
    elif not model:
        checked.append(f"{len(plan.boundaries)} boundary revision{'s' * (len(plan.boundaries) != 1)} unchanged: "
                       + ", ".join(f"{b.module} {b.revision}" for b in receipt.plan.boundaries))
    if model:
        skipped.append("equivalence, peak and savings not re-run: the model is not the one the receipt was made "
                       "for (re-run remat receipt)")
        return done()
    progress("check", 2, 5)

    # 3. equivalence: the fixture the receipt names
    if plan.boundaries:
        fx = receipt.plan.boundaries[0].fixture
        report = verify_plan(loaded, plan, steps=fx.steps, seeds=len(fx.seeds), timing_steps=0, progress=progress)
        if report.passed:
            bitwise = all(s.bitwise for s in report.per_step)
            checked.append(f"equivalence: {len(fx.seeds)} seed{'s' * (len(fx.seeds) != 1)} x {fx.steps} "
                           f"step{'s' * (fx.steps != 1)} + eval "
                           f"{'bitwise equal' if bitwise else 'within tolerance'}; negative controls rejected")
        else:
            blamed = report.first_divergent_module
            owner = next((b.module for b in receipt.plan.boundaries
                          if blamed and (blamed == b.module or blamed.startswith(b.module + "."))), None)
            for f in report.failures:
                failures.append(CheckFinding(kind="equivalence", boundary=owner, message=f))
    progress("check", 3, 5)
    if quick:
        skipped.append("peak and per-boundary savings not re-measured (--quick)")
        return done()

    # 4. the peak still clears the reserve
    limit = d.effective_budget_bytes
    peak = measure_plan(loaded, plan, warmup=receipt.settings.frontier_warmup, steps=0).peak_bytes
    names = ", ".join(b.module for b in plan.boundaries) or "no boundaries"
    if peak > limit:
        failures.append(CheckFinding(
            kind="peak", boundary=plan.boundaries[0].module if len(plan.boundaries) == 1 else None,
            message=f"peak {mib(peak)} with the plan ({names}) no longer clears {mib(limit)} (budget "
                    f"{mib(d.budget_bytes)} less the required {d.reserve:.0%} reserve); the receipt measured "
                    f"{mib(d.shipped_peak_bytes)}"))
    else:
        checked.append(f"peak {mib(peak)} clears {mib(limit)} (receipt: {mib(d.shipped_peak_bytes)})")
    progress("check", 4, 5)

    # 5. per-boundary savings
    if plan.boundaries:
        _, savings = measure_savings(loaded, plan, warmup=receipt.settings.saving_warmup, progress=progress)
        ok = []
        for b in receipt.plan.boundaries:
            now = savings[b.module]
            floor = b.measured_saving_bytes - b.saving_tolerance * abs(b.measured_saving_bytes)
            if now < floor:
                failures.append(CheckFinding(
                    kind="saving", boundary=b.module,
                    message=f"boundary {b.module}: saves {mib(now)}, down from {mib(b.measured_saving_bytes)} "
                            f"(more than the {b.saving_tolerance:.0%} tolerance)"))
            else:
                ok.append(f"{b.module} {mib(now)}")
        if ok:
            checked.append(f"savings within tolerance: {', '.join(ok)}")
    progress("check", 5, 5)
    return done()
