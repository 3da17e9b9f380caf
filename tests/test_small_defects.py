"""The smaller defects of issue 41 (item 6), each a typed error with a clear message and a non-zero
exit, never a traceback; each wrong input next to its safe twin, which is accepted.

- ``remat trace --device meta``: a usage error (exit 2), not a remat bug (exit 3); ``--simulate``
  still builds on meta.
- a workload factory that closes ``sys.stdout``: the user's code's fault (UserCodeError, exit 2).
- a factory that changes directory: a relative ``--out`` stays where the command started.
- budgets: non-ASCII digits refused; a float that is not a whole byte count (``1.5``, ``0.7``)
  refused, with the percentage spelling in the tip; ``8e9`` and ``"1.5GiB"`` accepted.
- the built-ins' size keywords: ``depth=-3`` (and the other counts, gpt's heads) refused.
- ``remat.auto`` on a ``meta`` model with a CPU batch: AutoError, not torch's RuntimeError.

Tiny shapes throughout: each CLI run traces a two-layer MLP for one step.
"""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import remat
from remat.cli.main import main
from remat.errors import AutoError, BudgetError, ShapeError, UserCodeError, WorkloadError
from remat.plan import check_budget_syntax, parse_budget, parse_capacity
from remat.workload import load_workload

TINY = ["--warmup", "1", "--steps", "1"]

FACTORIES = textwrap.dedent('''
    import os, sys, torch, remat

    def build(batch_size: int = 2, *, device="cpu", dtype=torch.float32):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)).to(device, dtype)
        return remat.Workload(model=model, batch=lambda step: torch.randn(batch_size, 8,
                              generator=torch.Generator().manual_seed(step)),
                              loss=lambda m, b: m(b).square().mean())

    def closes_stdout(**kw):
        sys.stdout.close()
        return build(**kw)

    def closes_stderr(**kw):
        sys.stderr.close()
        return build(**kw)

    def prints(**kw):          # the safe twin: writes to stdout, closes nothing
        print("building")
        return build(**kw)

    def moves(**kw):
        os.makedirs("elsewhere", exist_ok=True)
        os.chdir("elsewhere")
        return build(**kw)
''')


@pytest.fixture
def workloads(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "wl.py"
    path.write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)    # a factory that changes directory is undone after each test
    return path


def _trace(spec: str, out: str, *extra: str) -> int:
    return main(["trace", "--workload", spec, "--out", out, *TINY, *extra])


# -- remat trace --device meta -------------------------------------------------------------------

def test_device_meta_is_a_usage_error(tmp_path, capsys):
    rc = _trace("mlp", str(tmp_path / "o"), "--device", "meta", "--shape", "batch_size=2,width=8,depth=1,d_in=4")
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "--device meta" in err and "no storage" in err, err
    assert "internal error" not in err and "Traceback" not in err
    with pytest.raises(WorkloadError, match="meta"):
        load_workload("mlp", {"depth": 1}, device="meta")


def test_device_cpu_and_simulate_on_meta_still_run(tmp_path, capsys):
    """The twins: --device cpu traces; --simulate (which builds on meta itself) still works."""
    shape = ["--shape", "batch_size=2,width=8,depth=1,d_in=4"]
    assert _trace("mlp", str(tmp_path / "cpu"), "--device", "cpu", *shape) == 0
    assert _trace("mlp", str(tmp_path / "sim"), "--simulate", *shape) == 0
    assert (tmp_path / "sim" / "simulation.json").is_file()


# -- a factory that closes sys.stdout ------------------------------------------------------------

@pytest.mark.parametrize("factory,stream", [("closes_stdout", "stdout"), ("closes_stderr", "stderr")])
def test_a_factory_closing_a_std_stream_is_the_users_fault(factory, stream, workloads, monkeypatch, capfd):
    monkeypatch.setattr(sys, stream, io.StringIO())   # the factory closes this one; monkeypatch restores the real one
    rc = _trace(f"{workloads}:{factory}", "out")
    err = " ".join(capfd.readouterr().err.split())
    assert rc == 2, err
    assert f"closed sys.{stream}" in err and "internal error" not in err, err
    with pytest.raises(UserCodeError, match=f"closed sys.{stream}"):
        monkeypatch.setattr(sys, stream, io.StringIO())
        load_workload(f"{workloads}:{factory}")


def test_a_factory_that_prints_is_fine(workloads, capfd):
    assert _trace(f"{workloads}:prints", "out") == 0
    assert "building" in capfd.readouterr().out


# -- a factory that changes directory ------------------------------------------------------------

def test_relative_out_is_where_the_command_started(workloads):
    assert _trace(f"{workloads}:moves", "out") == 0
    assert (workloads.parent / "out" / "trace.json").is_file()
    assert not (workloads.parent / "elsewhere" / "out").exists(), "--out moved with the factory's chdir"


def test_absolute_out_with_a_factory_that_changes_directory(workloads, tmp_path):
    """The twin: an absolute --out was never affected."""
    assert _trace(f"{workloads}:moves", str(tmp_path / "abs")) == 0
    assert (tmp_path / "abs" / "trace.json").is_file()


