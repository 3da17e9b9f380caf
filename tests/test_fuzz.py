"""Fuzz suite (issue 12): mutated receipts, plans, shapes, budgets and command lines.

Every input must give success or a typed RematError (exit 2, or exit 1 where a check ran and
failed): never another exception, never more than a few seconds, never a file written where
remat was not asked to write, never a module imported because a file named it.

Runs in the normal test suite (about half a minute here). ``derandomize=True`` keeps CI
deterministic; ``REMAT_FUZZ_EXAMPLES=N`` runs N examples per test instead (try 2000 locally),
``REMAT_FUZZ_REPORT=path`` writes the tally (inputs tried / handled cleanly / tracebacks /
hangs) as JSON.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat._io import atomic_write_json
from remat.cli.main import main
from remat.errors import RematError
from remat.plan import Plan, parse_budget, parse_reserve
from remat.workflow import choose_workload, make_receipt
from remat.receipt import Receipt, RunSettings, write_receipt
from remat.workload import BUILTINS, load_workload, parse_shape

from .conftest import TINY, hand_plan

# the shrinker's repr of a 70 kB receipt is long, and harmless
pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")

EXAMPLES = int(os.environ.get("REMAT_FUZZ_EXAMPLES", "0")) or None
SLOW_S = 60.0     # a hang bound for one input, not a speed claim (speed lives in benchmarks/; a loaded CI machine
                  # stretches a 0.1 s parse 20-fold)
TALLY: collections.Counter[str] = collections.Counter()


def fuzz_settings(n: int) -> settings:
    return settings(max_examples=EXAMPLES or n, deadline=None, derandomize=EXAMPLES is None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def outcome(fn: Callable[[], Any], *, typed: tuple[type[BaseException], ...] = (RematError,)) -> Any:
    """Run one input; tally it and fail on an untyped exception or a slow answer."""
    TALLY["tried"] += 1
    t0 = time.perf_counter()
    try:
        result = fn()
    except typed as exc:
        result = exc
    except Exception:
        TALLY["traceback"] += 1
        raise
    elapsed = time.perf_counter() - t0
    if elapsed > SLOW_S:
        TALLY["hang"] += 1
        pytest.fail(f"one input took {elapsed:.1f} s")
    TALLY["clean"] += 1
    return result


@pytest.fixture(scope="module", autouse=True)
def _report_tally():
    yield
    summary = {k: TALLY[k] for k in ("tried", "clean", "traceback", "hang")}
    print(f"\nfuzz tally: {summary}")
    if os.environ.get("REMAT_FUZZ_REPORT"):
        Path(os.environ["REMAT_FUZZ_REPORT"]).write_text(json.dumps(summary) + "\n")


# -- seeds: one real receipt and one real plan ------------------------------------------------------------

MLP = {"batch_size": 64, "width": 64, "depth": 4, "d_in": 8}
SETTINGS = RunSettings(trace_warmup=1, trace_steps=1, verify_steps=1, verify_seeds=1, verify_timing_steps=0,
                       frontier_plans=["none", "all", "optimal"], frontier_steps=1, frontier_warmup=1,
                       capacity_key=None, capacity_tries=1, capacity_steps=1, note="fuzz seed")


@pytest.fixture(scope="module")
def seed_receipt(tmp_path_factory) -> Path:
    """A real receipt folder for the built-in mlp (about 4 s)."""
    torch.set_num_threads(1)
    receipt = make_receipt(load_workload("mlp", MLP), budget="99%", reserve=0.0, settings=SETTINGS)
    assert receipt.decision.status == "ship" and receipt.plan.boundaries
    return write_receipt(receipt, tmp_path_factory.mktemp("seed") / "out").receipt


@pytest.fixture(scope="module")
def seed_plan() -> dict:
    model = load_workload("mlp", TINY["mlp"]).workload.model
    names = [n for n, _ in model.named_modules() if n.startswith("blocks") and n.count(".") == 1]
    return hand_plan(model, names[:2]).to_json()


# -- JSON mutations -----------------------------------------------------------------------------------------

HOSTILE_SCALARS = st.one_of(
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.sampled_from([10 ** 19, 2 ** 63, -(2 ** 63) - 1, 10 ** 400, 10 ** 4000, 0, -1, 1_000_000_000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["false", "true", "no", "1", "1e999", "NaN", "inf", "", "0x10", "__import__('os')",
                     "../../etc/passwd", "os:system", "sympy:sympify", "gpt", "x" * 5000, "\u202e\x00"]),
    st.text(max_size=40),
    st.booleans(),
    st.none(),
)
HOSTILE = st.one_of(HOSTILE_SCALARS, st.lists(HOSTILE_SCALARS, max_size=3),
                    st.dictionaries(st.text(max_size=8), HOSTILE_SCALARS, max_size=3),
                    st.integers(min_value=1, max_value=200).map(lambda n: [[]] * 1 if n < 2 else
                                                                 json.loads("[" * n + "]" * n)))


def node_paths(obj: Any, prefix: tuple = (), out: list | None = None, limit: int = 3000) -> list[tuple]:
    """Paths to the nodes of a JSON value (long lists sampled at their ends)."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    out.append(prefix)
    if isinstance(obj, dict):
        for k, v in obj.items():
            node_paths(v, prefix + (k,), out, limit)
    elif isinstance(obj, list):
        for i in sorted({0, 1, len(obj) - 1} & set(range(len(obj)))):
            node_paths(obj[i], prefix + (i,), out, limit)
    return out


