"""The documents the code cites live in the repo, and every citation resolves (no torch needed).

Scanned: ``src/**/*.py``, ``README.md``, ``docs/*.md``, ``pyproject.toml`` and the ``Makefile`` (the *citing
files*). The rules, kept simple:

- **Stage table.** The first table under ``## The stages`` in ``docs/DESIGN.md``: each row's first cell
  names one layer by its backticked modules (``remat.`` dropped; a layer of several sibling modules,
  ``_json | _io | units | clock | _lazy`` in pyproject.toml, is one row naming each). The rows, top to bottom,
  must be the ``layers`` of the ``[tool.importlinter]`` contract, in order; every module of
  ``src/remat`` must belong to a layer.
- **File paths.** A citation is a token ending in ``.py``, ``.md`` or ``.toml`` that contains a ``/``
  (``plan/cost.py``, ``src/remat/wrap/wrapper.py``, ``benchmarks/zoo/run.py``, ``docs/DESIGN.md``);
  also, in ``src/``, a bare ``name.py`` (a sibling module), and anywhere a bare ``.toml`` or a bare
  ``.md`` whose stem is in capitals (the repo's documents: ``DESIGN.md``; lowercase bare names such as
  ``report.md`` are files remat writes). It resolves when it exists relative to the repo root,
  ``src/``, ``src/remat/`` or the citing file's folder. Not checked: URLs, run outputs and placeholders
  (a first folder ``out/`` or in capitals: ``OUT/pipeline.md``, ``DIR/...``). References to files of
  other projects, and illustrative paths, are listed in :data:`NOT_IN_REPO` with the reason (and each
  entry must still be cited somewhere, so the list cannot go stale).
- **NOTE blocks.** Cited: every ``NOTE [name]`` (the name may wrap onto the next line). Defined: a
  line that is exactly ``NOTE [name]`` once a leading ``#`` or opening ``\"\"\"`` is stripped, in
  ``src/**/*.py`` or ``benchmarks/**/*.py`` (a benchmark's NOTE is about its own measurements and is
  cited as ``in benchmarks/x.py``). Every cited name is defined exactly once. A citation that says
  where (``NOTE [name] in LOC`` or ``NOTE [name] (LOC)``, LOC a path or a dotted ``remat.`` module;
  other words after ``in`` are not locations) must name the file, or a package holding the file,
  that defines it.
- **Module names.** ``remat.a.b`` in the documents, and in comments and strings of ``src/``, resolves:
  each part is a submodule of the part before it, or a name that occurs in that module's source
  (so ``remat.auto`` and ``remat.wrap.recover_handle`` pass, ``remat.pipeline`` does not).
- **Size table.** The "after" column of the first table under ``## Size and shape`` in ``docs/DESIGN.md`` is
  what ``benchmarks/architecture.py`` measures now (its ``table_rows``; the radon rows only where radon is
  installed, the others by ``ast`` and an import under ``python -S``).
- **Issue numbers.** No ``issue N`` in ``src/`` (the project's own tracker is not the code's
  documentation), except another project's, named just before it (``pytorch issue 96136``):
  :data:`EXTERNAL_ISSUE_PROJECTS`.

Each rule is a function over plain text, and each has a test feeding it a deliberately wrong case.
"""

from __future__ import annotations

import importlib.util
import io
import re
import tokenize
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "remat"
DESIGN = ROOT / "docs" / "DESIGN.md"

# Paths the code and the documents cite that are not files of this repo, each with the reason.
NOT_IN_REPO = {
    "torch/utils/checkpoint.py": "torch's source (DESIGN.md's style models)",
    "torch/distributed/_tools/mem_tracker.py": "torch's source (DESIGN.md's style models)",
    "mem_tracker.py": "the same torch file, named by its style in remat/trace/recorder.py",
    "torchtitan/distributed/activation_checkpoint.py": "torchtitan's source (DESIGN.md's style models)",
    "file.py": "the placeholder of a workload spec, file.py:fn",
    "path/to/file.py": "the placeholder of a workload spec, path/to/file.py:build",
    "work.py": "an example workload spec in a docstring (./work.py:build)",
    "train/remat_workload.py": "README's example of a user's [tool.remat] workload setting",
}

# Projects whose issue numbers may be cited in src/ (the word just before "issue").
EXTERNAL_ISSUE_PROJECTS = {"pytorch", "torchtitan", "megatron-lm"}


