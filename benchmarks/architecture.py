"""Architecture metrics for docs/DESIGN.md's "Size and shape" table: one run, printed as Markdown.

    python benchmarks/architecture.py            # from the repo root, with the venv's python
    python benchmarks/architecture.py --write    # the same, and rewrite DESIGN.md's "after" column

tests/test_docs.py checks that DESIGN.md's "after" column is what :func:`table_rows` measures now (the
radon rows only where radon is installed).

What it counts (each figure says which tool produced it):
- functions by cyclomatic (McCabe) complexity, counted by ``radon`` (``radon cc``: boolean operators and
  comprehensions count, so its figures run higher than flake8's C901) over ``src/``;
- functions and methods taking 12 or more parameters (``ast``; ``self``/``cls`` not counted);
- string-key subscripts and ``.get("...")`` reads in the pipeline-parallel path (``ast``: a ``Subscript`` or
  ``.get`` call whose key is a string constant, in ``src/remat/distributed/pipeline``, the ``pipeline`` modules of plan and workflow),
  the mark of a dict used as a data model; JSON (de)serialisation (``to_json``/``from_json``) is not counted,
  because a JSON object is read by its keys there and only there;
- modules loaded by ``python -S -c "import remat.plan"`` and whether torch, numpy or scipy is among them.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DESIGN = ROOT / "docs" / "DESIGN.md"
HEAVY = ("torch", "numpy", "scipy")
PP_PATHS = [SRC / "remat" / "distributed" / "pipeline", SRC / "remat" / "plan" / "pipeline.py",
            SRC / "remat" / "workflow" / "pipeline.py"]
JSON_FUNCS = {"to_json", "from_json"}


def complexities() -> list[tuple[int, str]]:
    """(complexity, "path:line name") of every function and method in src/, by radon."""
    from radon.complexity import cc_visit   # only here: the ast figures need no radon
    out = []
    for path in sorted(SRC.rglob("*.py")):
        for block in cc_visit(path.read_text()):
            for fn in [block, *getattr(block, "methods", [])]:
                if fn.letter in ("F", "M"):
                    out.append((fn.complexity, f"{path.relative_to(SRC)}:{fn.lineno} {fn.fullname}"))
    return sorted(set(out), reverse=True)


def wide_signatures(threshold: int = 12) -> list[tuple[int, str]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) >= threshold:
                    out.append((len(names), f"{path.relative_to(SRC)}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def string_key_reads(paths: list[Path]) -> int:
    """String-constant subscripts and .get("...") calls outside to_json/from_json (see the module docstring)."""
    n = 0
    files = [p for base in paths if base.exists() for p in ([base] if base.is_file() else sorted(base.rglob("*.py")))]
    for path in files:
        tree = ast.parse(path.read_text())
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in JSON_FUNCS:
                skip.update(id(x) for x in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                n += 1
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                n += 1
    return n


def loaded_modules(module: str) -> list[str] | None:
    """``sys.modules`` after ``python -S -c "import <module>"`` (src/ on the path); None when the import fails."""
    code = ("import sys; sys.path.insert(0, %r); import %s; "
            "print(__import__('json').dumps(sorted(sys.modules)))" % (str(SRC), module))
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(res.stdout) if res.returncode == 0 else None


def import_cell(module: str) -> str:
    """``"129 (18 of them remat's), no torch, numpy or scipy"``: the table's import-weight figure."""
    mods = loaded_modules(module)
    if mods is None:
        return "fails under python -S"
    heavy = [h for h in HEAVY if h in mods]
    own = sum(1 for m in mods if m == "remat" or m.startswith("remat."))
    return f"{len(mods)} ({own} of them remat's), " + (f"{', '.join(heavy)} loaded" if heavy else "no torch, numpy or scipy")


def _named(items: list[tuple[int, str]]) -> str:
    """``"2 (`auto` 17, `plan_closed_loop` 14)"``: a count, then each function's name and figure."""
    return str(len(items)) + (" (" + ", ".join(f"`{w.rsplit(' ', 1)[1].rsplit('.', 1)[-1]}` {n}" for n, w in items) + ")"
                              if items else "")


def table_rows(*, radon: bool = True) -> dict[str, str]:
    """DESIGN.md's "Size and shape" rows as measured now: metric -> its "after" cell (the radon rows only with ``radon``)."""
    rows = {}
    if radon:
        cc = complexities()
        for limit in (20, 30, 40):
            rows[f"functions above McCabe {limit}" + (" (radon)" if limit == 20 else "")] = _named(
                [x for x in cc if x[0] > limit])
    rows["functions with >= 12 parameters"] = _named(wide_signatures())
    rows["string-key reads in the pipeline-parallel path"] = str(string_key_reads(PP_PATHS))
    rows["modules loaded by `python -S -c 'import remat.plan'`"] = import_cell("remat.plan")
    return rows


def design_rows(text: str) -> dict[str, list[str]]:
    """The first table under ``## Size and shape``: metric -> its other cells (before, after)."""
    section = re.search(r"^## Size and shape.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "docs/DESIGN.md has no '## Size and shape' section"
    rows: dict[str, list[str]] = {}
    for line in section.group(1).splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not set(cells[0]) <= set("-: ") and cells[0] != "metric":
            rows[cells[0]] = cells[1:]
    return rows


def write_design(rows: dict[str, str]) -> None:
    """Rewrite the "after" (last) cell of each measured row of DESIGN.md's "Size and shape" table."""
    lines = DESIGN.read_text().splitlines(keepends=True)
    table = design_rows("".join(lines))
    for i, line in enumerate(lines):
        cells = line.strip().strip("|").split("|")
        metric = cells[0].strip()
        if line.startswith("|") and metric in rows and metric in table:
            lines[i] = "| " + " | ".join([metric, *table[metric][:-1], rows[metric]]) + " |\n"
    DESIGN.write_text("".join(lines))


def main() -> None:
    cc = complexities()
    wide = wide_signatures()
    rows = table_rows()
    from radon import __version__ as radon_version
    print(f"radon {radon_version}\n\n| metric | after |\n|---|---|")
    for metric, cell in rows.items():
        print(f"| {metric} | {cell} |")
    if "--write" in sys.argv[1:]:
        write_design(rows)
        print(f"\nwrote the after column of {DESIGN.relative_to(ROOT)}")
    print("\nAbove McCabe 20:")
    for c, where in cc:
        if c > 20:
            print(f"- {c} {where}")
    print("\n>= 12 parameters:")
    for n, where in wide:
        print(f"- {n} {where}")


if __name__ == "__main__":
    main()
