"""Fixtures for the fault suite: the integration suite's real daemon, engine and tiny model."""

from __future__ import annotations

from tests.integration.conftest import big_model, daemon, fault_server, model, tiny_bytes, two_workers  # noqa: F401  (fixtures shared as they are)
