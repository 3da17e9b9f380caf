"""The plan cache of ``remat.auto`` never hands back a stale plan (issue 23, part 3).

Each case changes something that moves the step's measured peak without changing the model's
fingerprint (a Python attribute, ``nn.Dropout``'s ``p``, a buffer, a submodule's ``training``
flag, Hugging Face's ``attn_implementation``, a loss's ``functools.partial`` arguments, closure,
defaults): after a first ``remat.auto`` populated the cache, the changed step must miss (it is
re-planned, and its profiled peak differs), and the same change made again (a safe twin, built
afresh) must hit. Then: a broken entry (truncated, a foreign plan, a plan naming a missing
module) is a warning naming the file and is replaced; an unusable cache directory is a warning
and the plan is still applied; the key is the same in two fresh processes (NOTE [plan cache key],
NOTE [stable value digest] in src/remat/autoplan/).

Fast: two tiny blocks, a budget far over the peak (no boundary to search: the closed loop
measures once), first replay estimates (``measure_replays=False``), one cache per module so the
unchanged build is planned once.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import remat
from remat.autoplan import BrokenCacheEntryWarning, CacheStatus, UnusableCacheDirWarning

ROOT = Path(__file__).resolve().parents[1]
D, ROWS = 16, 128                         # features, batch rows: activations dominate the peak
FAST = dict(budget="1GiB", measure_replays=False)


class Width(enum.Enum):
    NARROW = 2
    WIDE = 4


class Opts:                               # a plain object: its repr holds an address
    def __init__(self, expand: int) -> None:
        self.expand = expand


@dataclasses.dataclass(kw_only=True)
class Knobs:
    """What a Block's forward reads; each field moves the peak."""

    expand: int = 2                       # repeats of the hidden row: the saved tanh output's width
    mode: str = "narrow"                  # "wide": expand doubled
    width: Width = Width.NARROW           # enum: expand = width.value
    repeats: tuple[int, int] = (1, 1)     # h.repeat(*repeats) before the tanh
    opts: Opts | None = None              # Opts(expand=k): expand = k
    dropout: float = 0.0                  # p of the block's Dropout (0 saves no mask)
    scale_rows: int = 1                   # the buffer's rows: tanh(h[:, None] * scale) is (B, rows, d)
    scale_dtype: torch.dtype = torch.float32


