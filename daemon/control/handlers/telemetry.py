"""The `telemetry` command and the publisher of `telemetry.sample` events.

One `TelemetrySampler` per daemon (kept beside it, not in it, so the Daemon class stays
unaware of telemetry); the handler and the background task share its 5 s cache, so no
number of clients can make the daemon sample more often.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Mapping

import trio

from daemon.core.errors import StokerError
from daemon.control.handlers.service import handler
from daemon.telemetry.sampler import ServerTarget, TelemetrySampler, history_point
from states.reasons import ReasonCode

if TYPE_CHECKING:
    from daemon.service import Daemon

TOPIC = "telemetry.sample"
_SAMPLERS: "weakref.WeakKeyDictionary[Daemon, TelemetrySampler]" = weakref.WeakKeyDictionary()


def target_of(daemon: "Daemon") -> ServerTarget | None:
    """The live server to sample, or None when no server process runs."""
    sup = daemon.supervisor
    server, plan = sup.server, sup.data.plan
    if server is None or plan is None:
        return None
    base_url, api_key = sup.endpoint()
    ready = sup.state.value == "ready"
    return ServerTarget(
        backend=plan.backend,
        pid=server.pid,
        state=sup.state.value,
        base_url=base_url if ready else None,
        api_key=api_key if ready else None,
    )


def sampler_for(daemon: "Daemon") -> TelemetrySampler:
    """The daemon's sampler (made on first use)."""
    sampler = _SAMPLERS.get(daemon)
    if sampler is None:
        sampler = TelemetrySampler(
            target=lambda: target_of(daemon),
            on_sample=lambda sample: daemon.bus.publish(
                {"topic": TOPIC, "sample": sample, "point": history_point(sample)}
            ),
        )
        _SAMPLERS[daemon] = sampler
    return sampler


@handler("telemetry")
async def telemetry(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> {"sample": {...}, "history": [point, ...] (oldest first, <= 60), "ttl_s": 5.0}.

    sample: time, ttl_s, state, backend, pid, activity (busy|idle|stopped|unavailable),
    gpu {source, utilization_percent, memory_utilization_percent, memory_used_mib,
    memory_total_mib, process_vram_mib, temperature_c, power_w, devices[...]} or null,
    process {cpu_percent, rss_mib, threads, cpu_count} or null, engine {tokens_per_s,
    prompt_tokens_per_s, tokens_predicted_total, prompt_tokens_total, requests_processing,
    requests_deferred} or null, and gpu_error / process_error / engine_error strings.
    Cached for ttl_s: calling more often returns the same sample.
    """
    if params:
        raise StokerError(ReasonCode.BAD_REQUEST, f"This command takes no parameters, got {sorted(params)}.")
    sampler = sampler_for(daemon)
    return sampler.snapshot(await sampler.sample())


async def serve_telemetry(daemon: "Daemon", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Publish a `telemetry.sample` every TTL while a server runs and someone subscribes.

    The event: {"topic": "telemetry.sample", "sample": <as in the reply>, "point": <the
    history point it added>} (plus the bus's seq and time).
    """
    sampler = sampler_for(daemon)
    await sampler.run(lambda: daemon.bus.statistics().subscribers > 0, task_status=task_status)
