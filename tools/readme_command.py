#!/usr/bin/env python
"""Print the test command written in README.md (the code block after `<!-- test-command -->`).

  python tools/readme_command.py install   # the install steps (every `&&` part before the one that runs nbdev_test)
  python tools/readme_command.py test      # the tests (from nbdev_test on)
  python tools/readme_command.py           # the whole command
"""
import re, sys
from pathlib import Path

text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
m = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n```", text, re.S)
if not m: sys.exit("README.md has no <!-- test-command --> block")
cmd = m.group(1).strip()
parts = cmd.split(" && ")
first_test = next((i for i, p in enumerate(parts) if p.startswith("nbdev_test")), len(parts))
install, tests = " && ".join(parts[:first_test]), " && ".join(parts[first_test:])
part = sys.argv[1] if len(sys.argv) > 1 else "all"
print({"install": install, "test": tests, "all": cmd}[part])
