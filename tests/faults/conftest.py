"""Fixtures for the fault suite: the integration suite's real daemon, engine and tiny model."""

from __future__ import annotations

import pytest

from tests.integration.conftest import big_model, daemon, fault_server, model, tiny_bytes, two_workers  # noqa: F401  (fixtures shared as they are)


@pytest.fixture
def service(stoker_home):
    """A pull service on this test's STOKER_HOME (the daemon's own, run in the test's process)."""
    from stoker.daemon.core.paths import StokerPaths
    from stoker.daemon.models.pull import PullService
    from stoker.store import open_store

    paths = StokerPaths.from_env()
    paths.make_private()
    store = open_store(paths.db_file)
    yield PullService(paths, store)
    store.close()
