#!/usr/bin/env python
"""Generate README.md from nbs/index.ipynb (quarto is not installable here).

  python tools/make_readme.py          # write README.md
  python tools/make_readme.py --check  # exit 1 when README.md is not what index.ipynb gives
"""
import json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^\s*#\|")


def render(nb_path=ROOT / "nbs" / "index.ipynb") -> str:
    """Markdown of the index notebook: markdown cells as they are, visible code cells as python blocks."""
    parts = ["<!-- generated from nbs/index.ipynb by tools/make_readme.py: edit the notebook, not this file -->"]
    for cell in json.loads(Path(nb_path).read_text(encoding="utf-8"))["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            parts.append(src.strip())
        elif not re.search(r"^\s*#\|\s*(hide|include:\s*false)", src, re.M):
            code = "\n".join(l for l in src.splitlines() if not DIRECTIVE.match(l)).strip()
            if code: parts.append(f"```python\n{code}\n```")
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    text, readme = render(), ROOT / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text(encoding="utf-8") != text:
            sys.exit("README.md is out of date: run `python tools/make_readme.py` and commit it")
        print("README.md is up to date")
    else:
        readme.write_text(text, encoding="utf-8")