def _parent(obj: Any, path: tuple) -> tuple[Any, Any]:
    node = obj
    for k in path[:-1]:
        node = node[k]
    return node, path[-1]


@st.composite
def mutated_json(draw: st.DrawFn, seed: dict, paths: list[tuple]) -> str:
    """The seed JSON with one or two mutations: a replaced value, a deleted or unknown field, or a text edit."""
    doc = json.loads(json.dumps(seed))
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "wrap"]))
        if not path:
            if op == "replace":
                doc = draw(HOSTILE)
            continue
        value = draw(HOSTILE) if op in ("replace", "add") else None
        name = draw(st.text(min_size=1, max_size=12)) if op == "add" else ""
        try:      # an earlier mutation may have removed or retyped this path: then skip it
            parent, key = _parent(doc, path)
            if op == "replace":
                parent[key] = value
            elif op == "delete":
                del parent[key]
            elif op == "add" and isinstance(parent, dict):
                parent[name] = value
            elif op == "wrap":
                parent[key] = [parent[key]]
        except (KeyError, IndexError, TypeError):
            continue
    try:
        text = json.dumps(doc, allow_nan=True)
    except ValueError:     # an int past Python's own str() limit: write it as text
        text = json.dumps(seed)[:-1] + ', "big": ' + "9" * 5000 + "}"
    edit = draw(st.sampled_from(["none", "none", "none", "truncate", "duplicate", "garbage"]))
    if edit == "truncate":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif edit == "duplicate" and text.startswith("{") and len(text) > 2:
        first_key = text[1:].split(":", 1)[0]
        text = "{" + first_key + ": 1, " + text[1:]
    elif edit == "garbage":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["\x00", "\\", '"', "}", "NaN", "-Infinity", "\udcff", "ï»¿"])) + text[at:]
    return text


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- receipts -------------------------------------------------------------------------------------------------

def test_fuzz_receipt_loading(seed_receipt):
    seed = json.loads(seed_receipt.read_text())
    paths = node_paths(seed)
    Receipt.from_json(seed)               # warm: remat's own lazy imports happen here, not below

    @fuzz_settings(250)
    @given(mutated_json(seed, paths))
    def run(text: str) -> None:
        modules = set(sys.modules)
        result = outcome(lambda: Receipt.loads(text.encode("utf-8", "surrogatepass")))
        assert isinstance(result, (Receipt, RematError))
        if isinstance(result, RematError):
            assert result.exit_code == 2
        else:
            # a receipt never chooses code: without a user-named workload only a built-in is ever run
            chosen = outcome(lambda: choose_workload(result.context.workload, None, cwd=seed_receipt.parent))
            assert isinstance(chosen, RematError) or chosen.spec in BUILTINS
        assert set(sys.modules) == modules, "loading a receipt imported a module"
    run()


def test_fuzz_check_cli_on_mutated_receipts(seed_receipt, tmp_path, monkeypatch):
    """``remat check`` end to end on mutated receipts (workload mismatch, so nothing runs): exit 1 or 2,
    no traceback, nothing written."""
    seed = json.loads(seed_receipt.read_text())
    paths = node_paths(seed)
    folder = tmp_path / "r"
    shutil.copytree(seed_receipt.parent, folder)
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)

    @fuzz_settings(60)
    @given(mutated_json(seed, paths))
    def run(text: str) -> None:
        (folder / "receipt.json").write_bytes(text.encode("utf-8", "surrogatepass"))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = outcome(lambda: main(["check", "r/receipt.json", "--quick", "--workload", "zz_never_imported:build"]))
        assert rc in (1, 2), err.getvalue()
        assert "Traceback" not in err.getvalue()
        assert "zz_never_imported" not in sys.modules
        assert _files(tmp_path) == before
    run()


