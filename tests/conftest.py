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


@pytest.fixture(scope="session")
def cpu_bundle():
    """The default CPU bundle zip, built by Stoker's builder or reused from the build cache.

    The cache lives in the user cache dir (STOKER_CACHE_DIR overrides), not under STOKER_HOME,
    so only the first session on a machine pays for the build (~6-8 min on 2 cores).
    """
    import sys

    from daemon.bundles.build import build_bundle
    from daemon.paths import StokerPaths

    result = build_bundle(StokerPaths.from_env(), backend="cpu",
                          progress=lambda line: print(f"[cpu_bundle] {line}", file=sys.stderr))
    return result.zip_path


@pytest.fixture
def installed_cpu_bundle(stoker_home, cpu_bundle):
    """The CPU bundle installed (verified, without the smoke run) into this test's STOKER_HOME."""
    from daemon.bundles.installed import install_bundle
    from daemon.paths import StokerPaths

    return install_bundle(cpu_bundle, StokerPaths.from_env())
