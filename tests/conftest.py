"""Fixtures shared by every suite."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def stoker_home(tmp_path_factory, monkeypatch):
    """Point STOKER_HOME at a fresh directory so a developer's own state never leaks in."""
    home = tmp_path_factory.mktemp("stoker-home")
    monkeypatch.setenv("STOKER_HOME", str(home))
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    return home


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A seeded 2-layer, 128-wide random-weight llama GGUF (SPM vocab): loads in milliseconds."""
    from daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny.gguf")