# -- plans ----------------------------------------------------------------------------------------------------

def test_fuzz_plan_loading_and_applying(seed_plan, tmp_path):
    from remat.wrap import apply
    model = load_workload("mlp", TINY["mlp"]).workload.model
    paths = node_paths(seed_plan)
    path = tmp_path / "plan.json"

    @fuzz_settings(200)
    @given(mutated_json(seed_plan, paths))
    def run(text: str) -> None:
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        plan = outcome(lambda: Plan.load(path))
        if isinstance(plan, RematError):
            assert plan.exit_code == 2
            return
        handle = outcome(lambda: apply(model, plan))
        if not isinstance(handle, RematError):
            handle.remove()
        assert all("forward" not in m.__dict__ for m in model.modules())
    run()


# -- budgets, reserves, shapes ----------------------------------------------------------------------------------

NUMBERISH = st.one_of(
    st.text(alphabet="0123456789.eE+-% ", max_size=30),
    st.from_regex(r"[+-]?[0-9]{1,30}(\.[0-9]{0,10})?([eE][+-]?[0-9]{1,12})?(%|[KMGT]i?B|B|kb)?", fullmatch=True),
    st.text(max_size=30),
    st.sampled_from(["1e999999999", "1e999GiB", "1e20000", "1e999999999%", "inf", "nan", "-0", "0.0%", "1e-999999999"]),
)


@fuzz_settings(600)
@given(NUMBERISH)
def test_fuzz_budget_and_reserve(text):
    b = outcome(lambda: parse_budget(text, 123_456_789))
    assert isinstance(b, RematError) or (isinstance(b, int) and 1 <= b <= 2 ** 60)
    r = outcome(lambda: parse_reserve(text))
    assert isinstance(r, RematError) or 0.0 <= r < 1.0


SHAPE_FACTORY = '''
import torch
from torch import nn
import remat

def build(batch_size: int = 4, scale: float = 1.0, flag: bool = False, name: str = "x", device="cpu",
          dtype=torch.float32):
    return remat.Workload(model=nn.Linear(2, 1), batch=lambda s: torch.ones(2, 2), loss=lambda m, b: m(b).sum())
'''
SHAPE_TEXT = st.lists(
    st.tuples(st.sampled_from(["batch_size", "scale", "flag", "name", "colour", "", "1x", "batch size"]),
              st.sampled_from(["=", "", "=="]),
              st.one_of(NUMBERISH, st.sampled_from(["true", "FALSE", "abc", "__import__('os')", "[1]", "{}"]))),
    max_size=4).map(lambda items: ",".join(k + s + v for k, s, v in items))


def test_fuzz_shape_text(tmp_path, monkeypatch):
    (tmp_path / "sf.py").write_text(SHAPE_FACTORY)
    monkeypatch.chdir(tmp_path)

    @fuzz_settings(300)
    @given(SHAPE_TEXT)
    def run(text: str) -> None:
        loaded = outcome(lambda: load_workload("sf.py:build", parse_shape(text)))
        if not isinstance(loaded, RematError):
            for k, v in loaded.shape.items():   # what reached the factory conforms to its annotations
                want = {"batch_size": int, "scale": (int, float), "flag": bool, "name": str}[k]
                assert isinstance(v, want) and not (want is int and isinstance(v, bool))
    run()


# -- command lines ------------------------------------------------------------------------------------------------

COMMANDS = ["trace", "plan", "verify", "frontier", "receipt", "check"]
FLAG_VALUES = {
    "--workload": st.sampled_from(["mlp", "gpt", "os:system", "nope.py:build", "", ":", "a:b:c", "../x.py:f"]),
    "--shape": SHAPE_TEXT,
    "--budget": NUMBERISH,
    "--reserve": NUMBERISH,
    "--steps": NUMBERISH,
    "--warmup": NUMBERISH,
    "--seeds": NUMBERISH,
    "--threads": NUMBERISH,
    "--planner": st.sampled_from(["optimal", "uniform:0", "uniform:-1", "uniform:99999999999", "bogus", ""]),
    "--plan": st.sampled_from(["plan.json", "missing.json", ".", "/dev/zero", "/proc/self/mem"]),
    "--device": st.sampled_from(["cpu", "cuda", "tpu", "cuda:99", "meta", ""]),
    "--dtype": st.sampled_from(["float32", "int8"]),
    "--plans": st.text(max_size=30),
    "--candidates": st.sampled_from(["(", "*", "blocks.0", "[a-", ""]),
    "--timeout": NUMBERISH,
}


