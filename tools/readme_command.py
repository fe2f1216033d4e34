#!/usr/bin/env python
"""Print the test command written in README.md (the code block after `<!-- test-command -->`).

  python tools/readme_command.py install   # the part before the first `&&` (the install step)
  python tools/readme_command.py test      # the part after it (the tests)
  python tools/readme_command.py           # the whole command
"""
import re, sys
from pathlib import Path

text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
m = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n```", text, re.S)
if not m: sys.exit("README.md has no <!-- test-command --> block")
cmd = m.group(1).strip()
install, _, tests = cmd.partition(" && ")
part = sys.argv[1] if len(sys.argv) > 1 else "all"
print({"install": install, "test": tests, "all": cmd}[part])
