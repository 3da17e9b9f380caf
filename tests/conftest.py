"""Shared test fixtures: tiny shapes so the suite fits a 2-core CI budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"

# Tiny shapes for the built-ins (same code paths as the defaults, a fraction of the time).
TINY = {
    "gpt": {"batch_size": 2, "seq_len": 16, "n_layer": 2, "d_model": 32, "n_head": 2, "vocab": 64},
    "cnn": {"batch_size": 4, "image_size": 8, "width": 8, "blocks_per_stage": 1},
    "mlp": {"batch_size": 8, "width": 32, "depth": 4, "d_in": 8},
}


@pytest.fixture(autouse=True, scope="session")
def _own_cache_dir(tmp_path_factory):
    """A cache folder of this test session's own (per pytest-xdist worker): tests never read or write the
    user's ~/.cache/remat, and two workers never share an entry. A test that names ``cache_dir`` or sets
    $REMAT_CACHE_DIR itself still wins."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.mktemp("remat-cache")))   # remat._io.CACHE_ENV_VAR
        yield


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _no_time_race(monkeypatch):
    """No time race by default (NOTE [time race]): its verdict rests on timings, so a plan a test checks would
    depend on the machine's load; tests/test_time_race.py races with injected timings."""
    monkeypatch.setenv("REMAT_TIME_RACE", "0")   # remat.closed_loop.RACE_ENV_VAR (not imported: no torch here)


@pytest.fixture
def cpu_tracker(monkeypatch):
    """CPU peaks from the live-tensor tracker, not the allocator counter (NOTE [CPU allocator counter]):
    for tests whose subject is the tracker itself."""
    from remat.memory.allocator import ENV_VAR
    monkeypatch.setenv(ENV_VAR, "tracker")


def counter_available() -> bool:
    from remat.memory.allocator import counter_status
    return counter_status().available


def hand_plan(model, paths, *, mode=None, guarded: bool = False, preserve_rng_state: bool = True):
    """A Plan written by hand (no profiler, no planner): for tests of apply and verify."""
    from remat.plan import Boundary, Plan
    from remat.profile import fingerprint
    from remat.types import CheckpointMode
    mode = mode or CheckpointMode.FULL
    return Plan(planner="all", budget_bytes=None, reserve=0.0,
                boundaries=[Boundary(module=p, mode=mode, saved_bytes=0, replay_ms=0.0, guarded=guarded) for p in paths],
                excluded=[], predicted_peak_bytes=0, predicted_overhead_ms=0.0, baseline_peak_bytes=0,
                baseline_step_ms=0.0, fingerprint=fingerprint(model), preserve_rng_state=preserve_rng_state)


def cuda_only():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where no CUDA device is (CI's CPU machines); on a GPU they run."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m cuda on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
