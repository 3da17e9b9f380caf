"""Every code block of README.md and docs/GUIDE.md is checked against the code, so the documents cannot drift.

- ``python`` blocks run (each distinct block once) in a namespace holding the names a reader brings
  (``MyModel``, ``loader``, ``batch``, ``opt``, ``model``, ``loss_fn``, ``train``, ``plan``; a tiny GPT-2
  for the Hugging Face blocks), in a temporary folder with the plan cache there. A block preceded by
  ``<!-- not run: WHY -->`` (a process group, a framework's trainer) is compiled only. Every block, run or
  not, has its remat names resolved and the keywords of its calls to remat checked against the signatures.
- ``bash`` blocks: each ``remat`` command line is parsed by remat's own parser (a line with ``...`` or a
  ``[optional]`` placeholder: each of its ``--flags`` must exist on that subcommand), each ``make`` target
  must be in the Makefile, each ``torchrun`` script must exist and take the flags given.
- ``toml`` blocks: read by the gate's own ``[tool.remat]`` reader (every key known, every value valid).

Running the commands themselves takes minutes each (the demo, the receipt, the suite): their behaviour is
the other tests' subject; here they are held to the parser that would run them.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import shlex
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.cli.main import build_parser
from remat.workflow.gate import PROJECT_KEYS, project_gate

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "GUIDE.md"]
FENCE = re.compile(r"(?:<!-- not run: (?P<why>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    where: str
    lang: str
    body: str
    not_run: str | None


def doc_blocks(paths=DOCS) -> list[Block]:
    out = []
    for path in paths:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start("lang")) + 1
            out.append(Block(f"{path.relative_to(ROOT)}:{line}", m["lang"], m["body"], m["why"]))
    return out


BLOCKS = doc_blocks()


def distinct(lang: str) -> list[Block]:
    seen, out = set(), []
    for b in BLOCKS:
        if b.lang == lang and b.body not in seen:
            seen.add(b.body)
            out.append(b)
    return out


def test_the_documents_have_the_blocks_this_test_expects():
    langs = {b.lang for b in BLOCKS}
    assert langs <= {"python", "bash", "toml"}, langs        # a new kind of block needs a check here first
    readme = [b for b in BLOCKS if b.where.startswith("README")]
    assert sum(b.lang == "python" for b in readme) >= 4 and sum(b.lang == "bash" for b in readme) >= 3
    assert len(Path(ROOT / "README.md").read_text().splitlines()) <= 250      # a front page, not a manual


# -- names and keywords ----------------------------------------------------------------------------------------

def remat_call_problems(source: str) -> list[str]:
    """remat names that do not resolve, and keywords a remat callable does not take."""
    tree = ast.parse(source)
    bound: dict[str, object] = {}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "remat":
                    bound[(a.asname or a.name).split(".")[0]] = remat
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "remat":
            module = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(module, a.name):
                    problems.append(f"{node.module} has no {a.name}")
                else:
                    bound[a.asname or a.name] = getattr(module, a.name)

    def resolve(expr: ast.expr) -> object | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = resolve(expr.value)
            if base is None or not isinstance(base, types.ModuleType):
                return None
            if not hasattr(base, expr.attr):
                problems.append(f"{base.__name__} has no {expr.attr}")
                return None
            return getattr(base, expr.attr)
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = resolve(node.func)
            if fn is None or not callable(fn):
                continue
            params = inspect.signature(fn).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            problems += [f"{getattr(fn, '__qualname__', fn)}() takes no keyword {k.arg}"
                         for k in node.keywords if k.arg is not None and k.arg not in params]
    return problems


def test_a_wrong_name_or_keyword_is_reported():
    assert remat_call_problems("import remat\nremat.auto(m, b, budget='70%', loss_fn=f)\n") == []
    assert remat_call_problems("import remat\nremat.auto(m, b, buget='70%')\nremat.nope(1)\n") == [
        "auto() takes no keyword buget", "remat has no nope"]
    assert remat_call_problems("from remat.integrations.transformers import enabled\n") == [
        "remat.integrations.transformers has no enabled"]


@pytest.mark.parametrize("block", distinct("python"), ids=lambda b: b.where)
def test_python_block_names_resolve(block):
    compile(block.body, block.where, "exec")
    assert remat_call_problems(block.body) == [], block.where


# -- running the python blocks ----------------------------------------------------------------------------------

class Block2(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class MyModel(nn.Module):
    """The reader's model: tiny, causal-LM shaped, ``model(**batch).loss`` like a Hugging Face model."""

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block2(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return types.SimpleNamespace(loss=loss, logits=logits)


def make_batch(i: int, vocab: int = 64) -> dict:
    x = torch.randint(0, vocab, (8, 128), generator=torch.Generator().manual_seed(i))
    return {"input_ids": x, "labels": x.roll(-1, 1)}


def reader_namespace() -> dict:
    torch.manual_seed(0)
    model = MyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = [make_batch(0), make_batch(1)]

    def loss_fn(m, b):
        return m(**b).loss

    def train():
        for b in loader:
            opt.zero_grad()
            loss_fn(model, b).backward()
            opt.step()

    return {"remat": remat, "torch": torch, "MyModel": MyModel, "loader": loader, "batch": loader[0], "model": model, "opt": opt,
            "loss_fn": loss_fn, "train": train}


def hf_namespace() -> dict:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=128))
    x = torch.randint(0, 64, (8, 128), generator=torch.Generator().manual_seed(0))
    return {"remat": remat, "torch": torch, "model": model, "batch": {"input_ids": x, "labels": x},
            "opt": torch.optim.AdamW(model.parameters())}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with the plan cache and ``out/plan/plan.json`` (a plan for the reader's model)."""
    d = tmp_path_factory.mktemp("docs")
    ns = reader_namespace()
    handle = remat.auto(ns["model"], ns["batch"], budget="70%", loss_fn=ns["loss_fn"], optimizer=ns["opt"],
                        cache_dir=str(d / "cache"), segments=False)   # export_check_fn takes no segment (GUIDE)
    (d / "out" / "plan").mkdir(parents=True)
    (d / "out" / "plan" / "plan.json").write_text(json.dumps(handle.plan.to_json()))
    plan = handle.plan
    handle.remove()
    return d, plan


@pytest.mark.parametrize("block", [b for b in distinct("python") if b.not_run is None], ids=lambda b: b.where)
def test_python_block_runs(block, workdir, monkeypatch):
    folder, plan = workdir
    monkeypatch.chdir(folder)
    monkeypatch.setenv("REMAT_CACHE_DIR", str(folder / "cache"))   # the blocks use the default cache
    ns = hf_namespace() if "remat.integrations.transformers" in block.body else reader_namespace()
    ns["plan"] = plan
    exec(compile(block.body, block.where, "exec"), ns)
    if "budget=\"70%\"" in block.body:   # 70% of the unplanned peak: something must be checkpointed
        assert ns["handle"].report.boundaries, f"{block.where}: the example planned nothing"


# -- shell and toml blocks ---------------------------------------------------------------------------------------

def command_lines(body: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", body)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def _subparser(parser, name: str):
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sub.choices.get(name)


def shell_problems(body: str) -> list[str]:
    problems = []
    parser = build_parser()
    makefile = (ROOT / "Makefile").read_text()
    for words in command_lines(body):
        if not words:
            continue
        tool, args = words[0], words[1:]
        if tool == "remat":
            elliptical = "..." in args or any(a.startswith("[") for a in args)
            if elliptical:
                sub = _subparser(parser, args[0])
                if sub is None:
                    problems.append(f"remat has no command {args[0]}")
                    continue
                flags = [a.strip("[]").split("=")[0] for a in args if a.strip("[").startswith("--")]
                problems += [f"remat {args[0]} has no {f}" for f in flags if f not in sub._option_string_actions]
                continue
            try:
                parser.parse_args(args)
            except SystemExit:
                problems.append(f"remat {' '.join(args)}: not accepted by remat's parser")
        elif tool == "make":
            problems += [f"make {t}: no such target" for t in args if not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
        elif tool == "torchrun":
            script = next((a for a in args if a.endswith(".py")), None)
            if script is None or not (ROOT / script).is_file():
                problems.append(f"torchrun: no script {script}")
                continue
            source = (ROOT / script).read_text()
            problems += [f"{script} takes no {a}" for a in args[args.index(script) + 1:]
                         if a.startswith("--") and f'"{a}"' not in source]
        else:
            problems.append(f"a shell line this test cannot check: {' '.join(words)}")
    return problems


def test_a_wrong_command_line_is_reported():
    assert shell_problems("remat plan --workload gpt --budget 50% --out out/p\nmake test\n") == []
    assert shell_problems("remat plan --workload gpt --budgett 50%\nmake nope\n"
                          "remat verify ... --world-sise 2\ntorchrun examples/auto_fsdp2.py --enginee ddp\n") == [
        "remat plan --workload gpt --budgett 50%: not accepted by remat's parser", "make nope: no such target",
        "remat verify has no --world-sise", "examples/auto_fsdp2.py takes no --enginee"]


@pytest.mark.parametrize("block", distinct("bash"), ids=lambda b: b.where)
def test_shell_block_is_accepted(block, capsys):
    assert shell_problems(block.body) == [], block.where


@pytest.mark.parametrize("block", distinct("toml"), ids=lambda b: b.where)
def test_toml_block_is_read_by_the_gate(block, tmp_path):
    (tmp_path / "pyproject.toml").write_text(block.body)
    project_gate(tmp_path)                                  # a bad value raises, naming the key
    import tomllib
    keys = set(tomllib.loads(block.body)["tool"]["remat"])
    assert keys <= set(PROJECT_KEYS) | {"workload"}, keys - set(PROJECT_KEYS)
