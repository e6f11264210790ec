"""`serve_frontdoor`: Hypercorn's trio worker serving the front door inside the root nursery.

It binds `[frontdoor] host:port` (loopback by default, 127.0.0.1:11436). A port another
program holds does not stop the daemon: the front door logs why and stays off, the rest of the
daemon serves on. The engine is reached through one `EngineWire` (its keep-alive pool) for the
daemon's life.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio.run import worker_serve
from hypercorn.typing import ASGIFramework

from daemon.core.http import loopback_client
from daemon.engine.wire import EngineWire, WireTimeouts
from daemon.frontdoor.app import FrontDoor
from daemon.frontdoor.hold import Hold
from daemon.frontdoor.limits import LimitedHypercornConfig
from daemon.frontdoor.served import Authorize, FrontDoorDaemon, allow_loopback

log = logging.getLogger("stoker.frontdoor")

# A silent engine socket: connecting is instant on loopback; between two chunks of an answer the
# engine may think for a long while (a non-streaming completion sends nothing until done).
ENGINE_TIMEOUT = WireTimeouts(connect=5.0, read=900.0, write=60.0)


# Connections that may wait to be accepted: 1000 clients connecting at once are not dropped
# (the kernel caps it at net.core.somaxconn).
BACKLOG = 1024


def hypercorn_config(daemon: FrontDoorDaemon, host: str, port: int) -> HypercornConfig:
    config = LimitedHypercornConfig(daemon)  # [frontdoor]'s limits, read live
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.backlog = BACKLOG
    config.accesslog = None
    config.errorlog = log
    return config


async def serve_frontdoor(
    daemon: FrontDoorDaemon,
    *,
    authorize: Authorize = allow_loopback,
    hold: Hold | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; `started` with the bound URLs (empty when off or the bind failed).
    `hold`: the daemon's waiting room, whose requests in flight a planned stop drains."""
    settings = daemon.config.frontdoor
    if not settings.enabled:
        task_status.started([])
        return
    # The forward path's engine connections: one pool for the front door's life, closed with it.
    async with loopback_client() as http, EngineWire(ENGINE_TIMEOUT) as wire, trio.open_nursery() as nursery:
        app = cast(ASGIFramework, FrontDoor(daemon, http, authorize, hold, wire).app())  # Starlette is an ASGI 3 app
        config = hypercorn_config(daemon, settings.host, settings.port)
        try:
            # Bound here, not inside Hypercorn's nurseries: a taken port must be one plain
            # OSError that leaves the daemon serving, not an exception group that stops it.
            sockets = config.create_sockets()
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
        except OSError as exc:
            log.error(
                "the front door cannot listen on %s:%d (%s); it stays off, the daemon serves on",
                settings.host,
                settings.port,
                exc.strerror or exc,
            )
            task_status.started([])
            return
        binds = await nursery.start(partial(worker_serve, ASGIWrapper(app), config, sockets=sockets))
        log.info("front door on %s", ", ".join(binds))
        task_status.started(binds)
