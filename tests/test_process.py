"""The process (issue 23): signals, output errors, user code that exits, hangs and --timeout.

Every case: the documented exit code (NOTE [exit codes] in remat.cli.main), no traceback but the
user's own, and no file left behind (no ``.tmp``, nothing half-written). Signals run the real
``remat`` in a subprocess; the rest call ``main`` in-process. Tiny built-in ``mlp`` throughout.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remat.cli.main import main

from .conftest import TINY

SHAPE = ",".join(f"{k}={v}" for k, v in TINY["mlp"].items())
SRC = str(Path(__file__).resolve().parents[1] / "src")

USER = '''
import argparse, os, signal, sys, time
import torch
from remat.workload.builtins.mlp import build as mlp

class Boom(BaseException):
    pass

def exits(batch_size: int = 8):
    sys.exit(0)

def parses(batch_size: int = 8):
    p = argparse.ArgumentParser()
    p.add_argument("--lr", required=True)
    p.parse_args()

def boom(batch_size: int = 8):
    raise Boom("not an Exception")

def hangs(batch_size: int = 8):
    time.sleep(600)

def hanging_batch(batch_size: int = 8):
    wl = mlp(batch_size=batch_size, width=32, depth=4, d_in=8)
    def batch(step):
        time.sleep(600)
    wl.batch = batch
    return wl

def slow_first_batch(batch_size: int = 8):
    wl = mlp(batch_size=batch_size, width=32, depth=4, d_in=8)
    inner, calls = wl.batch, []
    def batch(step):
        calls.append(step)
        if len(calls) == 1:
            time.sleep(1.2)
        elif len(calls) == 2:   # the first step has returned
            time.sleep(0.1)
            print("SECOND STEP", file=sys.stderr, flush=True)
            time.sleep(3.0)
        return inner(step)
    wl.batch = batch
    return wl

def terminated_while_measuring(batch_size: int = 8):
    wl = mlp(batch_size=batch_size, width=32, depth=4, d_in=8)
    inner = wl.batch
    def batch(step):
        os.kill(os.getpid(), signal.SIGTERM)
        return inner(step)
    wl.batch = batch
    return wl
'''

# SIGTERM in the write window: the temp file is written and fsynced, not yet renamed
_TERM_IN_WRITE = """
import os, signal, sys
import remat._io as io
real = os.fsync
def fsync(fd):
    real(fd)
    os.kill(os.getpid(), signal.SIGTERM)
io.os = type(sys)("os_patched")
io.os.__dict__.update(os.__dict__)
io.os.fsync = fsync
from remat.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "u.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != "u.py")


def _remat(cwd: Path, *argv: str, code: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "remat", *argv]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + str(cwd)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# -- SIGTERM: like Ctrl-C, one line, exit 143, no temp file ------------------------------------------

def test_sigterm_in_the_write_window_exits_143_and_leaves_no_tmp(user_dir):
    proc = _remat(user_dir, "trace", "--workload", "mlp", "--shape", SHAPE, "--steps", "1", "--warmup", "1",
                  "--out", "o", code=_TERM_IN_WRITE)
    assert proc.returncode == 143 and proc.stderr.strip().splitlines()[-1] == "remat: terminated", proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(user_dir.rglob("*.tmp")) and not (user_dir / "o" / "trace.json").exists()


def test_sigterm_while_measuring_exits_143_with_one_line(user_dir):
    proc = _remat(user_dir, "trace", "--workload", "u.py:terminated_while_measuring", "--out", "o")
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "running the first step" not in line]
    assert proc.returncode == 143 and lines == ["remat: terminated"], proc.stderr
    assert _leftovers(user_dir) == []


# -- output errors: exit 2, typed, nothing half-written ----------------------------------------------

