"""The telemetry service: one sampler per daemon, started in the root nursery.

`serve_telemetry` makes the daemon's `TelemetrySampler`, hands it to the nursery's starter
(`await nursery.start(serve_telemetry, ...)` returns it; the `telemetry` socket method reads
through it) and then publishes a `telemetry.sample` event every TTL while a server runs and
somebody subscribes. The sampler's 5 s cache is shared by the handler and this loop, so no
number of clients can make the daemon sample more often; with nobody subscribed nothing is
read unless a client asks.

The event: {"topic": "telemetry.sample", "sample": <as in the `telemetry` reply>, "point":
<the history point it added>} (plus the bus's seq and time).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import trio

from stoker.daemon.backends.base import Backend
from stoker.daemon.core.events import EventBus
from stoker.daemon.telemetry.sampler import TTL_S, ServerTarget, TelemetrySampler, fetch_engine_metrics, history_point

log = logging.getLogger(__name__)

TOPIC = "telemetry.sample"


async def serve_telemetry(
    target: Callable[[], ServerTarget | None],
    bus: EventBus,
    backends: Mapping[str, Backend],
    *,
    ttl: float = TTL_S,
    engine_fetch: Callable[..., Any] = fetch_engine_metrics,
    task_status: trio.TaskStatus[TelemetrySampler] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sample `target` (None: no server runs) every `ttl` while the bus has subscribers, until
    cancelled, reading accelerators through `backends` (the daemon's loaded plugins);
    `task_status.started(sampler)`. The plugin last read releases its library at the end."""

    def publish(sample: dict[str, Any]) -> None:
        bus.publish({"topic": TOPIC, "sample": sample, "point": history_point(sample)})

    sampler = TelemetrySampler(target=target, backends=backends, on_sample=publish, ttl=ttl, engine_fetch=engine_fetch)
    try:
        task_status.started(sampler)
        while True:
            if target() is not None and bus.statistics().subscribers > 0:
                try:
                    await sampler.sample()
                except Exception:  # telemetry must never take the daemon down
                    log.exception("telemetry sample failed")
            await trio.sleep(ttl)
    finally:
        sampler.close()
