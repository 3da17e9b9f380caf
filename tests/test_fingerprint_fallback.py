"""Model fingerprints for classes without readable source (issue 15, NOTE [class identity without
source] in remat/profile/fingerprint.py): a file loaded without a sys.modules entry, a notebook
cell, a class exec'd from a string. Stable within and across processes; a changed class differs."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import linecache
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

from remat.plan import Plan
from remat.profile import fingerprint

NET = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        """A model in a user's file."""

        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) * SCALE
    ''')


def _load(path: Path, name: str, *, register: bool):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_unregistered_file_class_hashes_as_its_source(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(NET.replace("SCALE", "2.0"))
    registered = _load(path, "remat_test_fp_registered", register=True)
    try:
        loose = _load(path, "remat_test_fp_loose", register=False)
        with pytest.raises((OSError, TypeError)):   # the case that used to fall back to the name
            inspect.getsource(loose.Net)
        a, b = fingerprint(registered.Net()), fingerprint(loose.Net())
        assert a.digest == b.digest and b.structural_classes == ()
        want = hashlib.sha256(inspect.getsource(registered.Net).encode()).hexdigest()[:16]
        assert dict(b.class_source_hashes)["Net"] == want
        path.write_text(NET.replace("SCALE", "3.0"))      # a changed class: another hash
        linecache.checkcache(str(path))
        changed = _load(path, "remat_test_fp_loose2", register=False)
        diffs = [str(d) for d in a.differences(fingerprint(changed.Net()))]
        assert diffs == ["source of class Net changed"]
    finally:
        sys.modules.pop("remat_test_fp_registered", None)


CELL = NET.replace("SCALE", "2.0")
SCRIPT = textwrap.dedent('''
    import json, linecache, sys
    from remat.profile import fingerprint

    def cell(source, filename):
        # what IPython does with a cell: its source in linecache under a made-up file name
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        ns = {"__name__": "__main__"}
        exec(compile(source, filename, "exec"), ns)
        return ns["Net"]

    def string(source):
        ns = {"__name__": "__main__"}
        exec(compile(source, "<string>", "exec"), ns)
        return ns["Net"]

    src = sys.stdin.read()
    nb, st = fingerprint(cell(src, "/tmp/ipykernel_1/2741.py")()), fingerprint(string(src)())
    print(json.dumps([nb.digest, list(nb.structural_classes), st.digest, list(st.structural_classes)]))
    ''')




def _digests(src: str) -> list:
    """[notebook digest, structural classes, exec'd digest, structural classes], in this process."""
    out: list = []
    ns = {"SRC": src, "print": lambda s: out.append(json.loads(s))}
    exec(SCRIPT.replace("src = sys.stdin.read()", "src = SRC"), ns)
    return out[0]


def test_notebook_and_exec_classes_are_stable_within_and_across_processes():
    here = _digests(CELL)
    assert here[1] == [] and here[3] == ["Net"]      # a cell has source (linecache); a bare exec does not
    assert _digests(CELL) == here                    # the class defined again: same identity
    proc = subprocess.run([sys.executable, "-c", SCRIPT], input=CELL, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == here
    changed = _digests(CELL.replace("* 2.0", "* 3.0"))   # the wrong case: another constant in forward
    assert changed[0] != here[0] and changed[2] != here[2]


def test_structural_fingerprint_round_trips_through_plan_json():
    ns: dict = {"__name__": "__main__"}
    exec(compile(CELL, "<string>", "exec"), ns)
    fp = fingerprint(ns["Net"]())
    assert fp.structural_classes == ("Net",)
    plan = Plan(planner="none", budget_bytes=None, reserve=0.0, boundaries=[], excluded=[], predicted_peak_bytes=0,
                predicted_overhead_ms=0.0, baseline_peak_bytes=0, baseline_step_ms=0.0, fingerprint=fp)
    back = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back.fingerprint == fp and back.fingerprint.differences(fingerprint(ns["Net"]())) == []
    other = fingerprint(nn.Sequential(nn.Linear(4, 4)))
    assert "structural_classes" not in other.to_json()    # fingerprints with source are unchanged
