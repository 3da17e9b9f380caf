"""The workload contract: built-ins, custom files, module paths, and every bad input (exit 2)."""

from __future__ import annotations

import pytest
import torch

from remat import Workload, WorkloadError, load_workload
from remat.cli.main import main
from remat.errors import ShapeError
from remat.workload import TrainingStep, parse_shape

from .conftest import FIXTURES, TINY


@pytest.mark.parametrize("spec", ["gpt", "cnn", "mlp"])
def test_builtins_train_and_are_deterministic(spec):
    a = TrainingStep(load_workload(spec, TINY[spec]).workload)
    b = TrainingStep(load_workload(spec, TINY[spec]).workload)
    torch.manual_seed(1)  # dropout draws from the global RNG: seed both runs alike
    la = [a.run(i) for i in range(3)]
    torch.manual_seed(1)
    lb = [b.run(i) for i in range(3)]
    assert la == lb  # same seeded init, same batches, same RNG -> same losses
    assert all(torch.isfinite(torch.tensor(la)))


def test_batches_are_deterministic_per_step():
    w = load_workload("gpt", TINY["gpt"]).workload
    x0, _ = w.batch(0)
    assert torch.equal(x0, w.batch(0)[0])
    assert not torch.equal(x0, w.batch(1)[0])


def test_custom_file_and_module_path():
    lw = load_workload(f"{FIXTURES / 'custom_workload.py'}:build", {"batch_size": 3})
    assert isinstance(lw.workload, Workload)
    assert lw.workload.batch(0)[0].shape == (3, 16)
    TrainingStep(lw.workload).run(0)
    lw2 = load_workload("remat.workload.builtins.mlp:build", {"depth": 2})
    assert len(lw2.workload.model.blocks) == 2


def test_shape_parsing():
    assert parse_shape("batch_size=16, seq_len=512,lr=0.5,name=x") == {"batch_size": 16, "seq_len": 512, "lr": 0.5, "name": "x"}
    for bad in ["batch_size", "=3", "a=", "1x=2"]:
        with pytest.raises(ShapeError):
            parse_shape(bad)


BAD_SPECS = [
    ("missing_file.py:build", "not found"),
    (f"{FIXTURES / 'custom_workload.py'}:nope", "no attribute 'nope'"),
    (f"{FIXTURES / 'custom_workload.py'}:NOT_CALLABLE", "not callable"),
    (f"{FIXTURES / 'custom_workload.py'}:raises", "factory exploded on purpose"),
    (f"{FIXTURES / 'custom_workload.py'}:wrong_type", "not remat.Workload"),
    ("no_such_pkg.mod:build", "cannot import module"),
    ("resnet", "not a built-in"),
]


@pytest.mark.parametrize("spec,needle", BAD_SPECS)
def test_bad_specs_are_typed(spec, needle):
    with pytest.raises(WorkloadError, match=needle):
        load_workload(spec)


def test_unknown_shape_keyword_lists_allowed():
    with pytest.raises(ShapeError, match="no shape keyword colour.*batch_size"):
        load_workload("gpt", {"colour": 3})


def test_loss_not_scalar():
    lw = load_workload(f"{FIXTURES / 'custom_workload.py'}:vector_loss")
    with pytest.raises(WorkloadError, match="scalar"):
        TrainingStep(lw.workload).run(0)


@pytest.mark.parametrize("argv,needle", [
    (["--workload", "missing.py:build"], "not found"),
    (["--workload", "gpt", "--shape", "colour=3"], "no shape keyword"),
    (["--workload", "gpt", "--shape", "batch_size"], "bad shape item"),
    (["--workload", f"{FIXTURES / 'custom_workload.py'}:vector_loss"], "scalar"),
    (["--workload", "gpt", "--shape", "batch_size=abc"], "declares batch_size: int"),
])
def test_cli_bad_input_exit_2_without_traceback(argv, needle, tmp_path, capsys):
    rc = main(["trace", *argv, "--warmup", "1", "--steps", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err.replace("\n", " ")
    assert "Traceback" not in err
    assert not (tmp_path / "o" / "trace.json").exists()  # nothing half-written


@pytest.mark.parametrize("fn,needle,where", [
    ("raises", "factory exploded on purpose", "in raises"),          # the factory
    ("broken_model", "mat1 and mat2", "in <lambda>"),                  # the model's forward, in the loss
])
def test_error_in_the_users_own_code_exits_2_with_its_traceback(tmp_path, capsys, fn, needle, where):
    """NOTE [exit codes]: user code raising is exit 2, with the user's traceback shown (not remat's)."""
    rc = main(["trace", "--workload", f"{FIXTURES / 'custom_workload.py'}:{fn}", "--warmup", "1",
               "--steps", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    text = err.replace("\n", " ")
    assert "Traceback" in err and "custom_workload.py" in err and where in err and needle in text
    assert "internal error" not in err and "remat bug" not in err
    assert not (tmp_path / "o" / "trace.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build's message")
def test_cuda_requested_on_a_cpu_build_is_a_typed_error():
    with pytest.raises(WorkloadError, match="torch.cuda.is_available"):
        load_workload("gpt", device="cuda")
    with pytest.raises(WorkloadError, match="unknown device"):
        load_workload("gpt", device="tpu9")