@pytest.mark.parametrize("below", ["", "sub/dir"])
def test_a_dangling_symlink_out_is_refused_up_front(tmp_path, capsys, below):
    (tmp_path / "o").symlink_to(tmp_path / "nowhere")
    rc = main(["trace", "--workload", "mlp", "--shape", SHAPE, "--out", str(tmp_path / "o" / below)])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "dangling symlink" in err and "Traceback" not in err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_an_unwritable_out_is_refused_before_the_work(tmp_path, capsys, monkeypatch, code):
    import remat.workload.loader as loader

    def refuse(*a, **k):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr("remat.cli.common._probe_write", refuse)
    monkeypatch.setattr(loader, "load_workload", lambda *a, **k: pytest.fail("the workload was built"))
    rc = main(["trace", "--workload", "mlp", "--shape", SHAPE, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and os.strerror(code) in " ".join(err.split()) and "Traceback" not in err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("command", [["trace", "--steps", "1", "--warmup", "1"],
                                     ["plan", "--budget", "1GiB", "--no-measure"]])
def test_an_output_error_at_write_time_is_exit_2_and_leaves_nothing(tmp_path, capsys, monkeypatch, code, command):
    """The probe passed, then the disk filled up (or went read-only) while measuring."""
    import remat._io as io
    monkeypatch.setattr("remat.cli.common._probe_write", lambda folder: None)

    def fsync(fd):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(io.os, "fsync", fsync)
    out = tmp_path / "o"
    rc = main([*command, "--workload", "mlp", "--shape", SHAPE, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot write" in err and "Traceback" not in err, err
    assert _leftovers(tmp_path) == []


# -- user code that exits or raises a BaseException: a UserCodeError naming the factory ------------------

@pytest.mark.parametrize("fn,needle", [("exits", "called sys.exit(0)"), ("parses", "called sys.exit(2)"),
                                       ("boom", "raised Boom: not an Exception")])
def test_user_code_that_exits_or_raises_a_base_exception_is_a_user_code_error(user_dir, capsys, fn, needle):
    rc = main(["trace", "--workload", f"u.py:{fn}", "--out", "o"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and needle in err and f"workload factory 'u.py:{fn}'" in err, err
    assert _leftovers(user_dir) == []


# -- --timeout: a hanging factory or batch() stops with exit 4, one line -------------------------------------

@pytest.mark.parametrize("fn", ["hangs", "hanging_batch"])
def test_a_hang_stops_at_the_timeout_with_exit_4(user_dir, fn):
    t0 = time.monotonic()
    proc = _remat(user_dir, "trace", "--workload", f"u.py:{fn}", "--out", "o", "--timeout", "2")
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 4 and "past its --timeout of 2 s" in proc.stderr, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60 and _leftovers(user_dir) == []


def test_a_slow_build_prints_progress_lines(user_dir):
    proc = _remat(user_dir, "trace", "--workload", "u.py:hangs", "--out", "o", "--timeout", "3",
                  code="import sys, remat.cli.common as c; c.HEARTBEAT_S = 1.0\n"
                       "from remat.cli.main import main; sys.exit(main(sys.argv[1:]))")
    assert proc.returncode == 4 and "building workload 'u.py:hangs' (1 s)" in proc.stderr, proc.stderr


_BEAT_1S = "import sys, remat.cli.common as c; c.HEARTBEAT_S = 1.0\nfrom remat.cli.main import main; sys.exit(main(sys.argv[1:]))"


def test_a_hanging_first_step_prints_progress_lines(user_dir):
    proc = _remat(user_dir, "trace", "--workload", "u.py:hanging_batch", "--out", "o", "--timeout", "3", code=_BEAT_1S)
    assert proc.returncode == 4 and "running the first step (1 s)..." in proc.stderr, proc.stderr
    assert "building workload" not in proc.stderr   # the build was fast: no line for it


def test_the_first_step_lines_stop_when_it_returns(user_dir):
    """The first batch takes 1.2 s (at least one line), the second 3 s: no line once the first step returned."""
    proc = _remat(user_dir, "trace", "--workload", "u.py:slow_first_batch", "--out", "o", "--steps", "1",
                  "--warmup", "1", code=_BEAT_1S)
    assert proc.returncode == 0, proc.stderr
    before, _, after = proc.stderr.partition("SECOND STEP")
    assert "running the first step (1 s)..." in before and "running the first step" not in after, proc.stderr
