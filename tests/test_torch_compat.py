"""The torch people run, and the environment the README builds.

- NOTE [SAC under saved-tensor hooks] (remat/sac_hooks.py): every selective checkpoint remat runs gets
  ``respect_saved_tensors_hooks=False`` where the installed torch's ``checkpoint`` takes the keyword
  (torch >= 2.14), and nothing where it does not (torch 2.13 would hand it to the module's forward).
- NOTE [torchvision import hook] (benchmarks/zoo/_torchvision_cpu.py): a plain script, run by this
  environment's python with nothing of the tests around it, imports transformers, diffusers, timm and peft.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat.profile.dryrun as dryrun_mod
import remat.wrap.wrapper as wrapper_mod
from remat.sac_hooks import KEYWORD, sac_checkpoint_kwargs
from remat.types import CheckpointMode
from remat.wrap.wrapper import CheckpointWrapper


def _next_checkpoint(calls: list):
    """torch's checkpoint as torch >= 2.14 spells it: with the keyword, recorded, then dropped for 2.13's."""
    def checkpoint(fn, *args, respect_saved_tensors_hooks=None, **kwargs):
        calls.append(respect_saved_tensors_hooks)
        return torch_checkpoint(fn, *args, **kwargs)
    return checkpoint


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_keyword_is_passed_only_to_a_checkpoint_that_takes_it():
    calls: list = []
    assert sac_checkpoint_kwargs(_next_checkpoint(calls)) == {KEYWORD: False}
    assert sac_checkpoint_kwargs(lambda fn, *a, use_reentrant=None, **kw: None) == {}   # **kwargs is not the keyword
    # the installed torch, read the same way (torch 2.13 has no such keyword)
    takes = KEYWORD in __import__("inspect").signature(torch_checkpoint).parameters
    assert sac_checkpoint_kwargs(torch_checkpoint) == ({KEYWORD: False} if takes else {})


@pytest.mark.parametrize("mode", [CheckpointMode.SELECTIVE, CheckpointMode.RECOMPUTE_POINTWISE, CheckpointMode.FULL])
def test_a_planned_selective_region_chooses_false_explicitly(monkeypatch, mode):
    expected = _grads(_mlp())
    calls: list = []
    monkeypatch.setattr(wrapper_mod, "checkpoint", _next_checkpoint(calls))
    model = _mlp()
    CheckpointWrapper(model, "", mode).install()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected))
    # a selective (op-level) region says False; FULL has no selective cache, so torch's default stays
    assert calls == ([False] if mode is not CheckpointMode.FULL else [None])


def test_with_the_installed_torch_a_selective_region_still_trains_bitwise():
    """The safe twin: the real checkpoint of this torch (2.13 takes no such keyword: passing it would reach
    the module's forward as an unexpected argument)."""
    expected = _grads(_mlp())
    model = _mlp()
    CheckpointWrapper(model, "", CheckpointMode.SELECTIVE).install()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected))


def test_the_mode_dry_runs_choose_false_too(monkeypatch):
    calls: list = []
    monkeypatch.setattr(dryrun_mod, "checkpoint", _next_checkpoint(calls))
    model = _mlp()
    remove = dryrun_mod._wrap(model, CheckpointMode.SAVE_ATTENTION)
    _grads(model)
    remove()
    assert calls == [False]


# -- a plain script in this environment ----------------------------------------------------------------------

PLAIN_SCRIPT = """
import diffusers, peft, timm, torchvision, transformers
from transformers import LlamaConfig, LlamaForCausalLM
print("imported", transformers.__version__)
"""
PACKAGES = ("transformers", "diffusers", "timm", "peft", "torchvision")   # torchvision: timm's own dependency


def _run_plain(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "plain.py"
    script.write_text(source)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REMAT_TORCHVISION_HOOK")}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)   # a hang bound, not a speed claim


def test_a_plain_script_imports_the_integrations(tmp_path):
    missing = []
    for name in PACKAGES:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (make test installs them: pip install -e '.[zoo,integrations]')")
    done = _run_plain(tmp_path, PLAIN_SCRIPT)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-3000:]
    hook = Path(sysconfig.get_paths()["purelib"]) / "_remat_torchvision_cpu.pth"
    if hook.exists():
        # the wrong case the hook is there for: without it, this torchvision does not import beside this torch
        off = _run_plain(tmp_path, "import torchvision\n", REMAT_TORCHVISION_HOOK="0")
        assert off.returncode != 0 and "torchvision::nms does not exist" in off.stderr, off.stderr[-3000:]