# -- budgets -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["\u0663GiB", "\uff13GiB", "\uff11\uff12\uff13", "7\u0660%", "1\u06f0MiB"])
def test_non_ascii_digits_are_refused(text):
    with pytest.raises(BudgetError, match="other than ASCII"):
        parse_budget(text, 1000)
    with pytest.raises(BudgetError):
        parse_capacity(text)


@pytest.mark.parametrize("text,expected", [("3GiB", 3 * 2 ** 30), ("123", 123), ("70%", 700), ("1.5GiB", 3 * 2 ** 29)])
def test_ascii_twins_are_accepted(text, expected):
    assert parse_budget(text, 1000) == expected


@pytest.mark.parametrize("value", [1.5, 0.7, "1.5", "1.5B", 2.25, float("inf"), float("nan")])
def test_a_fraction_of_a_byte_is_refused(value):
    with pytest.raises(BudgetError) as info:
        check_budget_syntax(value)
    if isinstance(value, str) or value == value and value not in (float("inf"),):
        assert "whole number of bytes" in info.value.message and '"70%"' in (info.value.tip or "")


@pytest.mark.parametrize("value,expected", [(8e9, 8_000_000_000), (1024.0, 1024), ("1.5kB", 1500), (2048, 2048)])
def test_whole_byte_counts_are_accepted(value, expected):
    assert parse_budget(value, 1000) == expected


def test_a_fractional_budget_from_the_command_line(tmp_path, capsys):
    rc = main(["plan", "--workload", "mlp", "--shape", "batch_size=2,width=8,depth=1,d_in=4", "--budget", "1.5",
               "--out", str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "whole number of bytes" in err and "internal error" not in err, err


def test_a_float_share_in_remat_auto_is_refused_before_planning():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(BudgetError, match="whole number of bytes"):
        remat.auto(model, torch.randn(2, 4), budget=0.7, loss_fn=lambda m, b: m(b).sum(), use_cache=False)


# -- the built-ins' size keywords ----------------------------------------------------------------

@pytest.mark.parametrize("spec,shape,match", [
    ("mlp", {"depth": -3}, "depth=-3"), ("mlp", {"width": 0}, "width=0"), ("mlp", {"batch_size": -1}, "batch_size"),
    ("cnn", {"blocks_per_stage": -1}, "blocks_per_stage"), ("cnn", {"image_size": 0}, "image_size"),
    ("cnn", {"num_classes": 0}, "num_classes"),
    ("gpt", {"n_layer": -2}, "n_layer"), ("gpt", {"n_head": 0}, "n_head"), ("gpt", {"d_model": 30}, "multiple of n_head"),
    ("gpt", {"dropout": 1.5}, "dropout"), ("gpt", {"vocab": 0}, "vocab"),
])
def test_builtin_sizes_below_one_are_refused(spec, shape, match):
    with pytest.raises(ShapeError, match=match):
        load_workload(spec, shape)


@pytest.mark.parametrize("spec,shape", [
    ("mlp", {"depth": 1, "width": 8, "batch_size": 2, "d_in": 4}),
    ("cnn", {"blocks_per_stage": 1, "width": 4, "image_size": 8, "batch_size": 2}),
    ("gpt", {"n_layer": 1, "d_model": 8, "n_head": 2, "seq_len": 4, "vocab": 16, "dropout": 0.0}),
])
def test_builtin_smallest_sizes_build(spec, shape):
    assert isinstance(load_workload(spec, shape).workload.model, torch.nn.Module)


def test_depth_minus_three_from_the_command_line(tmp_path, capsys):
    rc = _trace("mlp", str(tmp_path / "o"), "--shape", "depth=-3")
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "depth=-3" in err and "internal error" not in err, err


# -- remat.auto on a meta model ------------------------------------------------------------------

def _mlp(device: str) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)).to(device)


def test_a_meta_model_with_a_cpu_batch_is_an_auto_error():
    with pytest.raises(AutoError, match="meta device") as info:
        remat.auto(_mlp("meta"), torch.randn(2, 8), budget="1GiB", loss_fn=lambda m, b: m(b).square().mean(),
                   use_cache=False, measure_replays=False)
    assert "to_empty" in (info.value.tip or "")


def test_a_cpu_model_with_a_cpu_batch_plans(tmp_path):
    h = remat.auto(_mlp("cpu"), torch.randn(2, 8), budget="1GiB", loss_fn=lambda m, b: m(b).square().mean(),
                   use_cache=False, measure_replays=False)
    assert h.active
    h.remove()


# -- non-ASCII digits elsewhere on the command line ----------------------------------------------

def test_non_ascii_digits_in_a_shape_are_text_and_refused():
    from remat.workload import parse_shape
    assert parse_shape("depth=\u0663") == {"depth": "\u0663"}
    with pytest.raises(ShapeError, match="depth"):
        load_workload("mlp", parse_shape("depth=\u0663"))
    assert parse_shape("depth=3,dropout=0.5") == {"depth": 3, "dropout": 0.5}   # the ASCII twin


def test_non_ascii_digits_in_a_count_flag_are_a_usage_error(tmp_path, capsys):
    assert _trace("mlp", str(tmp_path / "o"), "--steps", "\u0661") == 2
    assert "expected an integer" in capsys.readouterr().err
