"""The house rules a reader feels, checked on the package and the notebooks (sizes as in fastcore's own notebooks)."""
import ast, io, json, re, statistics, tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p for p in (ROOT / "unsloth_prep").glob("*.py") if not p.name.startswith("_"))
NOTEBOOKS = sorted((ROOT / "nbs").glob("*.ipynb"))
EXPORT = re.compile(r"^\s*#\|\s*export[si]?\b")


def cells(nb):
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(nb.read_text())["cells"]]


def export_cells(nb):
    return [src for kind, src in cells(nb) if kind == "code" and EXPORT.match(src)]


def only_imports(src):
    body = [l for l in src.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    return all(l.startswith(("import ", "from ")) for l in body)


def long_functions(src, limit=50):
    nodes = [n for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in nodes if n.end_lineno - n.lineno + 1 > limit]


def chained_lines(src):
    toks = tokenize.generate_tokens(io.StringIO(src).readline)
    return sorted({t.start[0] for t in toks if t.type == tokenize.OP and t.string == ";"})


def test_checks_can_fail():
    # the measures below must see what they are meant to see
    assert long_functions("def f():\n" + "    x = 1\n" * 60) == ["f (61 lines)"]
    assert long_functions("def f():\n    return 1\n") == []
    assert EXPORT.match("#| export\nx = 1") and EXPORT.match("#| exporti") and not EXPORT.match("#| hide")
    assert chained_lines('x = 1; y = 2\n"a; b"\n# c; d\n') == [1]
    assert only_imports("#| export\nimport os\nfrom x import y") and not only_imports("#| export\nimport os\nX = 1")


@pytest.mark.parametrize("mod", MODULES, ids=lambda p: p.name)
def test_functions_and_lines(mod):
    src = mod.read_text()
    assert long_functions(src) == [], f"{mod.name}: functions over 50 lines"
    wide = [i + 1 for i, line in enumerate(src.splitlines()) if len(line) > 120 and not line.startswith("__all__")]
    assert wide == [], f"{mod.name}: lines over 120 characters at {wide[:10]}"
    chained = chained_lines(src)
    assert chained == [], f"{mod.name}: several statements on one line at {chained[:10]}"


def test_export_cell_sizes():
    sizes = [len(src.splitlines()) for nb in NOTEBOOKS for src in export_cells(nb)]
    assert statistics.median(sizes) <= 15, f"median export cell {statistics.median(sizes)} lines"
    big = [(nb.name, len(src.splitlines())) for nb in NOTEBOOKS for src in export_cells(nb) if len(src.splitlines()) > 50]
    assert big == [], f"export cells over 50 lines: {big}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_every_export_cell_is_followed_by_a_test(nb):
    cs = cells(nb)
    bare = []
    for i, (kind, src) in enumerate(cs):
        if kind != "code" or not EXPORT.match(src) or only_imports(src):
            continue
        nxt = next((s for k, s in cs[i + 1:] if k == "code"), None)
        if nxt is not None and EXPORT.match(nxt):
            bare.append(src.splitlines()[1][:60] if len(src.splitlines()) > 1 else src[:60])
    assert bare == [], f"{nb.name}: export cells followed directly by another export cell: {bare}"


SOURCES = re.compile(r"(?i:\bthe seeds?\b|\bseeds'|\bseed 0\d\d\b)|\bSPEC\b")


def test_product_text_names_no_source_documents():
    files = [*NOTEBOOKS, ROOT / "README.md", *MODULES, *(ROOT / "docs").glob("*.md")]
    hits = [f"{f.name}:{i + 1}" for f in files for i, line in enumerate(f.read_text(errors="replace").splitlines())
            if SOURCES.search(line)]
    assert hits == [], f"product text cites source documents: {hits[:10]}"
