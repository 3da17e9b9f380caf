"""``remat check``'s re-run on the user's workload, in a child process (NOTE [workload in a child process]
in workflow/child.py): the parent decides all that needs none of the user's code (``start_check``), the
child runs the rest (``rerun_check``) and sends back what it found as JSON (:class:`RerunPart`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Callable

from .._codec import JsonCodec, Len, Text, schema
from ..errors import ReceiptError, WorkloadProcessDied
from ..receipt.model import Receipt, load_receipt_with_digest
from ..types import ProgressFn, no_progress
from .._json import validate
from .check import CheckLedger, CheckReport, ReportStamps, check_receipt, rerun_check, start_check
from .child import ChildReporter, run_in_child
from .findings import CheckFinding
from .gate import GateSettings

ENTRY = "remat.workflow.check_child:rerun_in_child"
BUILDING = "building the workload (its factory)"
# what ``rerun_check`` does after each of its ("check", n, 7) progress reports: the phase a child that dies
# or hangs is named in (NOTE [workload in a child process])
AFTER_STEP = {1: "comparing the shape keywords", 2: "comparing the model with the receipt's",
              3: "running the paired steps (equivalence; the workload's batch, loss, model and optimizer)",
              4: "re-running at the receipt's world size, then measuring the peak", 5: "measuring the savings",
              6: "timing the plan against the control", 7: "sending the result"}
_LINES = 100_000

__all__ = ["RerunPart", "RerunRequest", "check_any_receipt", "check_receipt_in_child", "rerun_in_child"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RerunRequest(JsonCodec):
    """What the child re-derives the check from: the parent writes it (never a receipt), so it is trusted
    (read without a schema)."""

    receipt: str                 # receipt.json's path
    digest: str                  # the sha256 of the bytes the parent read: the child's must be the same
    quick: bool
    workload: str | None         # ``--workload`` as given
    cwd: str | None
    gate: dict[str, Any]         # the flags' GateSettings, field by field
    threads: int                 # torch intra-op threads, as the parent set them


@dataclasses.dataclass(frozen=True, kw_only=True)
class RerunPart(JsonCodec):
    """What the child's re-run added to the check's ledger (checked against its schema when read)."""

    failures: Annotated[list[CheckFinding], Len(_LINES)]
    checked: Annotated[list[Text], Len(_LINES)]
    skipped: Annotated[list[Text], Len(_LINES)]

    @classmethod
    def read(cls, data: Any) -> "RerunPart":
        validate(data, schema(cls), error=WorkloadProcessDied, what="the result of the workload's process")
        return cls.from_json(data)


def rerun_in_child(request: dict[str, Any], reporter: ChildReporter) -> dict[str, Any]:
    """The child's entry: the check decided again from the same inputs (nothing of the user's has run yet),
    then the re-run on the user's workload, with no deadline of its own (the parent keeps it)."""
    import torch
    req = RerunRequest.from_json(request)
    torch.set_num_threads(req.threads)
    receipt, digest = load_receipt_with_digest(req.receipt)
    if digest != req.digest:
        raise ReceiptError(f"{req.receipt} changed while remat check ran (sha256 {req.digest[:12]}... when it "
                           f"started, {digest[:12]}... now): nothing decided", tip="run remat check again")
    gate = dataclasses.replace(GateSettings(**req.gate), timeout_s=None)
    _, ready = start_check(receipt, quick=req.quick, workload=req.workload,
                           cwd=None if req.cwd is None else Path(req.cwd), gate=gate)
    if ready is None:   # pragma: no cover - the parent decided otherwise from the same inputs
        raise ReceiptError("remat check decided differently in its child process (did pyproject.toml change?)")
    ledger = CheckLedger(ready.spec, ready.quick, None)
    reporter.phase(BUILDING)

    def progress(what: str, done: int, total: int) -> None:
        reporter.progress(what, done, total)
        if what == "check" and done in AFTER_STEP:
            reporter.phase(AFTER_STEP[done])
    rerun_check(ledger, ready, progress=progress)
    return RerunPart(failures=ledger.failures, checked=ledger.checked, skipped=ledger.skipped).to_json()


def check_receipt_in_child(receipt: Receipt, *, path: Path, digest: str, quick: bool = False,
                           workload: str | None = None, reports: ReportStamps | None = None, cwd: Path | None = None,
                           gate: GateSettings | None = None, progress: ProgressFn = no_progress,
                           on_first_step: Callable[[], None] = lambda: None) -> CheckReport:
    """:func:`~remat.workflow.check.check_receipt` with its re-run on the user's workload in a child process
    (NOTE [workload in a child process]): the same report, and the same errors, but a child that dies or
    exits early raises :class:`~remat.errors.WorkloadProcessDied` (exit 2) and ``--timeout`` is kept from
    outside it (CheckTimeout, exit 4). ``path`` and ``digest``: the file ``receipt`` was read from, and the
    sha256 of its bytes (the child reads it again and refuses another)."""
    import torch
    gate = gate or GateSettings()
    ledger, ready = start_check(receipt, quick=quick, workload=workload, reports=reports, cwd=cwd, gate=gate)
    if ready is None:
        return ledger.report()
    request = RerunRequest(receipt=str(Path(path).absolute()), digest=digest, quick=quick, workload=workload,
                           cwd=None if cwd is None else str(cwd), gate=dataclasses.asdict(gate),
                           threads=torch.get_num_threads())
    result = run_in_child(ENTRY, request.to_json(), command="remat check", timeout_s=ready.deadline.timeout_s,
                          t0=ready.deadline.t0, progress=progress, on_first_step=on_first_step)
    part = RerunPart.read(result)
    ledger.failures += part.failures
    ledger.checked += part.checked
    ledger.skipped += part.skipped
    return ledger.report()


def check_any_receipt(receipt: Receipt, *, path: Path, digest: str, quick: bool = False, workload: str | None = None,
                      reports: ReportStamps | None = None, gate: GateSettings | None = None,
                      progress: ProgressFn = no_progress, on_first_step: Callable[[], None] = lambda: None) -> CheckReport:
    """``remat check``'s one path (NOTE [one receipt] in remat/receipt/model.py): a pipeline run's receipt is
    re-checked from this process (:func:`~remat.workflow.check.check_receipt`: its ranks are launched under
    torchrun, with the launcher's wall limit); every other receipt by :func:`check_receipt_in_child`."""
    if receipt.pipeline is not None:
        return check_receipt(receipt, quick=quick, workload=workload, reports=reports, gate=gate, progress=progress)
    return check_receipt_in_child(receipt, path=path, digest=digest, quick=quick, workload=workload, reports=reports,
                                  gate=gate, progress=progress, on_first_step=on_first_step)
