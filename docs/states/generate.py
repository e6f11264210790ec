"""Write docs/states/<machine>.md from the transition tables, and docs/states/policies.md from the
decision tables beside them: `python docs/states/generate.py`.

`--check` exits 1 if a committed page differs from what the tables say (the test suite
runs the same comparison).
"""

from __future__ import annotations

import sys
from pathlib import Path

from stoker.states import policy_tables
from stoker.states.diagrams import SPECS, document

HERE = Path(__file__).resolve().parent


def pages() -> dict[Path, str]:
    """Each machine's page path and its generated content, and the decision tables' page."""
    machines = {HERE / f"{spec.name}.md": document(spec) for spec in SPECS}
    return {**machines, HERE / "policies.md": policy_tables.document()}


def main(argv: list[str]) -> int:
    stale = []
    for path, text in pages().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if "--check" in argv:
            stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python docs/states/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