def citing_files() -> dict[Path, str]:
    files = [*sorted(SRC.rglob("*.py")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "pyproject.toml", ROOT / "Makefile"]
    return {p: p.read_text() for p in files}


def where(path: Path, text: str, pos: int) -> str:
    """``file:line`` of offset ``pos`` in ``text``."""
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


# --- the stage table ------------------------------------------------------------------------------------

def contract_layers(pyproject_text: str) -> list[frozenset[str]]:
    """The import-linter ``layers`` contract, top layer first; each layer the set of its modules."""
    contracts = tomllib.loads(pyproject_text)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("type") == "layers"]
    return [frozenset(m.strip() for m in layer.split("|")) for layer in layers]


def stage_table(design_text: str) -> list[frozenset[str]]:
    """The modules of each row of the first table under ``## The stages``, top row first."""
    section = re.search(r"^## The stages.*?$(.*?)(?=^## |\Z)", design_text, re.M | re.S)
    assert section, "docs/DESIGN.md has no '## The stages' section"
    rows = []
    for line in section.group(1).splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        first = line.split("|")[1]
        names = re.findall(r"`([\w.]+)`", first)
        if names:   # the header and the |---| line name no modules
            rows.append(frozenset(n.removeprefix("remat.") for n in names))
    return rows


def table_mismatches(rows: list[frozenset[str]], layers: list[frozenset[str]]) -> list[str]:
    """Where the table and the contract differ, row by row (empty when they agree)."""
    out = [f"row {i}: table {sorted(r)} but contract {sorted(c)}"
           for i, (r, c) in enumerate(zip(rows, layers)) if r != c]
    if len(rows) != len(layers):
        out.append(f"the table has {len(rows)} rows, the contract {len(layers)} layers")
    return out


