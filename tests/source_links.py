"""The tree under its installed names, for tools that cannot follow setuptools' editable hook.

Installed, Stoker's packages are stoker.daemon, stoker.states, stoker.store and stoker.tui
(pyproject.toml, package-dir). mypy and import-linter read the source through links named that
way: .venv/stoker-src/stoker/daemon -> daemon/, and so on (`./dev` makes them too).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("daemon", "states", "store", "tui")


def source_links() -> Path:
    """The directory to put on a tool's path (it holds `stoker/`), its links made if missing."""
    farm = ROOT / ".venv" / "stoker-src"
    package = farm / "stoker"
    package.mkdir(parents=True, exist_ok=True)
    for name in ROOTS:
        link = package / name
        if not link.is_symlink():
            os.symlink(Path("..", "..", "..", name), link)
    return farm
