"""Typed replies of the socket methods that are records in their own right.

A handler returns one of these (or another attrs record, such as daemon.control.status's
`Status`); the control server writes it as JSON through states/convert.py's one converter, and
a client reads it back with `ControlClient.call(method, returns=Record)`, which ignores fields
it does not know and names the ones it needs and did not get (daemon_version_skew).
"""

from __future__ import annotations

import attrs

from store.catalog import ModelRecord


@attrs.frozen
class Pong:
    """`ping`: the daemon is alive, with its pid and the version it runs."""

    pong: bool
    pid: int
    version: str | None = None  # absent from daemons before it was added


@attrs.frozen
class ServedBy:
    """A configured model that serves a cataloged file, and its launch state."""

    name: str
    state: str


@attrs.frozen
class CatalogModel(ModelRecord):
    """A cataloged model as `model.list` shows it: the catalog row and who serves it now."""

    served_by: tuple[ServedBy, ...] = ()


@attrs.frozen
class PullState:
    """A pull machine's state and why it is there (unfinished pulls included)."""

    name: str | None
    state: str
    reason: str | None
    spec: str | None


@attrs.frozen
class ModelList:
    """`model.list`: the catalog and every pull machine."""

    models: tuple[CatalogModel, ...]
    pulls: tuple[PullState, ...]
