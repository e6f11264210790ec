"""`serve_frontdoor`: the front door's HTTP server inside the root nursery.

It binds `[frontdoor] host:port` (loopback by default, 127.0.0.1:11436). A port another
program holds does not stop the daemon: the front door logs why and stays off, the rest of the
daemon serves on. A reload that changes `enabled`, `host` or `port` closes the old address and
listens on the new one; the requests the old one took are answered on. Requests are served by
daemon/frontdoor/http11.py (trio sockets, h11 parsing requests) and routed by `FrontDoor` (app.py); the engine
is reached through one `EngineWire` (its keep-alive pool) for the daemon's life.
"""

from __future__ import annotations

import gc
import logging
import socket
from typing import Awaitable, Callable

import attrs
import trio

from stoker.daemon.core.http import loopback_client
from stoker.daemon.engine.wire import EngineWire, WireTimeouts
from stoker.daemon.frontdoor.app import FrontDoor
from stoker.daemon.frontdoor.hold import Hold
from stoker.daemon.frontdoor.ollama import OllamaApi
from stoker.daemon.frontdoor.http11 import bound_url, open_listeners, serve_http
from stoker.daemon.frontdoor.daemon_view import Authorize, FrontDoorDaemon, allow_loopback

log = logging.getLogger("stoker.frontdoor")

# A silent engine socket: connecting is instant on loopback; between two chunks of an answer the
# engine may think for a long while (a non-streaming completion sends nothing until done).
ENGINE_TIMEOUT = WireTimeouts(connect=5.0, read=900.0, write=60.0)
# The collector's thresholds while the front door relays: the young generation collected after
# 50 000 net new objects instead of CPython's 700 (see `settle_gc`).
GC_THRESHOLDS = (50_000, 20, 100)


def settle_gc() -> None:
    """Once the daemon has started: every collection is a pause for every stream in flight (one
    trio thread). The objects alive now (modules, config, services: ~95 000) are frozen out of
    later collections (a full one scanned them: ~25 ms on the 2-core test machine, 0 frozen),
    and the young generation waits for 50 000 net new objects instead of 700 (~50 collections
    in a --quick bench run of the tiny model, up to 35 ms each under load, then none). What a
    relayed request allocates is freed by reference counting; only cycles wait for a collection.
    Measured before/after: docs/benchmarks.md, "Front door: garbage collection"."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@attrs.define(eq=False)
class Address:
    """One address the front door listens on: stopped by its scope, `closed` once its listener is."""

    settings: tuple[bool, str, int]  # enabled, host, port as the config said when it was bound
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    closed: trio.Event = attrs.field(factory=trio.Event)


async def _listen(host: str, port: int) -> list[socket.socket]:
    try:
        # A taken port is one plain OSError that leaves the daemon serving.
        return await open_listeners(host, port)
    except OSError as exc:
        log.error(
            "the front door cannot listen on %s:%d (%s); it stays off, the daemon serves on",
            host,
            port,
            exc.strerror or exc,
        )
        return []


async def serve_frontdoor(
    daemon: FrontDoorDaemon,
    *,
    authorize: Authorize = allow_loopback,
    hold: Hold | None = None,
    config_applied: Callable[[], Awaitable[None]] | None = None,
    on_bound: Callable[[list[str]], None] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; `started` with the bound URLs (empty when off or the bind failed).
    `hold`: the daemon's waiting room, whose requests in flight a planned stop drains.
    `config_applied`: returns once a reloaded config is in force; where it changed `enabled`,
    `host` or `port` the old address is closed first, then the new one bound (`on_bound` gets its
    URLs); the connections the old one accepted are served on until they end."""
    # The forward path's engine connections: one pool for the front door's life, closed with it.
    async with loopback_client() as http, EngineWire(ENGINE_TIMEOUT) as wire, trio.open_nursery() as nursery:
        front = FrontDoor(daemon, http, authorize, hold, wire)
        bound: Address | None = None
        settled, first = False, True

        async def serve_address(address: Address, listeners: list[socket.socket]) -> None:
            try:
                with address.scope:
                    await serve_http(listeners, daemon, front.metrics.requests, front.handle, connections=nursery)
            finally:
                address.closed.set()

        while True:
            settings = daemon.config.frontdoor
            wanted = (settings.enabled, settings.host, settings.port)
            if bound is None or bound.settings != wanted:
                if bound is not None:
                    bound.scope.cancel()  # the old address stops accepting; its connections go on
                    await bound.closed.wait()
                    log.info("front door: the config changed its address; the old one is closed")
                listeners = await _listen(settings.host, settings.port) if settings.enabled else []
                bound = Address(wanted)
                if listeners:
                    if not settled:
                        settle_gc()
                        settled = True
                    nursery.start_soon(serve_address, bound, listeners)
                else:
                    bound.closed.set()
                binds = [bound_url(listener) for listener in listeners]
                if binds:
                    log.info("front door on %s", ", ".join(binds))
                if first:
                    if listeners and daemon.config.ollama.enabled:  # read at the daemon's start
                        await nursery.start(serve_ollama, daemon, OllamaApi(front))
                    task_status.started(binds)
                    first = False
                elif on_bound is not None:
                    on_bound(binds)
            if config_applied is None:
                await trio.sleep_forever()
            else:
                await config_applied()


async def serve_ollama(
    daemon: FrontDoorDaemon, api: OllamaApi, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Ollama's API on `[ollama] port` at the front door's host, through the same `FrontDoor`
    (keys, holding, limits, metrics, the access log). A port another program holds leaves it off:
    `daemon.ollama_error` says why (`stoker status`: ollama_port_taken), the daemon serves on."""
    host, port = daemon.config.frontdoor.host, daemon.config.ollama.port
    try:
        listeners = await open_listeners(host, port)
    except OSError as exc:
        daemon.ollama_error = f"cannot listen ({exc.strerror or exc})"
        log.error("Ollama's API cannot listen on %s:%d (%s); it stays off, the daemon serves on", host, port, exc)
        task_status.started()
        return
    daemon.ollama_url, daemon.ollama_error = bound_url(listeners[0]), None  # bound: clients wait in its backlog
    log.info("Ollama's API on %s", daemon.ollama_url)
    await serve_http(listeners, daemon, api.front.metrics.requests, api.handle, task_status=task_status)
