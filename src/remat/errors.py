"""Typed errors. Library code raises these; only the CLI turns them into exit codes.

Exit codes (see NOTE [exit codes] in remat.cli.main):
  2  bad input: the user asked for something that cannot be done as asked, or the user's own
     code (workload factory, batch, loss, model, optimizer) raised: :class:`UserCodeError`
  1  a check ran and failed (verification, receipt check)
  4  a command ran past its time limit (``--timeout``): :class:`CheckTimeout`
  3  a remat bug: any other exception (as a RematError: a rank's, DistributedError; a child process's, ChildBug)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from typing import Iterator


class RematError(Exception):
    """Base of every error remat raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code: int = 2
    # A traceback worth showing with the message (the user's own code's, for UserCodeError;
    # a rank's, for DistributedError): the CLI prints it, escaped, after the message.
    traceback_text: str | None = None

    def __init__(self, message: str, *, tip: str | None = None) -> None:
        self.message = message
        self.tip = tip
        super().__init__(message if tip is None else f"{message}\nTip: {tip}")


class WorkloadError(RematError):
    """The workload spec, its factory, its shape keywords or its step is unusable."""


class UserCodeError(WorkloadError):
    """The workload's own code raised (its factory, ``batch``, ``loss``, model forward or backward,
    optimizer): exit 2, with that code's traceback (``traceback_text``) shown by the CLI.
    NOTE [exit codes] in remat.cli.main says how remat tells this from its own bugs."""

    def __init__(self, message: str, *, tip: str | None = None, traceback_text: str | None = None) -> None:
        super().__init__(message, tip=tip)
        self.traceback_text = traceback_text


class ShapeError(WorkloadError):
    """A ``--shape k=v,...`` string is malformed or names a keyword the factory lacks."""


class OutputError(RematError):
    """The output folder (``--out``) cannot take remat's files: it is a file, a dangling symlink,
    not writable, read-only, or the disk is full (checked up front, and again when writing)."""


class MemoryMeasurementError(RematError):
    """A memory source was asked for on a device that cannot provide it."""


class CandidateError(RematError):
    """A requested checkpoint candidate does not exist or cannot be wrapped."""


class BudgetError(RematError):
    """The budget is malformed or no plan can reach it (the message names the floor)."""


class DeviceTooSmall(BudgetError):
    """The step does not fit the device's capacity with any plan remat can make (exit 2): carries the
    capacity and the floor (bytes; None: no step was measured to plan from). NOTE [blocked step]."""

    LEVERS = ("offload saved activations to the host (remat.auto(offload=True) or remat plan --offload, with a host budget)",
              "a smaller micro-batch with gradient accumulation (remat.auto(accumulation_steps=...))",
              "sharding the parameters, gradients and optimizer state (FSDP2)")

    def __init__(self, message: str, *, capacity_bytes: int, floor_bytes: int | None) -> None:
        self.capacity_bytes = capacity_bytes
        self.floor_bytes = floor_bytes
        super().__init__(message, tip="levers left: " + "; ".join(self.LEVERS))


class PlanError(RematError):
    """A plan is malformed, or cannot be applied to this model."""


class HandleError(PlanError):
    """``ApplyHandle.remove()`` cannot restore every module exactly; nothing was changed."""


class FingerprintMismatch(PlanError):
    """A plan made for one model was applied to another; the message lists what differs."""


class VerificationFailed(RematError):
    """Verification ran and found a difference from the control, or a hazard."""

    exit_code = 1


class DistributedError(RematError):
    """A distributed run failed: a rank died, timed out, or the configuration is refused.

    ``exit_code`` is 3 when the first failing rank hit a remat bug (NOTE [exit codes])."""

    def __init__(self, message: str, *, tip: str | None = None, traceback_text: str | None = None,
                 internal: bool = False) -> None:
        super().__init__(message, tip=tip)
        self.traceback_text = traceback_text
        if internal:
            self.exit_code = 3


class StaleReportFormat(DistributedError):
    """A distributed run's report in a layout this remat no longer reads (exit 2): a pipeline report of its own
    layout (``sides``), before NOTE [one per-rank report]. The message names the command that makes it again."""


class ReceiptError(RematError):
    """A receipt file is malformed, hostile, or of an unknown schema version."""


class StaleReceiptFormat(ReceiptError):
    """A receipt in a format this remat no longer reads (exit 2): the old pipeline receipt kind
    (``remat-pipeline-receipt``). The message names the command that makes it again."""


class CheckFailed(RematError):
    """``remat check`` re-ran a receipt's fixtures and at least one failed."""

    exit_code = 1


class CheckTimeout(RematError):
    """A command would run, or ran, past its time limit (``--timeout``): nothing was decided.

    ``remat check`` also refuses up front a check its estimate puts past the limit; every
    command that runs a workload is stopped by the CLI's alarm (NOTE [exit codes])."""

    exit_code = 4


class WorkloadProcessDied(RematError):
    """The child process that ran the user's workload (``remat check``: NOTE [workload in a child process]
    in remat/workflow/child.py) died or exited before it reported its result (a factory calling
    ``os._exit(0)``, a segfault, a kill): nothing was decided, exit 2, naming the phase and how it ended."""


