"""Architecture metrics for docs/DESIGN.md's "Size and shape" table: one run, printed as Markdown.

    python benchmarks/architecture.py            # from the repo root, with the venv's python

What it counts (each figure says which tool produced it):
- functions by cyclomatic (McCabe) complexity, counted by ``radon`` (``radon cc``: boolean operators and
  comprehensions count, so its figures run higher than flake8's C901) over ``src/``;
- functions and methods taking 12 or more parameters (``ast``; ``self``/``cls`` not counted);
- string-key subscripts and ``.get("...")`` reads in the pipeline-parallel path (``ast``: a ``Subscript`` or
  ``.get`` call whose key is a string constant, in ``src/remat/pipeline_parallel`` and ``src/remat/cli/pipeline_parallel.py``),
  the mark of a dict used as a data model; JSON (de)serialisation (``to_json``/``from_json``) is not counted,
  because a JSON object is read by its keys there and only there;
- modules loaded by ``python -S -c "import remat.plan"`` and whether torch is among them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from radon.complexity import cc_visit
from radon import __version__ as RADON_VERSION

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PP_PATHS = [SRC / "remat" / "pipeline_parallel", SRC / "remat" / "cli" / "pipeline_parallel.py"]
JSON_FUNCS = {"to_json", "from_json"}


def complexities() -> list[tuple[int, str]]:
    """(complexity, "path:line name") of every function and method in src/, by radon."""
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


def plan_import() -> tuple[int, bool]:
    code = ("import sys; sys.path.insert(0, %r); import remat.plan; "
            "print(__import__('json').dumps(sorted(sys.modules)))" % str(SRC))
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        return -1, True
    mods = json.loads(res.stdout)
    return len(mods), "torch" in mods


def main() -> None:
    cc = complexities()
    wide = wide_signatures()
    n_mods, torch_loaded = plan_import()
    print("| metric | value |\n|---|---|")
    print(f"| functions above McCabe 20 (radon {RADON_VERSION}) | {sum(1 for c, _ in cc if c > 20)} |")
    print(f"| functions above McCabe 30 | {sum(1 for c, _ in cc if c > 30)} |")
    print(f"| functions above McCabe 40 | {sum(1 for c, _ in cc if c > 40)} |")
    print(f"| functions with >= 12 parameters | {len(wide)} |")
    print(f"| string-key reads in the pipeline-parallel path | {string_key_reads(PP_PATHS)} |")
    print(f"| modules loaded by `python -S -c 'import remat.plan'` | {n_mods} (torch {'loaded' if torch_loaded else 'not loaded'}) |")
    print("\nAbove McCabe 20:")
    for c, where in cc:
        if c > 20:
            print(f"- {c} {where}")
    print("\n>= 12 parameters:")
    for n, where in wide:
        print(f"- {n} {where}")


if __name__ == "__main__":
    main()