def modules_outside_layers(layers: list[frozenset[str]]) -> list[str]:
    """Modules of src/remat that belong to no layer."""
    named = set().union(*layers)
    tops = [p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__")]
    tops += [p.name for p in PKG.iterdir() if (p / "__init__.py").exists()]
    return sorted(m for m in tops if m not in named)


def test_stage_table_is_the_import_linter_contract():
    layers = contract_layers((ROOT / "pyproject.toml").read_text())
    assert table_mismatches(stage_table(DESIGN.read_text()), layers) == []
    assert modules_outside_layers(layers) == []


def test_a_wrong_stage_table_is_rejected():
    layers = contract_layers((ROOT / "pyproject.toml").read_text())
    rows = stage_table(DESIGN.read_text())
    swapped = [rows[1], rows[0], *rows[2:]]
    assert len(table_mismatches(swapped, layers)) == 2
    assert table_mismatches(rows[:-1], layers) == [f"the table has {len(rows) - 1} rows, the contract {len(layers)} layers"]
    assert modules_outside_layers(layers[1:]) == ["cli"]


# --- file paths -----------------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w./~-])((?:[\w-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:py|md|toml))(?![\w/-])")


def is_citation(token: str, citing: Path) -> bool:
    if "/" in token:
        first = token.split("/")[0]
        return first != "out" and not first.isupper()
    stem, ext = token.rsplit(".", 1)
    return ext == "toml" or (ext == "py" and citing.suffix == ".py") or (ext == "md" and stem.isupper())


def resolve(token: str, citing: Path) -> list[Path]:
    """The files or folders ``token`` may mean, that exist."""
    return [base / token for base in (ROOT, SRC, PKG, citing.parent) if (base / token).exists()]


def cited_paths(files: dict[Path, str]) -> list[tuple[Path, str, int]]:
    """(citing file, path token, offset) of every path citation."""
    return [(path, m.group(1), m.start()) for path, text in files.items()
            for m in PATH.finditer(text) if is_citation(m.group(1), path)]


def broken_paths(files: dict[Path, str]) -> list[str]:
    return [f"{where(path, files[path], pos)}: {token}" for path, token, pos in cited_paths(files)
            if token not in NOT_IN_REPO and not resolve(token, path)]


def test_every_cited_path_exists():
    assert broken_paths(citing_files()) == []


def test_every_allowed_outside_path_is_still_cited():
    assert set(NOT_IN_REPO) - {token for _, token, _ in cited_paths(citing_files())} == set()


def test_a_missing_path_is_reported():
    fake = PKG / "fake.py"
    text = ("# remat/__init__.py, errors.py, docs/DESIGN.md, OUT/pipeline.md, torch/utils/checkpoint.py\n"
            "# https://example.org/nope/gone.py\n# plan/nope.py and gone.py and NOPE.md\n")
    assert broken_paths({fake: text}) == ["src/remat/fake.py:3: plan/nope.py",
                                          "src/remat/fake.py:3: gone.py",
                                          "src/remat/fake.py:3: NOPE.md"]
    assert broken_paths({ROOT / "README.md": "`report.md` and `gone.py` are not citations here"}) == []


# --- NOTE blocks ----------------------------------------------------------------------------------------

NOTE_DEF = re.compile(r"""^\s*(?:#\s*|[rR]?(?:\"\"\"|'''))?NOTE \[([^\]\n]+)\]\s*$""")
NOTE_CITE = re.compile(r"NOTE\s+\[([^\]]{1,80})\](?:\s+in\s+|\s*\()?`?([\w./]*)")


def note_definitions(files: dict[Path, str]) -> dict[str, list[str]]:
    defs: dict[str, list[str]] = {}
    for path, text in files.items():
        for i, line in enumerate(text.splitlines(), 1):
            m = NOTE_DEF.match(line)
            if m:
                defs.setdefault(m.group(1), []).append(f"{path.relative_to(ROOT)}:{i}")
    return defs


def location(loc: str, citing: Path) -> list[Path] | None:
    """The files or packages a citation's LOC names; None when LOC is not a location."""
    loc = loc.rstrip(".")
    if loc.endswith(".py") or "/" in loc:
        return resolve(loc, citing)
    if loc.startswith("remat."):
        base = SRC.joinpath(*loc.split("."))
        return [p for p in (base.with_suffix(".py"), base) if p.exists()]
    return None


def note_problems(cites: dict[Path, str], defs: dict[str, list[str]]) -> list[str]:
    out = [f"NOTE [{name}] is defined {len(at)} times: {', '.join(at)}" for name, at in defs.items() if len(at) > 1]
    for path, text in cites.items():
        for m in NOTE_CITE.finditer(text):
            name = re.sub(r"\s*\n\s*(?:#\s*)?", " ", m.group(1)).strip()
            at = where(path, text, m.start())
            if name not in defs:
                out.append(f"{at}: NOTE [{name}] is defined nowhere")
                continue
            places = location(m.group(2), path) if m.group(2) else None
            if places is None:
                continue
            home = ROOT / defs[name][0].split(":")[0]
            if not any(home == p or p in home.parents for p in places):
                out.append(f"{at}: NOTE [{name}] cited in {m.group(2)}, defined in {defs[name][0]}")
    return out


def definition_files() -> dict[Path, str]:
    return {p: p.read_text() for p in [*sorted(SRC.rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]}


def test_every_cited_note_is_defined_once_where_it_is_said_to_be():
    assert note_problems(citing_files(), note_definitions(definition_files())) == []


def test_a_wrong_note_citation_is_reported():
    defs = {"fake note": ["src/remat/errors.py:1"]}   # a made-up definition in a real file
    fake = PKG / "fake.py"
    text = ("# NOTE [fake note] in remat/errors.py, NOTE [fake note] in remat.errors, NOTE [fake\n"
            "# note] in the errors module\n"
            "# NOTE [made-up note] and NOTE [fake note] in clock.py and NOTE [fake note] (remat.types)\n")
    assert note_problems({fake: text}, defs) == [
        "src/remat/fake.py:3: NOTE [made-up note] is defined nowhere",
        "src/remat/fake.py:3: NOTE [fake note] cited in clock.py, defined in src/remat/errors.py:1",
        "src/remat/fake.py:3: NOTE [fake note] cited in remat.types, defined in src/remat/errors.py:1"]
    twice = note_definitions({fake: '"""NOTE [x]\n\nNOTE [x]\n"""\n# NOTE [x]: a citation, not a definition\n'})
    assert note_problems({}, twice) == ["NOTE [x] is defined 2 times: src/remat/fake.py:1, src/remat/fake.py:3"]


# --- module names ---------------------------------------------------------------------------------------

MODULE = re.compile(r"(?<![\w.])remat((?:\.[A-Za-z_]\w*)+)(?![\w{])")


def module_resolves(parts: list[str]) -> bool:
    here = PKG
    for name in parts:
        if here.is_dir() and ((here / name).is_dir() or (here / f"{name}.py").is_file()):
            here = here / name if (here / name).is_dir() else here / f"{name}.py"
            continue
        source = (here / "__init__.py" if here.is_dir() else here).read_text()
        return re.search(rf"\b{re.escape(name)}\b", source) is not None
    return True


def prose(path: Path, text: str) -> list[tuple[int, str]]:
    """(offset, text) of what is prose: a whole document, or a Python file's comments and strings."""
    if path.suffix != ".py":
        return [(0, text)]
    starts = [0, *(i + 1 for i, c in enumerate(text) if c == "\n")]
    return [(starts[tok.start[0] - 1] + tok.start[1], tok.string)
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type in (tokenize.COMMENT, tokenize.STRING)]


def unresolved_modules(files: dict[Path, str]) -> list[str]:
    out = []
    for path, text in files.items():
        for offset, chunk in prose(path, text):
            for m in MODULE.finditer(chunk):
                if not module_resolves(m.group(1).split(".")[1:]):
                    out.append(f"{where(path, text, offset + m.start())}: {m.group(0)}")
    return out


def test_every_named_remat_module_exists():
    assert unresolved_modules(citing_files()) == []


def test_a_missing_module_is_reported():
    fake = PKG / "fake.py"
    text = 'remat.pipeline = 1  # remat.errors.RematError, remat.auto, remat.pipeline\n"""remat.errors.nope."""\n'
    assert unresolved_modules({fake: text}) == ["src/remat/fake.py:1: remat.pipeline",
                                               "src/remat/fake.py:2: remat.errors.nope"]


# --- issue numbers --------------------------------------------------------------------------------------

ISSUE = re.compile(r"(?:([\w-]+)\s+)?\bissues?\s+#?\d+", re.I)


def own_issue_refs(files: dict[Path, str]) -> list[str]:
    return [f"{where(path, text, m.start())}: {m.group(0).strip()}"
            for path, text in files.items() if path.suffix == ".py"
            for m in ISSUE.finditer(text) if (m.group(1) or "").lower() not in EXTERNAL_ISSUE_PROJECTS]


def test_no_own_issue_numbers_in_src():
    assert own_issue_refs(citing_files()) == []


def test_an_own_issue_number_is_reported():
    fake = PKG / "fake.py"
    text = "# fixed for issue 17 (pytorch issue 96136; Megatron-LM issue 6491; tissue 3)\nIssue #4\n"
    assert own_issue_refs({fake: text}) == ["src/remat/fake.py:1: for issue 17", "src/remat/fake.py:2: Issue #4"]


# --- the size table -------------------------------------------------------------------------------------

def architecture():  # noqa: ANN201 - benchmarks/architecture.py, loaded from its path (benchmarks is no package)
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "benchmarks" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def size_mismatches(table: dict[str, list[str]], measured: dict[str, str]) -> list[str]:
    """Each measured row whose "after" (last) cell in the table differs (or that the table lacks)."""
    return [f"{metric}: DESIGN.md says {table[metric][-1] if metric in table else 'nothing'!r}, measured {cell!r}"
            for metric, cell in measured.items() if metric not in table or table[metric][-1] != cell]


def test_size_table_is_what_the_code_measures():
    """Run ``PYTHONPATH=src python benchmarks/architecture.py --write`` to regenerate it."""
    arch = architecture()
    table = arch.design_rows(DESIGN.read_text())
    assert len(table) == 6
    measured = arch.table_rows(radon=importlib.util.find_spec("radon") is not None)
    assert size_mismatches(table, measured) == []


def test_a_stale_size_table_is_reported():
    arch = architecture()
    text = ("## Size and shape\n\n| metric | before | after |\n|---|---|---|\n"
            "| functions with >= 12 parameters | 4 | 1 (`auto` 17) |\n| string-key reads in the pipeline-parallel path | 275 | 2 |\n")
    table = arch.design_rows(text)
    assert table == {"functions with >= 12 parameters": ["4", "1 (`auto` 17)"],
                     "string-key reads in the pipeline-parallel path": ["275", "2"]}
    measured = {"functions with >= 12 parameters": "2 (`auto` 17, `plan_closed_loop` 14)",
                "string-key reads in the pipeline-parallel path": "2", "functions above McCabe 30": "0"}
    assert size_mismatches(table, measured) == [
        "functions with >= 12 parameters: DESIGN.md says '1 (`auto` 17)', measured '2 (`auto` 17, `plan_closed_loop` 14)'",
        "functions above McCabe 30: DESIGN.md says 'nothing', measured '0'"]
