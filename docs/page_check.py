"""What each generator of a docs page does from the command line: write the page, or with
`--check` fail (exit 1) when the page on disk is not what the code generates."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(page: Path, text: str, argv: list[str], script: str) -> int:
    """Write `text` to `page`, or with --check say it is stale (rerun `script`)."""
    if "--check" in argv:
        if (page.read_text() if page.exists() else "") != text:
            print(f"{page} is stale: run python {script}", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    return 0
