"""The type checker in the suite: mypy over stoker.daemon, .states, .store and .tui (pyproject's [tool.mypy]).

states/ and store/ are checked strictly, daemon/ and tui/ with every body checked. mypy's
incremental cache lives in the user cache dir (STOKER_CACHE_DIR overrides), never in the tree,
so a run after a small change takes seconds rather than a full check.
"""

import subprocess
import sys
from pathlib import Path

from stoker.daemon.core.paths import StokerPaths
from tests.source_links import source_links

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_type_errors():
    source_links()  # pyproject's mypy_path: the packages by their installed names
    cache = StokerPaths.from_env().cache_dir / "mypy"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout
