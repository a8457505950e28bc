"""Turn `nox --list --json` into a GitHub Actions job matrix: one entry per torch version."""

import json
import sys

sessions = json.load(sys.stdin)
include = [
    {"session": s["session"], "torch": s["call_spec"]["torch"]}
    for s in sessions
    if s["session"].startswith("matrix(")
]
print(json.dumps(include))
