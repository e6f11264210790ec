"""The TUI's line to the daemon: blocking calls and the event stream, used from threads.

`SocketLink` is the real one (daemon.control.client over the control socket). Anything with the same
three methods works: the snapshot tests feed the app recorded data through a fake link.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Protocol

from stoker.daemon.control.client import ControlClient

QUERY_TIMEOUT_S = 10.0
# `down` waits for the server to stop (TERM, grace, KILL): give actions room.
ACTION_TIMEOUT_S = 120.0


class EventSource(Protocol):
    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def close(self) -> None: ...


class DaemonLink(Protocol):
    """What the app needs from the daemon; every method blocks and raises StokerError."""

    @property
    def where(self) -> str: ...

    def call(self, method: str, /, **params: Any) -> Any: ...

    def act(self, method: str, /, **params: Any) -> Any: ...

    def subscribe(self) -> EventSource: ...


class SocketLink:
    """The daemon's control socket: one client for quick queries, one for slow actions."""

    def __init__(self, socket_path: os.PathLike[str] | str) -> None:
        self.socket_path = Path(socket_path)
        self._queries = ControlClient(self.socket_path, timeout=QUERY_TIMEOUT_S)
        self._actions = ControlClient(self.socket_path, timeout=ACTION_TIMEOUT_S)

    @property
    def where(self) -> str:
        return str(self.socket_path)

    def call(self, method: str, /, **params: Any) -> Any:
        """A query (status, history, telemetry, snapshot.list)."""
        return self._queries.call(method, **params)

    def act(self, method: str, /, **params: Any) -> Any:
        """An action that may take a while (down waits for the server to stop)."""
        return self._actions.call(method, **params)

    def subscribe(self) -> EventSource:
        return ControlClient(self.socket_path, timeout=QUERY_TIMEOUT_S).subscribe()

    def close(self) -> None:
        self._queries.close()
        self._actions.close()
