"""What a ``remat.auto`` caller reads in an error: its own keywords, never the command line's flags
(NOTE [option spelling] in remat/errors.py), and every error class it may meet importable from ``remat``.

Each refusal is driven through ``remat.auto`` and, as its twin, through ``remat plan``, which keeps
the flag spelling. The expected spellings are written out here, not read from remat's table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import remat
from remat.cli.main import main
from remat.errors import Option, OptionStyle, option_style, spell
from remat.measure import StepMeasurement
from remat.types import MemorySource

from .conftest import TINY
from .test_auto import FAST, ex, tiny

SRC = Path(__file__).resolve().parents[1] / "src"
FLAG = re.compile(r"(?<![\w-])--[a-z]")   # a command-line flag: "--reserve", not "x--y" or a bare dash


def _mlp_shape() -> str:
    """tests/test_plan_cli.py's mlp that plans at 88%."""
    return ",".join(f"{k}={v}" for k, v in {**TINY["mlp"], "depth": 6, "batch_size": 128}.items())


def test_spell_writes_each_option_for_who_called():
    """Flags by default and again after the block; keywords inside it; words where auto has no keyword."""
    assert spell(Option.RESERVE, 0.012) == "--reserve 1.2%"
    assert spell(Option.PLANNER, "greedy") == "--planner greedy"
    assert spell(Option.CANDIDATES) == "--candidates"
    with pytest.raises(RuntimeError):
        with option_style(OptionStyle.KEYWORDS):
            assert spell(Option.RESERVE, 0.012) == "reserve=0.012"
            assert spell(Option.PLANNER, "greedy") == 'planner="greedy"'
            assert spell(Option.BUDGET, "60%") == 'budget="60%"'
            for option in (Option.CANDIDATES, Option.ALLOW_HAZARDS, Option.SAMPLE_STEPS, Option.FSDP2):
                assert not FLAG.search(spell(option)), option
            raise RuntimeError("the style is restored on the way out of an error too")
    assert spell(Option.RESERVE, 0.012) == "--reserve 1.2%"


def test_an_infeasible_budget_in_remat_auto_names_no_flag():
    model, batch = tiny()
    with pytest.raises(remat.InfeasibleBudget) as info:
        remat.auto(model, batch, budget=1024, loss_fn=ex.loss_fn, use_cache=False, **FAST)
    text = str(info.value)
    assert "floor" in text and not FLAG.search(text), text
    # where remat.auto has no keyword, the tip says what to change in words
    assert "split large modules into submodules" in info.value.tip
    assert "remove the replay hazard" in info.value.tip


def test_an_infeasible_budget_in_remat_plan_keeps_its_flags(tmp_path, capsys):
    """The twin: the same refusal from the command line names ``--candidates`` and ``--allow-hazards``."""
    rc = main(["plan", "--workload", "mlp", "--shape", _mlp_shape(), "--budget", "10%", "--out", str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "floor" in err
    assert "--candidates" in err and "--allow-hazards" in err, err


class _InsideTheReserve:
    """``closed_loop.measure_plan`` where every plan peaks at 97.5% of its budget: under the budget itself,
    inside its 5% reserve, so no plan ships and the cheapest is offered with the reserve that would ship it."""

    def __call__(self, loaded, plan, *, warmup=1, steps=3, then=()):
        peak = int(plan.budget_bytes * 0.975)
        return StepMeasurement(peak_bytes=peak, step_ms=[1.0], memory_source=MemorySource.CPU_LIVE_TENSORS,
                               then_peak_bytes=(peak,) * len(then))


def test_a_missed_budget_in_remat_auto_offers_the_reserve_keyword(monkeypatch):
    from remat import closed_loop
    monkeypatch.setattr(closed_loop, "measure_plan", _InsideTheReserve())
    model, batch = tiny()
    with pytest.raises(remat.BudgetMissed) as info:
        remat.auto(model, batch, budget="80%", loss_fn=ex.loss_fn, use_cache=False, **FAST)
    text = str(info.value)
    assert not FLAG.search(text), text
    r = closed_loop.reserve_that_ships(info.value.in_budget)
    assert 0 < r < 0.05 and f"pass reserve={r:g} to ship that plan" in info.value.tip


def test_a_missed_budget_in_remat_plan_offers_the_reserve_flag(monkeypatch, tmp_path, capsys):
    from remat import closed_loop
    monkeypatch.setattr(closed_loop, "measure_plan", _InsideTheReserve())
    rc = main(["plan", "--workload", "mlp", "--shape", _mlp_shape(), "--budget", "88%", "--out", str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and re.search(r"pass --reserve \d+(\.\d+)?% to ship that plan", err), err
    assert "reserve=" not in err


def test_a_model_without_blocks_gets_words_from_remat_auto_and_the_flag_elsewhere():
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with pytest.raises(remat.CandidateError) as info:
        remat.auto(model, x, budget="80%", loss_fn=lambda m, b: m(b).sum(), use_cache=False, **FAST)
    assert not FLAG.search(str(info.value)) and "split large modules into submodules" in info.value.tip
    from remat.profile.candidates import resolve_candidates
    with pytest.raises(remat.CandidateError, match="--candidates"):   # the stage called directly: the CLI's spelling
        resolve_candidates(model, None)


def test_every_error_and_warning_class_remat_auto_loads_is_exported():
    """Every RematError and Warning subclass defined in the modules ``remat.auto`` and its integrations load
    (read in a fresh interpreter, so other tests' imports add nothing) resolves as ``remat.<name>``."""
    code = ("import json, sys; sys.path.insert(0, %r)\n"
            "import remat.autoplan, remat.integrations.transformers, remat.integrations.diffusers\n"
            "from remat.errors import RematError\n"
            "def subs(c):\n"
            "    for s in c.__subclasses__():\n"
            "        yield s\n"
            "        yield from subs(s)\n"
            "found = {(c.__module__, c.__name__) for base in (RematError, Warning) for c in subs(base)\n"
            "         if c.__module__.startswith('remat.')}\n"
            "print(json.dumps(sorted(found)))" % str(SRC))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout)
    names = {name for _, name in found}
    assert {"InfeasibleBudget", "BudgetMissed", "JobFault", "TrainableChangedError", "NewShapeError",
            "VerificationFailed", "NewShapeWarning", "BrokenCacheEntryWarning"} <= names   # the walk sees them
    missing = [f"{module}.{name}" for module, name in found if name not in remat.__all__]
    assert not missing, f"not in remat.__all__: {missing}"
    import importlib
    for module, name in found:
        assert getattr(remat, name) is getattr(importlib.import_module(module), name), name
