"""The package is a house with one direction: every import (module level, inside a function, or a module loaded by
name) points to a module lower in LAYERS. Checked with the `ast` module on the generated package."""
import ast, json, re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "unsloth_prep"
# bottom first: utilities, outputs, readers, the step type and the executor, the tasks, checks, training, commands
LAYERS = ["memory", "fixtures", "base", "outputs", "loading", "split", "steps", "parallel", "convert", "collators",
          "tokenizer", "tokenization", "config", "checks", "preference", "pretrain", "vision", "oom", "pipeline",
          "doctor", "training", "export", "api", "demo", "cli"]
MODULES = sorted(p.stem for p in PKG.glob("*.py") if not p.name.startswith("_"))


def imported_modules(src: str, own: str) -> set:
    "Our modules that `src` imports: `from . import x`, `from .x import y`, `unsloth_prep.x`, and names in strings."
    found = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom):
            base = (f"unsloth_prep.{node.module}" if node.module else "unsloth_prep") if node.level else node.module or ""
            if base == "unsloth_prep": found |= {a.name for a in node.names}
            elif base.startswith("unsloth_prep."): found.add(base.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("unsloth_prep.")}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("unsloth_prep."):
            found.add(node.value.split(".")[1])  # importlib.import_module("unsloth_prep.x") and command tables
    return {m for m in found if m in MODULES and m != own}


def upward(module: str) -> list:
    "Imports of `module` that reach a module at or above its own layer."
    here = LAYERS.index(module)
    deps = imported_modules((PKG / f"{module}.py").read_text(), module)
    return sorted(d for d in deps if d not in LAYERS or LAYERS.index(d) > here)


def test_the_check_can_fail():
    src = "from .pipeline import x\nimport unsloth_prep.cli\ndef f():\n    from unsloth_prep import training\n"
    assert imported_modules(src, "base") == {"pipeline", "cli", "training"} & set(MODULES)
    assert imported_modules('importlib.import_module("unsloth_prep.demo")', "cli") == {"demo"}


def test_every_module_has_a_layer():
    assert sorted(set(MODULES) - set(LAYERS)) == []


@pytest.mark.parametrize("module", [m for m in LAYERS if m in MODULES])
def test_imports_point_down(module):
    if module == "cli": return  # the entry point loads every command's module by name: it is the top
    assert upward(module) == [], f"{module} imports modules above it: {upward(module)}"


NBS = ROOT / "nbs"
# a cell may import a later notebook's module only to show what that module registers into this one's registry
SHOWS_REGISTERED = {("06_steps", "preference"), ("07_scale", "convert"), ("13_checks", "oom")}


def notebook_imports(path: Path) -> set:
    "Our modules imported by the code cells of a notebook (any cell, parsed with `ast`; magics skipped)."
    found = set()
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code": continue
        src = "\n".join(l for l in "".join(cell["source"]).splitlines() if not l.lstrip().startswith(("%", "!")))
        try: tree = ast.parse(src)
        except SyntaxError: continue
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("unsloth_prep."):
                found.add(n.module.split(".")[1])
            elif isinstance(n, ast.ImportFrom) and n.module == "unsloth_prep":
                found |= {a.name for a in n.names}
            elif isinstance(n, ast.Import):
                found |= {a.name.split(".")[1] for a in n.names if a.name.startswith("unsloth_prep.")}
    return found


def test_notebooks_in_dependency_order():
    "No notebook imports, in any cell, the module of a notebook numbered after it."
    exported = {}
    for nb in sorted(NBS.glob("[0-9]*.ipynb")):
        m = re.search(r"#\|\s*default_exp\s+(\S+)", nb.read_text())
        if m: exported[m.group(1).strip('\\n"')] = nb.stem
    assert len(exported) >= 20
    later = [(nb.stem, mod, exported[mod]) for nb in sorted(NBS.glob("[0-9]*.ipynb"))
             for mod in notebook_imports(nb) if mod in exported and exported[mod] > nb.stem
             and (nb.stem, mod) not in SHOWS_REGISTERED]
    assert not later, f"notebooks importing a later notebook's module: {later}"
