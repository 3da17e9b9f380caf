"""One ``remat.auto`` call in a torchrun job: every rank arrives, the ranks agree on what they plan,
and a fault names its rank.

NOTE [job faults]
``remat.auto`` on a model wrapped by FSDP2 / DDP runs every profiled step on all ranks at once
(NOTE [one plan per job] in autoplan/ranks.py), so a rank that is not doing what the others do
does not fail: it pairs its collectives with the wrong partner. Measured before this: ranks given
different models hung to the process group's timeout (the "ranks profiled different steps" check
ran after the profile); different example-batch shapes ended in ``InfeasibleBudget``, shapes never
named; different budgets were resolved silently to the smallest; a rank that never called
``remat.auto`` trained 6 optimizer steps on gradients mixed with remat's profiling steps before
the job died; and a rank killed mid-planning made the survivor raise ``UserCodeError: the
workload's loss raised RuntimeError: Connection closed by peer ... fix it there``, no rank named.

So, before any collective, each call (numbered per process: every rank calls ``remat.auto`` in
the same order) goes through three steps, on the job's c10d store (a key-value server, not a
collective, so nothing pairs wrongly while it waits):

1. *Arrival* (:meth:`JobCall.arrive`): each rank sets its key and waits for every rank's, at
   most ``arrival_timeout_s()`` (``ARRIVAL_TIMEOUT_S``, or ``$REMAT_AUTO_ARRIVAL_TIMEOUT`` in
   seconds); past it, :class:`~remat.errors.JobFault` names the ranks that never called. A rank
   that trains meanwhile blocks in its own first collective, with nobody to pair with.
2. *Agreement* (:meth:`JobCall.agree`): the ranks exchange the model's fingerprint, the example
   batches' shapes and dtypes, the budget, the reserve and the accumulation steps (:class:`JobInputs`) in one
   ``all_gather_object``, and every rank refuses at once, with every rank's value, where they differ.
3. *Faults during planning* (:meth:`JobCall.watch`): a rank whose own code raises records its error
   on the store before raising it; a rank whose collective fails because a peer is gone (gloo's
   "Connection closed by peer", a ``DistError``) records that it is alive, waits up to
   ``LOST_GRACE_S`` for the others to record theirs, and raises a ``JobFault`` naming each rank
   with its recorded error, and the ranks that recorded nothing (killed, crashed, out of host
   memory), instead of blaming the user's loss function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ..errors import JobFault
from .ranks import JobRanks

ARRIVAL_TIMEOUT_S = 300.0   # s: how long the first rank to call remat.auto waits for the others
# s: how long a survivor waits for the other survivors to record themselves; short, because torchrun's
# agent ends every rank with SIGTERM within about a second of the first one's exit
LOST_GRACE_S = 1.0
_ARRIVAL_ENV = "REMAT_AUTO_ARRIVAL_TIMEOUT"
# how a collective reads when its peer process is gone (gloo over TCP; NCCL raises DistError subclasses)
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "op.preamble.length",
              "NCCL communicator was aborted", "connection refused")

_calls = itertools.count()   # this process's remat.auto calls in a job, numbered alike on every rank


def arrival_timeout_s() -> float:
    """``ARRIVAL_TIMEOUT_S``, or ``$REMAT_AUTO_ARRIVAL_TIMEOUT`` (seconds, > 0)."""
    raw = os.environ.get(_ARRIVAL_ENV)
    if raw is None:
        return ARRIVAL_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise JobFault(f"${_ARRIVAL_ENV}={raw!r}: expected a number of seconds above 0")
    return value


def _shape(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
    return type(leaf).__name__


@dataclasses.dataclass(frozen=True)
class JobInputs:
    """What every rank must plan alike: one rank's ``remat.auto`` inputs, as comparable text."""

    model: str                         # the model's fingerprint digest (structure, shapes, dtypes), 16 hex digits
    batch_shapes: str                  # each example batch's tensor leaves, "(B, T) dtype; ...", batches by " | "
    budget: str                        # as given: "70%", "8GiB", bytes
    reserve: float                     # the reserve's fraction of the budget
    accumulation_steps: int            # micro-batches per optimizer step (NOTE [accumulated step])
    host_budget: str = "none"          # offload's host budget in bytes, "none" without offload (NOTE [auto offload])

    @classmethod
    def of(cls, fingerprint_digest: str, batches: list[Any], budget: str | int, reserve: float,
           accumulation_steps: int, host_budget_bytes: int | None = None) -> "JobInputs":
        shapes = " | ".join("; ".join(_shape(x) for x in tree_leaves(b)) for b in batches)
        return cls(model=fingerprint_digest[:16], batch_shapes=shapes, budget=str(budget), reserve=reserve,
                   accumulation_steps=accumulation_steps,
                   host_budget="none" if host_budget_bytes is None else str(host_budget_bytes))