@st.composite
def command_line(draw: st.DrawFn) -> list[str]:
    cmd = draw(st.sampled_from(COMMANDS))
    argv = [cmd]
    if cmd == "check":
        argv.append(draw(st.sampled_from(["receipt.json", "missing.json", ".", "/dev/zero", "plan.json"])))
    for flag in draw(st.lists(st.sampled_from(sorted(FLAG_VALUES)), max_size=5, unique=True)):
        argv += [flag, draw(FLAG_VALUES[flag])]
    if cmd != "check":
        argv += ["--out", "afile"]      # an existing file: whatever else is right, nothing runs or is written
    return argv


def test_fuzz_command_lines(tmp_path, monkeypatch, seed_plan):
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "plan.json").write_text(json.dumps(seed_plan))
    (tmp_path / "receipt.json").write_text('{"kind": "remat-receipt", "schema_version": 1}')
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)

    @fuzz_settings(250)
    @given(command_line())
    def run(argv: list[str]) -> None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = outcome(lambda: main(argv), typed=(RematError, SystemExit))
        code = rc.code if isinstance(rc, SystemExit) else rc
        assert code in (1, 2, 4), (argv, err.getvalue())   # 4: a tiny --timeout ran out first
        assert "Traceback" not in err.getvalue(), (argv, err.getvalue())
        assert _files(tmp_path) == before, argv
    run()


# -- output errors at write time (issue 23): every fault is an OutputError, and no file is left ----------------

WRITE_FAULTS = ("mkdir", "mkstemp", "write", "fsync", "replace")
ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EIO, errno.ENAMETOOLONG)


def test_fuzz_write_faults(tmp_path, monkeypatch):
    import tempfile

    import remat._io as io
    from remat.errors import OutputError
    from remat.receipt.write import write_folder
    writers = {
        "json": lambda out: atomic_write_json(out / "x.json", {"a": [1, 2]}),
        "receipt folder": lambda out: write_folder(out, b"{}\n", lambda: "<body></body>", lambda: "# r"),
    }
    real = {"mkdir": Path.mkdir, "mkstemp": tempfile.mkstemp, "fsync": os.fsync, "replace": os.replace}

    @fuzz_settings(60)
    @given(st.sampled_from(sorted(writers)), st.sampled_from(WRITE_FAULTS), st.sampled_from(ERRNOS),
           st.integers(min_value=0, max_value=2), st.booleans())
    def run(writer: str, fault: str, code: int, after: int, exists: bool) -> None:
        out = Path(tempfile.mkdtemp(dir=tmp_path)) / "out"
        if exists:
            out.mkdir()
        calls = {"n": 0}

        def failing(name: str):
            def call(*a, **k):
                calls["n"] += 1
                if calls["n"] > after:
                    raise OSError(code, os.strerror(code))
                return real[name](*a, **k)
            return call
        with monkeypatch.context() as m:
            if fault == "mkdir":
                m.setattr(Path, "mkdir", failing("mkdir"))
            elif fault == "mkstemp":
                m.setattr(tempfile, "mkstemp", failing("mkstemp"))
            elif fault == "fsync":
                m.setattr(os, "fsync", failing("fsync"))
            elif fault == "replace":
                m.setattr(os, "replace", failing("replace"))
            else:   # the disk fills up mid-write
                m.setattr(io.os, "fdopen", lambda fd, mode: _FailingFile(fd, code))
            result = outcome(lambda: writers[writer](out), typed=(OutputError,))
        leftovers = [p.name for p in out.parent.rglob("*.tmp")]
        assert not leftovers, (writer, fault, leftovers)
        if isinstance(result, OutputError):
            assert os.strerror(code) in result.message
    run()


class _FailingFile:
    """A file whose writes fail with ``code`` (the disk filled up mid-write)."""

    def __init__(self, fd: int, code: int) -> None:
        self.fd, self.code = fd, code

    def __enter__(self) -> "_FailingFile":
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def write(self, data: bytes) -> int:
        raise OSError(self.code, os.strerror(self.code))

    def flush(self) -> None:
        return None

    def fileno(self) -> int:
        return self.fd
