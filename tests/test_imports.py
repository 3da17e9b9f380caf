"""Import cost and API surface (NOTE [import cost] in remat._lazy): the plan stage imports without
torch, numpy or scipy; ``remat`` lists and resolves every public name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import remat

SRC = Path(__file__).resolve().parents[1] / "src"
HEAVY = ("torch", "numpy", "scipy")


def loaded_modules(statement: str, *, site: bool) -> set[str]:
    """The top-level packages in ``sys.modules`` after ``statement`` runs in a fresh python. Without
    ``site`` (``python -S``) nothing installed is importable: torch, numpy and scipy are not."""
    code = f"import sys; sys.path.insert(0, {str(SRC)!r}); {statement}; print(__import__('json').dumps(sorted(sys.modules)))"
    res = subprocess.run([sys.executable, *([] if site else ["-S"]), "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return {name.split(".")[0] for name in json.loads(res.stdout)}


@pytest.mark.parametrize("module", ["remat", "remat.plan", "remat.profile.model", "remat.measure.compile_spec",
                                    "remat.frontier.capacity"])
def test_module_imports_without_torch_numpy_scipy(module):
    """Under ``python -S`` (none of the three importable) the import succeeds and loads none of them."""
    loaded = loaded_modules(f"import {module}", site=False)
    assert "remat" in loaded
    assert not loaded & set(HEAVY)


def test_the_probe_sees_torch_where_it_is_loaded():
    """The detector works: the profiler's measuring module does load torch, and under ``-S`` cannot."""
    assert "torch" in loaded_modules("import remat.profile.step", site=True)
    with pytest.raises(AssertionError, match="No module named 'torch'"):
        loaded_modules("import remat.profile.step", site=False)


def test_numpy_loads_when_a_planner_runs():
    """The plan stage's numpy is deferred, not gone: the first cost-model arithmetic imports it."""
    stmt = "import remat.plan.cost as c; assert 'numpy' not in sys.modules; c.np.zeros(1)"
    assert "numpy" in loaded_modules(stmt, site=True)


def test_dir_lists_the_lazy_names_and_every_public_name_resolves():
    assert "auto" in dir(remat) and "ApplyHandle" in dir(remat)
    assert set(remat._LAZY) <= set(remat.__all__)
    for name in remat.__all__:
        assert getattr(remat, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        remat.nope


def test_result_types_users_receive_are_exported():
    from remat.autoplan import AutoHandle
    from remat.profile import ProfileReport
    from remat.wrap import ApplyHandle, PlanCheckFn
    assert (remat.ApplyHandle, remat.AutoHandle, remat.ProfileReport, remat.PlanCheckFn) == (
        ApplyHandle, AutoHandle, ProfileReport, PlanCheckFn)


@pytest.mark.parametrize("package", ["remat.profile", "remat.measure", "remat.frontier"])
def test_stage_packages_list_and_resolve_their_lazy_names(package):
    import importlib
    mod = importlib.import_module(package)
    assert set(mod.__all__) <= set(dir(mod))
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


def test_profile_fingerprint_is_the_function_not_the_submodule():
    """``fingerprint`` names both a function and a submodule of remat.profile: it stays the function
    whichever is imported first (NOTE [import cost])."""
    import remat.profile.fingerprint  # noqa: F401  (the submodule)
    from remat.profile import fingerprint
    assert callable(fingerprint) and fingerprint.__name__ == "fingerprint"
