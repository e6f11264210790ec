"""The layering rules of STYLE.md, enforced with import-linter's contracts in pyproject.toml."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.source_links import source_links

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(source_links())}  # the packages by their installed names
    result = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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


def test_the_wheel_lists_every_package_of_the_tree():
    """pyproject.toml names the installed packages one by one (package-dir maps stoker.daemon to
    daemon/...): a new subpackage missing from the list would be left out of the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {
        "stoker." + ".".join(init.parent.relative_to(ROOT).parts)
        for root in ("daemon", "states", "store", "tui")
        for init in (ROOT / root).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert listed == tree, {
        "missing from pyproject.toml": sorted(tree - listed),
        "not in the tree": sorted(listed - tree),
    }