_LABELS = {"model": ("models", "give every rank the same model, wrapped the same way, before remat.auto"),
           "batch_shapes": ("example-batch shapes", "pass remat.auto an example batch of the same shapes on every "
                            "rank (the job's largest micro-batch), or an ExampleBatches of the same shapes"),
           "budget": ("budgets", "pass the same budget= on every rank: it is per device (\"70%\" is of each "
                      "rank's own unplanned peak)"),
           "reserve": ("reserves", "pass the same reserve= on every rank"),
           "accumulation_steps": ("accumulation steps", "pass the same accumulation_steps= on every rank"),
           "host_budget": ("offload host budgets", "pass the same offload= on every rank (offload=True: half of "
                           "each node's physical memory, which differs between unlike nodes: state it, \"16GiB\")")}


def _peer_lost(exc: BaseException) -> BaseException | None:
    """The collective's error in ``exc`` (or in what it wraps) when it failed because another rank's
    process is gone; None when ``exc`` is something else (this rank's own error)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dist.DistError) or any(s in str(e) for s in _PEER_LOST):
            while e.__cause__ is not None and any(s in str(e.__cause__) for s in _PEER_LOST):
                e = e.__cause__   # the collective's own error, not a wrapper quoting it
            return e
        e = e.__cause__ or e.__context__
    return None


def _first_line(exc: BaseException) -> str:
    text = (str(getattr(exc, "message", None) or exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:300]}"


class JobCall:
    """One ``remat.auto`` call on every rank of a job (NOTE [job faults])."""

    def __init__(self, ranks: JobRanks) -> None:
        self.ranks = ranks
        self.call = next(_calls)
        self.store = dist.distributed_c10d._get_default_store()

    def _key(self, what: str, rank: int) -> str:
        return f"remat.auto/{self.call}/{what}/{rank}"

    def _has(self, what: str, rank: int) -> bool:
        return self.store.check([self._key(what, rank)])

    def arrive(self, timeout_s: float) -> None:
        """Wait until every rank has called (at most ``timeout_s``); JobFault naming the ranks that did not."""
        me, world = self.ranks.rank, self.ranks.world_size
        self.store.set(self._key("arrived", me), "1")
        try:
            self.store.wait([self._key("arrived", r) for r in range(world)], datetime.timedelta(seconds=timeout_s))
        except RuntimeError:   # DistStoreError: the wait timed out
            missing = [r for r in range(world) if not self._has("arrived", r)]
            if not missing:
                return
            raise JobFault(
                f"rank(s) {', '.join(map(str, missing))} of {world} did not call remat.auto within {timeout_s:.0f} s "
                f"of rank {me} (this process's call {self.call + 1}): one plan needs every rank, and a rank that "
                "trains meanwhile pairs its collectives with remat's profiling steps",
                tip=f"call remat.auto on every rank at the same point (after the wrapping, before the loop); "
                    f"${_ARRIVAL_ENV} sets the wait in seconds") from None

    def agree(self, mine: JobInputs) -> None:
        """Every rank's inputs equal, or JobFault (on every rank) listing each rank's value."""
        everyone: list[JobInputs] = self.ranks.gather(mine)
        for field in dataclasses.fields(JobInputs):
            values = [getattr(v, field.name) for v in everyone]
            if any(v != values[0] for v in values[1:]):
                label, tip = _LABELS[field.name]
                shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                raise JobFault(f"the ranks called remat.auto with different {label} ({shown}): one plan cannot "
                               "be agreed for them", tip=tip)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Planning, with a fault recorded on the store (this rank's error) or named (a lost peer)."""
        try:
            yield
        except Exception as exc:
            lost = _peer_lost(exc)
            if lost is not None:
                raise self._lost(lost) from exc
            self.store.set(self._key("failed", self.ranks.rank), _first_line(exc))
            raise

    def _lost(self, exc: BaseException) -> JobFault:
        me, world = self.ranks.rank, self.ranks.world_size
        self.store.set(self._key("alive", me), "1")
        others = [r for r in range(world) if r != me]
        deadline = time.monotonic() + LOST_GRACE_S
        while time.monotonic() < deadline and not all(self._has("failed", r) or self._has("alive", r) for r in others):
            time.sleep(0.1)
        failed = {r: self.store.get(self._key("failed", r)).decode() for r in others if self._has("failed", r)}
        silent = [r for r in others if r not in failed and not self._has("alive", r)]
        named = [f"rank {r} raised {why}" for r, why in failed.items()]
        if silent:
            named.append(f"rank(s) {', '.join(map(str, silent))} recorded no error (killed, crashed, or out of "
                         "host memory: their own logs say which)")
        who = "; ".join(named) or "every other rank is alive: a network fault between the ranks"
        return JobFault(f"rank {me} lost a peer while the ranks planned together in remat.auto: {who}. Rank {me}'s "
                        f"collective failed with {_first_line(exc)}",
                        tip="fix the failing rank (its error above, or its log) and start the job again; nothing "
                            "was applied to the model")


def job_call(ranks: JobRanks, inputs: JobInputs) -> JobCall:
    """Every rank arrived and agreed on ``inputs`` (NOTE [job faults]); the call to watch planning with."""
    call = JobCall(ranks)
    call.arrive(arrival_timeout_s())
    call.agree(inputs)
    return call
