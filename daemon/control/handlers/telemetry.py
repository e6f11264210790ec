"""The `telemetry` socket method: it reads the telemetry service's sampler (daemon.telemetry.publisher)."""

from __future__ import annotations

from typing import Any, Mapping

from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.params import method
from stoker.daemon.control.replies import TelemetryReading


@method("telemetry", result=TelemetryReading)
async def telemetry(daemon: ControlledDaemon, params: Mapping[str, Any]) -> TelemetryReading:
    """The live server's GPU, CPU and throughput figures, and a short history for sparklines.

    Cached for ttl_s: calling more often returns the same sample. While a client subscribes,
    the same samples also arrive as `telemetry.sample` events.
    Reply: {"sample": {...}, "history": [point, ...] (oldest first, <= 60), "ttl_s": 5.0}.
    sample: time, ttl_s, state, backend, pid, activity (busy|idle|stopped|unavailable),
    gpu {source, utilization_percent, memory_utilization_percent, memory_used_mib,
    memory_total_mib, process_vram_mib, temperature_c, power_w, devices[...]} or null,
    process {cpu_percent, rss_mib, threads, cpu_count} or null, engine {tokens_per_s,
    prompt_tokens_per_s, tokens_predicted_total, prompt_tokens_total, requests_processing,
    requests_deferred} or null, and gpu_error / process_error / engine_error strings.
    point: time, pid, activity, gpu_utilization_percent, memory_used_mib, process_vram_mib,
    cpu_percent, rss_mib, tokens_per_s.
    """
    return await daemon.telemetry()
