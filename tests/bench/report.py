"""Shared by the benchmarks: the engine they run, a line describing the machine, and a section
writer for docs/."""

from __future__ import annotations

import os
import platform
import re
import statistics
from pathlib import Path
from typing import Any, Callable

BENCHMARKS_DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def engine_bundle(paths: Any, zip_path: Path | None = None, progress: Callable[[str], None] | None = None) -> Any:
    """The engine a benchmark runs, installed into `paths`' home: the bundle zip it was given
    (`--bundle`), else the CPU build (from the build cache once built)."""
    from stoker.daemon.bundles.build import build_bundle
    from stoker.daemon.bundles.installed import install_bundle

    if zip_path is None:
        zip_path = build_bundle(paths, backend="cpu", progress=progress or (lambda _: None)).zip_path
    return install_bundle(zip_path, paths)


def machine() -> str:
    """CPU model, core count and Python version: enough to compare runs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores (shared); Python {platform.python_version()}"


def write_section(heading: str, body: str, doc: Path = BENCHMARKS_DOC) -> None:
    """Replace (or append) the `## heading` section of the doc, keeping the rest intact."""
    heading = heading if heading.startswith("## ") else f"## {heading}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    doc.write_text(text)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    if len(ordered) < 2:  # none (a busy machine finished no request in a window): nan, not a crash
        return ordered[0] if ordered else float("nan")
    return statistics.quantiles(ordered, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]