class ChildBug(RematError):
    """remat's own code raised an untyped exception in a child process: a remat bug (exit 3), its
    traceback (``traceback_text``) shown by the CLI."""

    exit_code = 3

    def __init__(self, message: str, *, tip: str | None = None, traceback_text: str | None = None) -> None:
        super().__init__(message, tip=tip)
        self.traceback_text = traceback_text


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (the CLI's handler raises it): a KeyboardInterrupt, so the same cleanup runs
    (temp files removed, distributed ranks stopped); the CLI exits 143. Not a RematError."""


class AutoError(RematError):
    """``remat.auto`` (or an integration built on it) cannot plan this model as it is called:
    under ``torch.no_grad``, a model already checkpointed by a wrapper (named), a batch without
    a loss, an optimizer it cannot rebuild on a copy."""


class NewShapeError(AutoError):
    """A model planned by ``remat.auto`` with ``on_new_shape='raise'`` was called at a shape larger
    than any it was planned for (NOTE [shape guard] in remat/autoplan/shapes.py)."""


class TrainableChangedError(AutoError):
    """A model planned by ``remat.auto`` with ``on_new_shape='raise'`` was called after parameters
    started or stopped training (NOTE [trainable guard] in remat/autoplan/shapes.py)."""


class JobFault(AutoError):
    """The ranks of a torchrun job cannot plan together in ``remat.auto`` (NOTE [job faults] in
    remat/autoplan/job.py): they called it with different models, example-batch shapes or budgets,
    a rank never called it, or a rank was lost while they planned. The message names the ranks and
    each one's value or error."""


# -- how a tip spells the options it names ------------------------------------------------------

class OptionStyle(enum.Enum):
    """Who a tip speaks to (NOTE [option spelling])."""

    FLAGS = "flags"         # the ``remat`` command: ``--reserve 1.2%``
    KEYWORDS = "keywords"   # a ``remat.auto`` caller (and the integrations built on it): ``reserve=0.012``


class Option(enum.Enum):
    """An option a tip tells the caller to change."""

    BUDGET = "budget"
    RESERVE = "reserve"
    PLANNER = "planner"
    CANDIDATES = "candidates"
    ALLOW_HAZARDS = "allow-hazards"
    SAMPLE_STEPS = "sample-steps"
    FSDP2 = "fsdp2"
    DEVICE_MEMORY = "device-memory"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spelling:
    """One option in both styles. ``keyword`` is None where ``remat.auto`` has none: ``instead`` then
    says in words what its caller changes."""

    flag: str                   # the command line's: "--reserve"
    keyword: str | None = None  # remat.auto's: "reserve"
    instead: str = ""           # words, for a remat.auto caller, where there is no keyword
    percent: bool = False       # the value is a fraction: the flag takes "1.2%", the keyword 0.012


SPELLINGS: dict[Option, Spelling] = {
    Option.BUDGET: Spelling(flag="--budget", keyword="budget"),
    Option.RESERVE: Spelling(flag="--reserve", keyword="reserve", percent=True),
    Option.PLANNER: Spelling(flag="--planner", keyword="planner"),
    Option.CANDIDATES: Spelling(flag="--candidates",
                                instead="split large modules into submodules, which remat.auto plans"),
    Option.ALLOW_HAZARDS: Spelling(flag="--allow-hazards",
                                   instead="remove the replay hazard, which remat.auto never plans unguarded"),
    Option.SAMPLE_STEPS: Spelling(flag="--sample-steps",
                                  instead="more example batches, remat.ExampleBatches(...)"),
    Option.DEVICE_MEMORY: Spelling(flag="--device-memory", keyword="device_memory"),
    Option.FSDP2: Spelling(flag="remat distributed --engine fsdp2",
                           instead="fully_shard the model, then call remat.auto"),
}

_STYLE: contextvars.ContextVar[OptionStyle] = contextvars.ContextVar("remat_option_style", default=OptionStyle.FLAGS)


@contextlib.contextmanager
def option_style(style: OptionStyle) -> Iterator[None]:
    """Tips built inside the block spell their options in ``style`` (NOTE [option spelling])."""
    token = _STYLE.set(style)
    try:
        yield
    finally:
        _STYLE.reset(token)


def spell(option: Option, value: str | float | None = None) -> str:
    """``option`` (set to ``value`` when given) as the caller writes it: ``--reserve 1.2%`` on the command
    line, ``reserve=0.012`` for remat.auto, or ``SPELLINGS``' words where remat.auto has no keyword.

    NOTE [option spelling]
    A tip names the option that would help, and the two front ends spell options differently: the
    command line as flags (``--planner greedy``), ``remat.auto`` as keywords (``planner="greedy"``),
    and several of the command's options (``--candidates``, ``--allow-hazards``, ``--sample-steps``)
    have no keyword at all, so a flag in an error raised to a ``remat.auto`` caller names something
    they cannot pass. The tips are built where the error is, deep in stages both front ends share
    (a planner, the MILP, the profile's sample, the closed loop), and the style is a fact about who
    called, not about the plan: threading it as a parameter through every planner and cost model would
    widen a dozen signatures for one word. So it is a context variable: ``FLAGS`` by default (the
    command, and library callers of the stages, who read the CLI's docs), ``KEYWORDS`` inside
    ``remat.auto``'s planning (``option_style`` in autoplan/run.py), read only here when a tip is built;
    ``SPELLINGS`` is the one table of both spellings.
    """
    s = SPELLINGS[option]
    if _STYLE.get() is OptionStyle.FLAGS:
        if value is None:
            return s.flag
        return f"{s.flag} {float(value) * 100:g}%" if s.percent else f"{s.flag} {value}"
    if s.keyword is None:
        return s.instead
    assert value is not None, f"{option}: remat.auto's keyword is spelled with its value"
    return f"{s.keyword}={float(value):g}" if s.percent else f'{s.keyword}="{value}"'
