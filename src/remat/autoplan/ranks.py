"""The ranks of a torchrun job agreeing on one plan (``remat.auto`` after FSDP2 / DDP).

NOTE [one plan per job]
Called after ``fully_shard`` or DDP inside an initialised default process group, ``remat.auto``
runs on every rank, and every profiled or measured step runs on all of them at once (their
collectives pair up), so the ranks must take the same decisions in the same order, or one waits
in a collective the others never enter. That holds by construction, not by luck:

* before any collective, every rank has arrived and the ranks agree on the model, the example
  batches' shapes and the budget (NOTE [job faults] in autoplan/job.py);
* the profile's own control flow depends on the model and the batch's shapes only, never on a
  rank-local time (``measure_replays`` is off in a job: it repeats a region until its timings
  settle, which is a per-rank decision; the dry runs group and narrow by figures agreed over the
  ranks: NOTE [dry runs in a job] in profile/shared.py); when it is done, the ranks' profiles are reduced into one
  (:func:`agree_profile`): bytes by their maximum (the plan must fit the fullest rank), times by
  their median (replay timings are noise: identical layers measured 32.7, 20.7 and 7.25 ms);
* the budget is per device: ``"70%"`` is 70% of each rank's own unplanned peak, and the plan
  must fit the smallest of the ranks' budgets (:meth:`JobRanks.min_bytes`);
* the closed loop measures each plan on every rank, and ``remat.measure`` replaces the measured
  peak by its maximum and the step times by their medians over the ranks
  (``LoadedWorkload.ranks``) before anything reads them;
* the plan the loop returns is broadcast from rank 0 (``broadcast_object_list``) and that plan
  is the one every rank applies; ``report.plan_digest`` (sha256 of its JSON) is equal on every
  rank;
* the plan cache is keyed by world size and engine too, and a hit counts only when it is a hit
  on every rank (:meth:`JobRanks.all_true`); otherwise all ranks plan again, together.

Objects travel with ``all_gather_object`` over the default group (gloo or NCCL; small: a
profile's JSON is kilobytes).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..percentile import p50
from ..errors import AutoError
from ..profile.model import ProfileReport


class JobRanks:
    """The default process group's ranks as a :class:`~remat.types.RankReduce` (NOTE [one plan per job])."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (a collective: every rank calls it)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def max_bytes(self, value: int) -> int:
        return max(self.gather(int(value)))

    def min_bytes(self, value: int) -> int:
        return min(self.gather(int(value)))

    def median_ms(self, values: list[float]) -> list[float]:
        """Element by element, the median over the ranks of each rank's list (all the same length)."""
        lists = self.gather([float(v) for v in values])
        if len({len(v) for v in lists}) != 1:
            raise AutoError(f"the ranks timed different numbers of steps ({[len(v) for v in lists]}): "
                            "they did not run the same measurement")
        return [p50(col) for col in zip(*lists)]

    def all_true(self, flag: bool) -> bool:
        return all(self.gather(bool(flag)))

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (``broadcast_object_list``)."""
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def job_ranks() -> JobRanks | None:
    """The job's ranks when a default process group is initialised (world size 1 too); else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return JobRanks()


def agree_profile(report: ProfileReport, ranks: JobRanks) -> ProfileReport:
    """One profile from every rank's (NOTE [one plan per job]): integers (bytes, counts) by their
    maximum, floats (ms) by their median; everything else must be equal on every rank."""
    profiles = ranks.gather(report.to_json())
    rows = _union_of_rows([p.pop("rows") for p in profiles])
    merged = _merge(profiles, "profile")
    merged["rows"] = rows
    return ProfileReport.from_json(merged)


def _union_of_rows(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every rank's peak rows (NOTE [peak cost model]), one per signature (who is held, who replays) at
    the largest bytes any rank saw there. The signatures are instants of a rank's own step, and a
    rank's backward interleaves its collectives a little differently (one rank's backward of a
    segment met the other's "2 candidates held"), so a signature one rank lacks is still a constraint
    the plan must meet on the rank that has it: the union, never the intersection."""
    best: dict[tuple, dict[str, Any]] = {}
    for rows in per_rank:
        for row in rows:
            key = (tuple(row["live"]), tuple(row["replaying"]))
            if key not in best or row["base_bytes"] > best[key]["base_bytes"]:
                best[key] = row
    return [best[k] for k in sorted(best)]


def _merge(values: list[Any], where: str) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = _equal([sorted(v) if isinstance(v, dict) else v for v in values], f"{where} keys")
        return {k: _merge([v[k] for v in values], f"{where}.{k}") for k in keys}
    if isinstance(first, list):
        _equal([len(v) if isinstance(v, list) else v for v in values], f"{where} length")
        return [_merge([v[i] for v in values], f"{where}[{i}]") for i in range(len(first))]
    return _merge_leaf(values, where)


def _merge_leaf(values: list[Any], where: str) -> Any:
    """Integers (bytes, counts) by the maximum, floats (ms) by the median, anything else equal."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if not all(number(v) for v in values):
        return _equal(values, where)
    if all(isinstance(v, int) for v in values):
        return max(values)
    return p50(float(v) for v in values)


def _equal(values: list[Any], where: str) -> Any:
    if any(v != values[0] for v in values[1:]):
        shown = ", ".join(f"rank {i}: {str(v)[:60]}" for i, v in enumerate(values[:4]))
        raise AutoError(f"the ranks profiled different training steps ({where} differs: {shown}): one plan "
                        "cannot be agreed for them",
                        tip="give every rank the same model and an example batch of the same shapes")
    return values[0]
