"""Fixtures for the integration suite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/ is not a package; make `tests.httpfault` importable however pytest was started.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.httpfault import FaultServer  # noqa: E402


@pytest.fixture
def fault_server():
    """A loopback HTTP server with programmable faults (see tests/httpfault.py)."""
    with FaultServer() as server:
        yield server
