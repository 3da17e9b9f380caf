"""The plan cache never stops a run, and a hit is re-validated (issue 41, item 5).

Storing: a full disk (the atomic write's ``OSError(ENOSPC)``, and the typed ``OutputError`` it
becomes) and any other error while storing are a warning, and the plan this call made is applied
(``cache: not-stored``); ``cache_dir=""`` is refused up front (AutoError), never ``./plans/``.
A hit is checked against its key (NOTE [cache hit re-validated] in remat/autoplan/cache.py): a
poisoned entry (no boundary for a step that needs some, another budget's plan, a module the model
lacks, another model's fingerprint, simulated figures, a peak over its budget) is a miss with a
warning naming why, re-planned and replaced; the entry as stored (the safe twin) is a hit.

Fast: the example's tiny LM (it needs checkpoints under 75% of its peak), first replay estimates,
one planned entry per module reused by every poisoning test.
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

import remat
from remat.autoplan import (BrokenCacheEntryWarning, CacheStatus, PlanCacheWarning, StaleCacheEntryWarning,
                            UnusableCacheDirWarning)
from remat.errors import AutoError, OutputError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import auto_plain_loop as ex  # noqa: E402

BUDGET = "75%"
FAST = dict(measure_replays=False)


def tiny():
    cfg = ex.SIZES["tiny"]
    torch.manual_seed(0)
    model = ex.TinyLM(cfg["vocab"], cfg["d"], cfg["layers"])
    t = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=torch.Generator().manual_seed(0))
    return model, (t[:, :-1], t[:, 1:])


def _auto(cache_dir, budget=BUDGET, **kw) -> remat.AutoHandle:
    model, batch = tiny()
    handle = remat.auto(model, batch, budget=budget, loss_fn=ex.loss_fn, cache_dir=cache_dir, **{**FAST, **kw})
    handle.remove()
    return handle


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[Path, remat.Plan, remat.AutoHandle]:
    """One entry planned under 75% (it has boundaries), kept as the pristine copy each test poisons."""
    root = tmp_path_factory.mktemp("cache")
    first = _auto(root)
    assert first.report.cache is CacheStatus.STORED and first.plan.boundaries, "the tiny LM needs checkpoints"
    path = Path(first.report.cache_path)
    return path, remat.Plan.load(path), first


def _fresh_cache(stored, tmp_path: Path) -> Path:
    """A cache dir holding a copy of the pristine entry (same key: same file name)."""
    path, _, _ = stored
    target = tmp_path / "plans" / path.name
    target.parent.mkdir(parents=True)
    shutil.copy(path, target)
    return target


# -- storing never stops a run -------------------------------------------------------------------

def _disk_full(monkeypatch, exc: BaseException) -> None:
    """Every atomic write the plan cache makes fails with ``exc``."""
    def full(path, obj):
        raise exc
    monkeypatch.setattr(remat.Plan, "save", lambda self, path: full(path, self.to_json()))


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"),
                                 OutputError("cannot write plans/x.json: No space left on device",
                                             tip="free some space")],
                         ids=["OSError-ENOSPC", "OutputError"])
def test_a_full_disk_is_a_warning_and_the_plan_is_applied(exc, monkeypatch, tmp_path, stored):
    _disk_full(monkeypatch, exc)
    model, batch = tiny()
    with pytest.warns(UnusableCacheDirWarning, match="No space left on device"):
        h = remat.auto(model, batch, budget=BUDGET, loss_fn=ex.loss_fn, cache_dir=tmp_path, **FAST)
    assert h.report.cache is CacheStatus.NOT_STORED and h.active and h.wrappers, "the plan is applied all the same"
    assert h.plan.boundaries
    h.remove()


def test_a_full_disk_through_the_real_atomic_write(monkeypatch, tmp_path):
    """The write itself fails (os.write of the temp file): the OutputError the atomic write raises is
    caught, no temp file is left, the plan applied."""
    import remat._io as io
    real_fdopen = io.os.fdopen

    class Full:
        def __init__(self, f): self.f = f
        def __enter__(self): return self
        def __exit__(self, *a): self.f.close()
        def write(self, data): raise OSError(errno.ENOSPC, "No space left on device")
        def flush(self): pass
        def fileno(self): return self.f.fileno()
    monkeypatch.setattr(io.os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    with pytest.warns(UnusableCacheDirWarning, match="OutputError.*No space left"):
        h = _auto(tmp_path)
    assert h.report.cache is CacheStatus.NOT_STORED and h.plan.boundaries
    assert not list((tmp_path / "plans").glob("*")), "a half-written entry was left behind"


def test_any_other_error_storing_is_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(remat.Plan, "save", lambda self, path: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.warns(PlanCacheWarning, match="ValueError: boom"):
        h = _auto(tmp_path)
    assert h.report.cache is CacheStatus.NOT_STORED and h.plan.boundaries


@pytest.mark.parametrize("empty", ["", "   "])
def test_empty_cache_dir_is_refused_before_planning(empty, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AutoError, match="names no folder") as info:
        _auto(empty)
    assert "use_cache=False" in (info.value.tip or "")
    assert not (tmp_path / "plans").exists(), "cache_dir='' wrote ./plans/"
    # the safe twin: a folder named relative to the current directory is a cache there, as asked
    h = _auto("rel-cache")
    assert h.report.cache is CacheStatus.STORED and (tmp_path / "rel-cache" / "plans").is_dir()


# -- a hit is re-validated -----------------------------------------------------------------------

def test_the_entry_as_stored_is_a_hit(stored, tmp_path):
    """The safe twin of every poisoning below: the pristine entry hits, with no warning."""
    entry = _fresh_cache(stored, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanCacheWarning)
        h = _auto(tmp_path)
    assert h.report.cache is CacheStatus.HIT and h.report.cache_path == str(entry)
    assert [b.module for b in h.plan.boundaries] == [b.module for b in stored[1].boundaries]


def _poisoned_is_a_miss(stored, tmp_path: Path, poison, match: str, warning=StaleCacheEntryWarning) -> None:
    entry = _fresh_cache(stored, tmp_path)
    _, own, first = stored
    poison(own).save(entry)
    with pytest.warns(warning, match=match) as record:
        h = _auto(tmp_path)
    assert any(entry.name in str(w.message) for w in record), "the warning names the file"
    assert h.report.cache is CacheStatus.STORED, "a poisoned entry was applied"
    assert h.plan.boundaries and h.report.budget_bytes == first.report.budget_bytes
    assert remat.Plan.load(entry).budget_bytes == own.budget_bytes, "the entry was not replaced"


def test_empty_boundaries_are_a_miss(stored, tmp_path):
    """No boundary, the old figures kept: the unplanned step it records does not fit its budget."""
    _poisoned_is_a_miss(stored, tmp_path, lambda p: dataclasses.replace(p, boundaries=[]), "checkpoints nothing")


def test_another_budgets_plan_is_a_miss(stored, tmp_path):
    """A plan made for 50% filed under the 75% key (its budget_bytes is 50% of its own baseline)."""
    def other_budget(p):
        return dataclasses.replace(p, budget_bytes=p.baseline_peak_bytes // 2)
    _poisoned_is_a_miss(stored, tmp_path, other_budget, r"its budget is \d+ bytes, and the call's budget '75%'")


def test_an_absolute_budget_plan_under_another_amount_is_a_miss(stored, tmp_path):
    """The key's budget is an amount: the entry's must be that amount exactly."""
    _, own, _ = stored
    amount = own.budget_bytes + 4096
    first = _auto(tmp_path, budget=amount)
    entry = Path(first.report.cache_path)
    dataclasses.replace(remat.Plan.load(entry), budget_bytes=own.budget_bytes).save(entry)
    with pytest.warns(StaleCacheEntryWarning, match=rf"call's budget {amount} is {amount} bytes"):
        h = _auto(tmp_path, budget=amount)
    assert h.report.cache is CacheStatus.STORED and h.report.budget_bytes == amount
    assert _auto(tmp_path, budget=amount).report.cache is CacheStatus.HIT   # the replaced entry: a hit


def test_a_peak_over_its_budget_is_a_miss(stored, tmp_path):
    def over(p):
        return dataclasses.replace(p, measured_peak_bytes=p.budget_bytes + 1)
    _poisoned_is_a_miss(stored, tmp_path, over, "over its budget")


def test_simulated_figures_are_a_miss(stored, tmp_path):
    def simulated(p):
        return dataclasses.replace(p, simulated=True, memory_source=remat.MemorySource.SIMULATED)
    _poisoned_is_a_miss(stored, tmp_path, simulated, "simulated")


def test_another_reserve_is_a_miss(stored, tmp_path):
    _poisoned_is_a_miss(stored, tmp_path, lambda p: dataclasses.replace(p, reserve=0.5), "reserve 0.5")


def test_a_module_the_model_lacks_is_a_miss(stored, tmp_path):
    from remat.plan import Boundary
    missing = Boundary(module="blocks.99", mode=remat.CheckpointMode.FULL, saved_bytes=0, replay_ms=0.0)
    _poisoned_is_a_miss(stored, tmp_path, lambda p: dataclasses.replace(p, boundaries=[*p.boundaries, missing]),
                        "CandidateError", warning=BrokenCacheEntryWarning)


def test_another_models_fingerprint_is_a_miss(stored, tmp_path):
    from remat.profile import fingerprint
    other = fingerprint(torch.nn.Sequential(torch.nn.Linear(3, 3))).digest
    _poisoned_is_a_miss(stored, tmp_path, lambda p: dataclasses.replace(
        p, fingerprint=dataclasses.replace(p.fingerprint, digest=other)), "FingerprintMismatch",
        warning=BrokenCacheEntryWarning)


def _key(plan: remat.Plan, budget: str) -> "remat.autoplan.CacheKey":
    from remat.autoplan import CacheKey
    return CacheKey(fingerprint=plan.fingerprint.digest, state="s", trainable="t", training=True, batch=[],
                    budget=budget, reserve=plan.reserve, planner="optimal", segments=True, loss="l", optimizer=[],
                    device="cpu", torch_version="t", remat_version="r")


def test_a_device_fit_entry_is_checked_against_the_capacity(stored):
    """Without a budget the plan's budget is the device's capacity: a stated one exactly, free memory to
    the key's 256 MiB; the entry made for another capacity is stale (unit level: no planning)."""
    from remat.autoplan.cache import stale_entry
    _, own, _ = stored
    cap = own.budget_bytes
    key = _key(own, "None")
    check = dict(budget=None, device_type="cpu", job=False)
    assert stale_entry(own, key, capacity_bytes=cap, capacity_stated=True, **check) is None
    assert "its budget is" in stale_entry(own, key, capacity_bytes=cap + 1, capacity_stated=True, **check)
    # free memory: the same 256 MiB bucket is a hit, the next one a miss
    big = dataclasses.replace(own, budget_bytes=(5 << 28) + 12345)
    assert stale_entry(big, key, capacity_bytes=(5 << 28) + 999, capacity_stated=False, **check) is None
    assert stale_entry(big, key, capacity_bytes=6 << 28, capacity_stated=False, **check) is not None
    # a CUDA call never takes CPU figures
    assert "not an instrument of a cuda device" in stale_entry(own, key, capacity_bytes=cap, capacity_stated=True,
                                                              budget=None, device_type="cuda", job=False)


def test_the_key_digest_reads_the_engine_by_its_value(stored):
    """The engine is a JobEngine in the key; its digest is the sha256 of the key's JSON with the engine's
    value, so entries written when the field was the string keep their names (hand-computed digest);
    another engine names another entry."""
    import hashlib
    import json
    from remat.autoplan.inplace import JobEngine
    _, own, _ = stored
    key = dataclasses.replace(_key(own, "60%"), engine=JobEngine.DDP)
    as_written = {**dataclasses.asdict(key), "engine": "ddp"}
    assert key.digest == hashlib.sha256(json.dumps(as_written, sort_keys=True, default=str).encode()).hexdigest()
    assert key.digest != dataclasses.replace(key, engine=JobEngine.FSDP2).digest
