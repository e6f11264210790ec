"""The layering rules of STYLE.md, enforced with import-linter's contracts in pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    result = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_no_undefined_or_unused_names():
    """pyflakes' rules through ruff: an undefined name is a crash waiting in a rare path."""
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"
    result = subprocess.run(
        [
            exe,
            "check",
            "--select",
            "F",
            "--output-format",
            "concise",
            "daemon",
            "states",
            "store",
            "tui",
            "tests",
            "docs",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_code_is_formatted():
    """One format everywhere (`ruff format`, line length 120 in pyproject.toml)."""
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"
    result = subprocess.run([exe, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, "run: ruff format .\n" + result.stdout[-3000:] + result.stderr[-2000:]
