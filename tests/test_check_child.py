"""remat check runs the user's workload in a child process (NOTE [workload in a child process] in
remat/workflow/child.py): the child's death or early exit is exit 2 naming it, and ``--timeout`` is kept
from outside it (exit 4), whatever the workload does with signals and exceptions.

One small receipt is made once for the module on a file workload whose misbehaviour the environment
picks (``REMAT_TEST_WORKLOAD``, read by the factory and ``batch()`` in the child). Each wrong case has
its safe twin: the same workload, behaving, passes with the report an in-process check gives.

The issue asks that a hanging workload end "within the timeout plus 5 s"; the tests assert a generous
hang bound (a shared CI host is slow) and say the elapsed time in their failure message. Measured on a
quiet host: see docs/check.md."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from remat.cli.main import main
from remat.errors import CheckTimeout, WorkloadProcessDied
from remat.receipt import RunSettings, load_receipt_with_digest, write_receipt
from remat.workflow import GateSettings, ReportStamps, check_receipt, make_receipt
from remat.workflow.check_child import check_receipt_in_child
from remat.workflow.child import ChildError, ErrorKind, _descendants
from remat.workload import load_workload

WORK = '''"""A tiny MLP whose factory and batch() misbehave as REMAT_TEST_WORKLOAD says."""

import os
import signal
import subprocess
import sys
import time

import torch
from torch import nn

import remat


def _hang(marker):
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    while True:
        try:
            time.sleep(0.05)
            raise RuntimeError("flaky: retry")
        except Exception:   # a retry loop that swallows everything, the CLI's CheckTimeout included
            continue


def build(batch_size: int = 128, width: int = 16, depth: int = 3, device: str = "cpu", dtype=torch.float32):
    how = os.environ.get("REMAT_TEST_WORKLOAD", "")
    if how == "exit0":
        os._exit(0)
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "raise":
        raise ValueError("the factory's own error")
    if how == "hang-factory":
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        with open("SLEEPER", "w") as f:
            f.write(str(sleeper.pid))
        _hang("HANGING")
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width)]
    model = nn.Sequential(*layers, nn.Linear(width, 1)).to(device=device, dtype=dtype)

    def batch(step):
        if how == "hang-batch":
            _hang("HANGING")
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, width, generator=g), torch.randn(batch_size, 1, generator=g)

    def loss(model, b):
        x, y = b
        return torch.nn.functional.mse_loss(model(x), y)

    return remat.Workload(model=model, batch=batch, loss=loss,
                          optimizer=lambda params: torch.optim.SGD(params, lr=1e-2))
'''
SETTINGS = RunSettings(trace_warmup=1, trace_steps=1, verify_steps=1, verify_seeds=1, verify_timing_steps=0,
                       frontier_plans=["none", "optimal"], frontier_steps=3, frontier_warmup=1,
                       capacity_key=None, capacity_tries=1, capacity_steps=1, note="child suite")
HANG_TIMEOUT_S = 15    # --timeout for the hanging cases: the child imports torch before the factory runs
HANG_BOUND_S = 60      # a generous bound on the whole command (the is the timeout plus 5 s)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A folder with work.py, pyproject.toml naming it and out/ (its receipt): made once (about 10 s)."""
    root = tmp_path_factory.mktemp("child")
    (root / "work.py").write_text(WORK)
    (root / "pyproject.toml").write_text('[tool.remat]\nworkload = "work.py:build"\n')
    cwd = Path.cwd()
    os.chdir(root)
    try:
        torch.set_num_threads(1)
        receipt = make_receipt(load_workload("work.py:build", {}), budget="95%", reserve=0.05, settings=SETTINGS)
        assert receipt.decision.status == "ship" and receipt.plan.boundaries, receipt.decision.why
        write_receipt(receipt, root / "out")
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture
def work(made, tmp_path, monkeypatch) -> Path:
    for name in ("work.py", "pyproject.toml"):
        shutil.copy(made / name, tmp_path / name)
    shutil.copytree(made / "out", tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REMAT_TEST_WORKLOAD", raising=False)
    return tmp_path


def _text(s: str) -> str:
    return " ".join(s.split())


def _check(*extra: str) -> tuple[int, float]:
    t0 = time.monotonic()
    code = main(["check", "out/receipt.json", "--quick", *extra])
    return code, time.monotonic() - t0


# -- the safe twin: a workload that behaves ----------------------------------------------------------------

def test_a_behaving_workload_passes_with_the_in_process_report(work, capsys):
    receipt, digest = load_receipt_with_digest(work / "out" / "receipt.json")
    reports = ReportStamps(folder=work / "out", receipt=receipt, digest=digest)
    here = check_receipt(receipt, quick=True, reports=reports)
    child = check_receipt_in_child(receipt, path=work / "out" / "receipt.json", digest=digest, quick=True,
                                   reports=reports)
    assert here.passed and child.passed, (here.failures, child.failures)
    assert (child.checked, child.skipped, child.failures) == (here.checked, here.skipped, here.failures)
    assert any(line.startswith("equivalence") for line in child.checked)   # the re-run ran, in the child
    code, _ = _check()
    out = _text(capsys.readouterr().out)
    assert code == 0 and "receipt holds (quick check" in out and "ok equivalence" in out


def test_the_users_own_error_is_still_exit_2_with_its_traceback(work, capsys, monkeypatch):
    monkeypatch.setenv("REMAT_TEST_WORKLOAD", "raise")
    code, _ = _check()
    err = _text(capsys.readouterr().err)
    assert code == 2 and "the factory's own error" in err and "work.py" in err   # the user's traceback


# -- death and early exit: exit 2, naming the phase and how it ended --------------------------------------

def test_a_factory_calling_os_exit_0_fails_with_exit_2(work, capsys, monkeypatch):
    monkeypatch.setenv("REMAT_TEST_WORKLOAD", "exit0")
    code, elapsed = _check("--timeout", str(HANG_TIMEOUT_S))
    err = _text(capsys.readouterr().err)
    assert code == 2, err
    assert ("the workload's process exited with status 0 before it reported a result, while building the "
            "workload (its factory)") in err, err
    assert "receipt holds" not in _text(capsys.readouterr().out)
    assert elapsed < HANG_BOUND_S, f"{elapsed:.1f} s"


def test_a_segfault_in_the_factory_fails_with_exit_2_naming_the_signal(work, capsys, monkeypatch):
    monkeypatch.setenv("REMAT_TEST_WORKLOAD", "segv")
    code, _ = _check()
    err = _text(capsys.readouterr().err)
    assert code == 2 and "was killed by SIGSEGV before it reported a result" in err, err


# -- --timeout kept from outside: exit 4, the child's whole tree gone --------------------------------------

def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"   # a zombie waiting for init is gone too


@pytest.mark.parametrize("hang", ["hang-factory", "hang-batch"])
def test_a_workload_that_ignores_the_alarm_or_swallows_exceptions_ends_at_the_timeout(work, capsys, monkeypatch,
                                                                                        hang):
    """hang-factory ignores SIGALRM and SIGTERM, starts a process in a session of its own (as torchrun does)
    and loops; hang-batch's batch() retries for ever, catching Exception. Both stop at --timeout, exit 4."""
    monkeypatch.setenv("REMAT_TEST_WORKLOAD", hang)
    code, elapsed = _check("--timeout", str(HANG_TIMEOUT_S))
    err = _text(capsys.readouterr().err)
    assert code == 4, err
    assert f"remat check ran past its --timeout of {HANG_TIMEOUT_S} s" in err and "nothing decided" in err, err
    phase = "while building the workload (its factory)" if hang == "hang-factory" else "while running the paired steps (equivalence"
    assert (work / "HANGING").exists() and phase in err, err   # stopped in the workload's code, not before it
    assert elapsed < HANG_BOUND_S, f"ended {elapsed:.1f} s after it started, --timeout {HANG_TIMEOUT_S} s"
    assert _gone(int((work / "HANGING").read_text()))
    if hang == "hang-factory":
        sleeper = int((work / "SLEEPER").read_text())
        deadline = time.monotonic() + 10
        while not _gone(sleeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(sleeper), "a process the workload started in its own session outlived the check"
    assert "Traceback" not in err


# -- the parent's pieces -------------------------------------------------------------------------------------

def test_a_child_error_comes_back_typed():
    """The wrong case: an untyped exception is a remat bug (exit 3, its traceback kept); the safe twin:
    a RematError keeps its class, message, tip and exit code."""
    timeout = ChildError.of(CheckTimeout("slow", tip="raise it")).exception()
    assert type(timeout) is CheckTimeout and timeout.exit_code == 4 and timeout.tip == "raise it"
    try:
        raise KeyError("remat's own")
    except KeyError as exc:
        bug = ChildError.from_json(ChildError.of(exc).to_json())
    assert bug.kind is ErrorKind.BUG and bug.exception().exit_code == 3
    assert "KeyError" in bug.exception().traceback_text and "remat bug" in bug.exception().message
    oom = ChildError.of(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")).exception()
    assert oom.exit_code == 2 and oom.message.startswith("out of memory: OutOfMemoryError")


def test_descendants_follow_parent_pids_across_sessions():
    import subprocess
    import sys
    outer = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                              "'-c', 'import time; time.sleep(60)'], start_new_session=True); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        found: dict[int, str] = {}
        while time.monotonic() < deadline and len(found) < 2:
            stat = Path(f"/proc/{outer.pid}/stat").read_text().rsplit(")", 1)[1].split()
            found = _descendants({outer.pid: stat[19]})
            time.sleep(0.1)
        assert len(found) == 2 and outer.pid in found                       # the inner one, in its own session
        assert _descendants({outer.pid: "0"}) == {outer.pid: "0"}            # another start time: not that process
    finally:
        for pid in found:
            if pid != outer.pid:
                os.kill(pid, signal.SIGKILL)
        outer.kill()
        outer.wait()


def test_a_receipt_changed_under_the_check_is_refused(work, capsys):
    """The child reads receipt.json again: another file than the parent read fails (exit 2), naming both."""
    receipt, digest = load_receipt_with_digest(work / "out" / "receipt.json")
    with pytest.raises(Exception) as exc:
        check_receipt_in_child(receipt, path=work / "out" / "receipt.json", digest="0" * 64, quick=True,
                               gate=GateSettings())
    assert "changed while remat check ran" in str(exc.value) and getattr(exc.value, "exit_code", None) == 2
    assert not isinstance(exc.value, WorkloadProcessDied)
    assert re.search(r"sha256 0{12}\.\.\.", str(exc.value))