class Block(nn.Module):
    def __init__(self, knobs: Knobs) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.drop = nn.Dropout(knobs.dropout)
        self.register_buffer("scale", torch.ones(knobs.scale_rows, D, dtype=knobs.scale_dtype))
        self.expand, self.mode, self.width, self.repeats = knobs.expand, knobs.mode, knobs.width, knobs.repeats
        if knobs.opts is not None:
            self.opts = knobs.opts

    def factor(self) -> int:
        k = self.expand * (2 if self.mode == "wide" else 1) * self.width.value // 2
        return self.opts.expand if hasattr(self, "opts") else k

    def forward(self, x: torch.Tensor) -> torch.Tensor:         # (B, D) -> (B, D)
        h = self.drop(self.lin(x)).repeat(*self.repeats).repeat(1, self.factor())      # (B*r0, D*k*r1)
        h = torch.tanh(h.unsqueeze(1) * self.scale.repeat(1, h.shape[-1] // D))        # (B*r0, rows, D*k*r1)
        return h.sum(1).view(h.shape[0], -1, D).sum(1)[:x.shape[0]].to(x.dtype)


class Net(nn.Module):
    def __init__(self, knobs: Knobs | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(knobs or Knobs()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def plain_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def repeated_loss(model: nn.Module, x: torch.Tensor, reps: int = 1) -> torch.Tensor:
    """The output repeated ``reps`` times through a tanh: its saved output grows with ``reps``."""
    return torch.tanh(model(x).repeat(reps, 1)).square().mean()


def positional_loss(reps: int, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return repeated_loss(model, x, reps)


def closure_loss(reps: int) -> Callable:
    def loss(model, x):
        return repeated_loss(model, x, reps)
    return loss


def default_loss(reps: int) -> Callable:
    def loss(model, x, reps=reps):
        return repeated_loss(model, x, reps)
    return loss


def kwdefault_loss(reps: int) -> Callable:
    def loss(model, x, *, reps=reps):
        return repeated_loss(model, x, reps)
    return loss


class RepeatedLoss:
    """A callable object as the loss: its attribute moves the peak."""

    def __init__(self, reps: int) -> None:
        self.reps = reps

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return repeated_loss(model, x, self.reps)


def batch() -> torch.Tensor:
    return torch.randn(ROWS, D, generator=torch.Generator().manual_seed(0))


def step(knobs: Knobs | None = None, loss: Callable = plain_loss, eval_dropout: bool = False) -> tuple:
    """(model, batch, loss) of one build; the same arguments give an identical build."""
    torch.manual_seed(0)
    model = Net(knobs)
    if eval_dropout:
        for b in model.blocks:
            b.drop.eval()
    return model, batch(), loss


def gpt2_step(attn_implementation: str) -> tuple:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    # attn_pdrop=0: CPU sdpa then runs its flash kernel, which saves no attention matrix (with dropout
    # it falls back to the math kernel, and the two peaks are equal)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=64, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, attn_implementation=attn_implementation)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, None


# name -> (the first build, the changed build): each change moves the peak, none changes the fingerprint
CASES: dict[str, tuple[Callable[[], tuple], Callable[[], tuple]]] = {
    "int attribute (expand)": (step, lambda: step(Knobs(expand=4))),
    "str attribute (mode)": (step, lambda: step(Knobs(mode="wide"))),
    "enum attribute (width)": (step, lambda: step(Knobs(width=Width.WIDE))),
    "tuple attribute (repeats)": (step, lambda: step(Knobs(repeats=(2, 1)))),
    "plain object attribute (0x repr)": (lambda: step(Knobs(opts=Opts(2))), lambda: step(Knobs(opts=Opts(4)))),
    "nn.Dropout(p)": (step, lambda: step(Knobs(dropout=0.5))),
    "submodule eval()": (lambda: step(Knobs(dropout=0.5)), lambda: step(Knobs(dropout=0.5), eval_dropout=True)),
    "buffer shape": (step, lambda: step(Knobs(scale_rows=4))),
    "buffer dtype": (step, lambda: step(Knobs(scale_dtype=torch.float64))),
    "partial keyword": (lambda: step(loss=functools.partial(repeated_loss, reps=2)),
                        lambda: step(loss=functools.partial(repeated_loss, reps=8))),
    "partial argument": (lambda: step(loss=functools.partial(positional_loss, 2)),
                         lambda: step(loss=functools.partial(positional_loss, 8))),
    "closure value": (lambda: step(loss=closure_loss(2)), lambda: step(loss=closure_loss(8))),
    "default argument": (lambda: step(loss=default_loss(2)), lambda: step(loss=default_loss(8))),
    "keyword-only default": (lambda: step(loss=kwdefault_loss(2)), lambda: step(loss=kwdefault_loss(8))),
    "callable object's attribute": (lambda: step(loss=RepeatedLoss(2)), lambda: step(loss=RepeatedLoss(8))),
    "HF GPT-2 attn_implementation": (lambda: gpt2_step("sdpa"), lambda: gpt2_step("eager")),
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plan-cache")


def _auto(build: tuple, cache_dir: Path, **kw: Any) -> remat.AutoHandle:
    model, x, loss = build
    handle = remat.auto(model, x, loss_fn=loss, cache_dir=cache_dir, **{**FAST, **kw})
    handle.remove()
    return handle


@pytest.mark.parametrize("case", list(CASES))
def test_a_change_that_moves_the_peak_is_a_miss_and_its_twin_a_hit(case, cache_dir):
    first_build, changed_build = CASES[case]
    first = _auto(first_build(), cache_dir)
    assert first.report.cache in (CacheStatus.STORED, CacheStatus.HIT)
    changed = _auto(changed_build(), cache_dir)
    assert changed.report.cache is CacheStatus.STORED, f"{case}: a stale hit"
    assert changed.report.baseline_peak_bytes != first.report.baseline_peak_bytes, \
        f"{case}: the change does not move the peak, so it proves nothing"
    twin = _auto(changed_build(), cache_dir)
    assert twin.report.cache is CacheStatus.HIT, f"{case}: the same change made twice re-planned"
    assert twin.report.cache_path == changed.report.cache_path


def _entry(build: tuple, cache_dir: Path) -> Path:
    return Path(_auto(build, cache_dir).report.cache_path)


def test_truncated_entry_is_a_miss_named_and_replaced(tmp_path):
    path = _entry(step(), tmp_path)
    path.write_text(path.read_text()[:40])
    with pytest.warns(BrokenCacheEntryWarning, match=path.name):
        h = _auto(step(), tmp_path)
    assert h.report.cache is CacheStatus.STORED
    assert remat.Plan.load(path).fingerprint == h.plan.fingerprint       # replaced by a whole plan
    assert _auto(step(), tmp_path).report.cache is CacheStatus.HIT


def test_foreign_plan_is_a_miss_named_and_replaced(tmp_path):
    """Another model's plan under this key (FingerprintMismatch), then a plan naming a module this model
    lacks (CandidateError): each a warning naming the file, re-planned and replaced, never fatal."""
    from remat.plan import Boundary
    from remat.profile import fingerprint
    path = _entry(step(), tmp_path)
    own = remat.Plan.load(path)
    dataclasses.replace(own, fingerprint=fingerprint(nn.Sequential(nn.Linear(3, 3)))).save(path)
    with pytest.warns(BrokenCacheEntryWarning, match=rf"{path.name}.*FingerprintMismatch"):
        h = _auto(step(), tmp_path)
    assert h.report.cache is CacheStatus.STORED and remat.Plan.load(path).fingerprint == own.fingerprint
    missing = Boundary(module="blocks.9", mode=remat.CheckpointMode.FULL, saved_bytes=0, replay_ms=0.0)
    dataclasses.replace(own, boundaries=[missing]).save(path)
    with pytest.warns(BrokenCacheEntryWarning, match=rf"{path.name}.*CandidateError"):
        h = _auto(step(), tmp_path)
    assert h.report.cache is CacheStatus.STORED and remat.Plan.load(path).boundaries == own.boundaries
    assert _auto(step(), tmp_path).report.cache is CacheStatus.HIT


def _applied_without_cache(where: Path) -> None:
    """The example's tiny LM under 75% of its peak (it needs checkpoints): planned, applied, not stored."""
    sys.path.insert(0, str(ROOT / "examples"))
    import auto_plain_loop as ex
    cfg = ex.SIZES["tiny"]
    torch.manual_seed(0)
    model = ex.TinyLM(cfg["vocab"], cfg["d"], cfg["layers"])
    t = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UnusableCacheDirWarning, match=str(where)):
        h = remat.auto(model, (t[:, :-1], t[:, 1:]), budget="75%", loss_fn=ex.loss_fn, cache_dir=where,
                       measure_replays=False)
    assert h.report.cache is CacheStatus.NOT_STORED and h.active and h.wrappers, "the plan is applied all the same"
    assert "not-stored" in h.report.summary()
    h.remove()


def test_a_file_where_the_cache_directory_should_be_is_a_warning(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    _applied_without_cache(tmp_path / "file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "plans").write_text("not a directory")
    _applied_without_cache(tmp_path / "dir")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_cache_directory_is_a_warning(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _applied_without_cache(ro)
    finally:
        ro.chmod(0o755)


def kitchen_sink_key() -> str:
    """The cache key of a build holding every kind of value the digest converts (sets, an enum, a plain
    object with an address in its repr, a partial, a closure, a tuple, a dtype), as a hex digest."""
    from remat.autoplan.run import AutoSettings, _cache_key
    from remat.autoplan.source import ModelSource, OptimizerSpec
    from remat.types import no_progress
    model, x, _ = step(Knobs(opts=Opts(3), width=Width.WIDE, repeats=(2, 1), scale_dtype=torch.float64))
    model.tags = {"alpha", "beta", "gamma", "delta"}            # a set: its order depends on PYTHONHASHSEED
    model.flags = frozenset({"x", "y", "z"})
    loss = functools.partial(closure_loss(3))
    settings = AutoSettings(budget="1GiB", loss_fn=loss, optimizer=None, verify=None, cache_dir=None,
                            use_cache=True, reserve=0.05, planner="optimal", copy_fn=None, measure_replays=False,
                            segments=True, progress=no_progress)
    source = ModelSource(model, x, loss, OptimizerSpec.of(model, None), torch.device("cpu"))
    return _cache_key(source, settings, []).digest


def test_the_key_is_the_same_in_two_fresh_processes():
    code = "from tests.test_cache_stale import kitchen_sink_key; print(kitchen_sink_key())"
    keys = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT / "src")}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        keys.append(out.stdout.strip().splitlines()[-1])
    assert keys[0] == keys[1] == kitchen_sink_key()


def test_an_address_in_a_repr_is_never_keyed():
    """A plain object by its structure; one without any (a C object whose repr is an address) by its class."""
    from remat.autoplan.digest import StableDigest
    plain = StableDigest().value(Opts(3))
    assert plain == StableDigest().value(Opts(3)) != StableDigest().value(Opts(4))
    assert not re.search(r"0x[0-9a-fA-F]{4,}", json.dumps(plain))
    assert re.search(r"0x[0-9a-fA-F]{4,}", repr(torch.Generator()))
    opaque = StableDigest().value(torch.Generator())
    assert opaque[0] == "object" and len(opaque) == 2 and opaque == StableDigest().value(torch.Generator())
