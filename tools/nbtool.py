#!/usr/bin/env python
"""Developer tool: edit notebooks as plain text, execute them in place to refresh outputs.

  python tools/nbtool.py nb2py nbs/08_convert.ipynb > /tmp/03.py   # notebook -> editable text
  python tools/nbtool.py py2nb /tmp/03.py nbs/08_convert.ipynb     # text -> notebook (outputs dropped)
  python tools/nbtool.py run nbs/08_convert.ipynb                  # execute in place, keep outputs, nbdev_clean

Text format: a line `# %% [md]` starts a markdown cell (raw markdown follows),
a line `# %%` starts a code cell. py2nb keeps the id (and outputs) of every unchanged cell and gives new cells a
fresh id, so the cell ids nbdev_export writes into the modules stay stable.
"""
import json, subprocess, sys, uuid
from pathlib import Path

MD, CODE = "# %% [md]", "# %%"


def parse_cells(text):
    """Split percent-format text into (cell_type, source) pairs."""
    cells, kind, buf = [], None, []
    for line in text.splitlines():
        if line.strip() in (MD, CODE):
            if kind: cells.append((kind, "\n".join(buf).strip("\n")))
            kind, buf = ("markdown" if line.strip() == MD else "code"), []
        else:
            buf.append(line)
    if kind: cells.append((kind, "\n".join(buf).strip("\n")))
    return cells


def py2nb(src, dst):
    """Write the notebook `dst` from percent text `src`, keeping outputs of code cells whose source is unchanged."""
    old = {}
    if Path(dst).exists():
        for c in json.loads(Path(dst).read_text())["cells"]:
            old.setdefault((c["cell_type"], "".join(c["source"])), c)
    cells, used = [], set()
    for kind, source in parse_cells(Path(src).read_text()):
        prev = old.get((kind, source), {})
        cid = prev.get("id") if prev.get("id") not in used else None
        cid = cid or uuid.uuid4().hex[:8]  # stable ids: nbdev_export writes them into the modules
        used.add(cid)
        cell = {"cell_type": kind, "id": cid, "metadata": {}, "source": source.splitlines(keepends=True)}
        if kind == "code": cell.update(execution_count=None, outputs=prev.get("outputs", []))
        cells.append(cell)
    nb = {"cells": cells, "metadata": {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    tmp = Path(str(dst) + ".tmp")
    tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(dst)


def nb2py(path):
    """Percent text of a notebook."""
    out = []
    for c in json.loads(Path(path).read_text())["cells"]:
        out.append(MD if c["cell_type"] == "markdown" else CODE)
        out.append("".join(c["source"]))
    return "\n".join(out) + "\n"


def run(path, timeout=3600):
    """Execute a notebook in place from its own folder so outputs come from its own run, then nbdev_clean it."""
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor
    nb = nbformat.read(path, as_version=4)
    ExecutePreprocessor(timeout=timeout, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(Path(path).parent)}})
    nbformat.write(nb, path)
    subprocess.run(["nbdev_clean", "--fname", str(path)], check=True)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "py2nb": py2nb(*args)
    elif cmd == "nb2py": sys.stdout.write(nb2py(args[0]))
    elif cmd == "run":
        for a in args: run(a)
    else: sys.exit(__doc__)
