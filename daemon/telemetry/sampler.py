"""Live telemetry of the running server: the accelerator through its backend plugin's
`read_telemetry` (NVML for CUDA), CPU and RSS through psutil, throughput from the engine's
own `/metrics`.

A `TelemetrySampler` takes at most one sample per TTL (5 s), however many clients ask: the
`telemetry` handler and the publisher (daemon.telemetry.publisher) share its cache. A sample is
cheap on a GPU backend (NVML is sub-millisecond once initialised) but it is still work, so:

- A plugin is asked only while the live server's backend offloads (`Backend.offloads`); a CPU
  plan, a CPU-only machine or a stopped server never loads a GPU library, and the plugin
  last read is told to release its library (`release_telemetry`) once no server runs.
- Nothing is read while no server process is live (the sample just says `stopped`).
- llama-server's `/metrics` resets its throughput window on every scrape, so exactly one
  scraper (this sampler, at most once per TTL) keeps the figure meaningful.

`activity` is one of `busy`, `idle`, `stopped`, `unavailable`: a GPU server that shows no
compute activity while it serves no request is `idle`, not `unavailable`; `unavailable`
means the GPU could not be read at all (NVML missing or failing, a plugin with no reader).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable, Mapping

import attrs
import trio

from stoker.daemon.backends.base import Backend, TelemetryRequest

TTL_S = 5.0
HISTORY = 60
_MIB = 1024 * 1024
# CPU use of an otherwise idle llama-server is ~0%; above this it is computing.
CPU_BUSY_PERCENT = 5.0
METRICS_TIMEOUT_S = 2.0


@attrs.frozen
class ServerTarget:
    """Which server to sample: the backend really in use (the fallback's verdict: the CPU for a
    GPU server that offloaded nothing), its pid, (once ready) where its HTTP API is, the plan's
    backend where it differs (whose runtime the process loaded, and holds VRAM with), and the
    layers the engine offloaded (15/33: a partial offload)."""

    backend: str
    pid: int
    state: str = "ready"
    base_url: str | None = None
    api_key: str | None = None
    planned_backend: str | None = None  # None: the same as `backend`
    offloaded_layers: int | None = None
    total_layers: int | None = None

    @property
    def loaded_backend(self) -> str:
        """The backend whose runtime the server process loaded: the plan's."""
        return self.planned_backend or self.backend


def read_gpu(plugin: Backend, pid: int | None) -> dict[str, Any]:
    """One reading through the backend plugin in use, as the sample's `gpu` section (blocking,
    fast); raises when it cannot be read (the error is what the sample reports)."""
    reading = plugin.read_telemetry(TelemetryRequest(pid=pid))
    if reading is None:
        raise RuntimeError(f"the {plugin.name} backend cannot read telemetry here")
    devices = [
        {
            "index": d.index,
            "name": d.name,
            "utilization_percent": d.utilization_percent,
            "memory_utilization_percent": d.memory_utilization_percent,
            "memory_used_mib": d.memory_used_mib,
            "memory_total_mib": d.memory_total_mib,
            "temperature_c": d.temperature_c,
            "power_w": None if d.power_w is None else round(d.power_w, 1),
            "process_vram_mib": d.process_memory_mib,
            "compute_processes": d.compute_processes,
        }
        for d in reading.devices
    ]
    return summarise_gpus(reading.source or reading.backend, devices, reading.process_memory_mib)


def summarise_gpus(source: str, devices: list[dict[str, Any]], process_vram_mib: int | None) -> dict[str, Any]:
    """The per-device readings plus the figures a glance needs (peak util, summed memory)."""

    def total(key: str) -> int | None:
        values = [d[key] for d in devices if d[key] is not None]
        return sum(values) if values else None

    def peak(key: str) -> int | None:
        values = [d[key] for d in devices if d[key] is not None]
        return max(values) if values else None

    return {
        "source": source,
        "devices": devices,
        "utilization_percent": peak("utilization_percent"),
        "memory_utilization_percent": peak("memory_utilization_percent"),
        "memory_used_mib": total("memory_used_mib"),
        "memory_total_mib": total("memory_total_mib"),
        "process_vram_mib": process_vram_mib,
        "temperature_c": peak("temperature_c"),
        "power_w": None
        if not any(d["power_w"] is not None for d in devices)
        else round(sum(d["power_w"] or 0.0 for d in devices), 1),
    }


# --- the process and the engine ---------------------------------------------------------


@attrs.define(eq=False)
class ProcessReader:
    """CPU % and RSS of one process through psutil; CPU % needs two readings, so the first
    reading of a new pid reports None rather than psutil's meaningless 0.0."""

    _proc: Any = None

    def read(self, pid: int) -> dict[str, Any]:
        import psutil

        if self._proc is None or self._proc.pid != pid:
            self._proc = psutil.Process(pid)
            self._proc.cpu_percent(None)
            first = True
        else:
            first = False
        with self._proc.oneshot():
            cpu = self._proc.cpu_percent(None)
            mem = self._proc.memory_info()
            threads = self._proc.num_threads()
        return {
            "cpu_percent": None if first else round(cpu, 1),
            "rss_mib": round(mem.rss / _MIB, 1),
            "threads": threads,
            "cpu_count": psutil.cpu_count() or 1,
        }


def process_rss_mib(pid: int) -> float | None:
    """A process's resident memory now, in MiB (psutil; for llama-server it includes the pages of
    its memory-mapped model that are resident); None when it is gone or not readable."""
    import psutil

    try:
        return round(psutil.Process(pid).memory_info().rss / _MIB, 1)
    except (psutil.Error, OSError):
        return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name without the `llamacpp:` prefix: value} (labels ignored)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        name = name.split("{", 1)[0]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            values[name.removeprefix("llamacpp:")] = value
    return values


def engine_figures(metrics: dict[str, float]) -> dict[str, Any]:
    """The engine figures a person reads: generation and prompt throughput, totals, queue."""

    def count(name: str) -> int | None:
        return int(metrics[name]) if name in metrics else None

    def rate(name: str) -> float | None:
        return round(metrics[name], 2) if name in metrics else None

    return {
        "tokens_per_s": rate("predicted_tokens_seconds"),
        "prompt_tokens_per_s": rate("prompt_tokens_seconds"),
        "tokens_predicted_total": count("tokens_predicted_total"),
        "prompt_tokens_total": count("prompt_tokens_total"),
        "requests_processing": count("requests_processing"),
        "requests_deferred": count("requests_deferred"),
    }


async def fetch_engine_metrics(base_url: str, api_key: str | None) -> dict[str, Any]:
    """GET /metrics (llama-server started with --metrics); raises httpx errors or ValueError."""
    from stoker.daemon.engine.api import EngineClient

    async with EngineClient.open(base_url, api_key, timeout=METRICS_TIMEOUT_S) as engine:
        reply = await engine.metrics()
    if reply.status_code != 200:
        raise ValueError(f"/metrics answered HTTP {reply.status_code}")
    return engine_figures(parse_metrics(reply.text))


# --- the sampler ------------------------------------------------------------------------


def activity_of(
    target: ServerTarget | None,
    gpu: dict[str, Any] | None,
    process: dict[str, Any] | None,
    engine: dict[str, Any] | None,
    *,
    on_gpu: bool,
) -> str:
    """busy | idle | stopped | unavailable: see the module docstring. `on_gpu`: the target's
    backend offloads to an accelerator (its plugin says so), whose reading `gpu` is."""
    if target is None:
        return "stopped"
    serving = bool(engine and (engine.get("requests_processing") or 0) > 0)
    if on_gpu:
        if gpu is None:
            return "unavailable"
        return "busy" if serving or (gpu.get("utilization_percent") or 0) > 0 else "idle"
    if serving:
        return "busy"
    if engine is None and process and (process.get("cpu_percent") or 0) > CPU_BUSY_PERCENT:
        return "busy"
    return "idle"


def history_point(sample: dict[str, Any]) -> dict[str, Any]:
    """The few numbers a sparkline needs from one sample."""
    gpu = sample.get("gpu") or {}
    process = sample.get("process") or {}
    engine = sample.get("engine") or {}
    return {
        "time": sample["time"],
        "pid": sample.get("pid"),
        "activity": sample["activity"],
        "gpu_utilization_percent": gpu.get("utilization_percent"),
        "memory_used_mib": gpu.get("memory_used_mib"),
        "process_vram_mib": gpu.get("process_vram_mib"),
        "cpu_percent": process.get("cpu_percent"),
        "rss_mib": process.get("rss_mib"),
        "tokens_per_s": engine.get("tokens_per_s"),
    }


@attrs.define(eq=False)
class TelemetrySampler:
    """One sample per TTL at most, shared by every caller; a short history for sparklines.

    `target` says which server is live (None: none). `backends` are the daemon's loaded
    plugins: the live server's plugin reads its accelerator. `on_sample` is told of every new
    sample (the daemon publishes it as `telemetry.sample`). `clock` is monotonic seconds.
    """

    target: Callable[[], ServerTarget | None]
    backends: Mapping[str, Backend] = attrs.field(factory=dict)
    on_sample: Callable[[dict[str, Any]], None] | None = None
    ttl: float = TTL_S
    history_size: int = HISTORY
    clock: Callable[[], float] = time.monotonic
    engine_fetch: Callable[..., Any] = fetch_engine_metrics
    samples_taken: int = 0
    _cached: dict[str, Any] | None = None
    _cached_at: float | None = None
    _cached_key: tuple[Any, ...] | None = None
    _history: collections.deque = attrs.field(init=False)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _reading_from: Backend | None = None  # the plugin last read, until released
    _process: ProcessReader = attrs.field(factory=ProcessReader)

    def __attrs_post_init__(self) -> None:
        self._history = collections.deque(maxlen=self.history_size)

    @property
    def history(self) -> list[dict[str, Any]]:
        """Oldest first, at most `history_size` points."""
        return list(self._history)

    @property
    def gpu_initialised(self) -> bool:
        """Whether a plugin was asked for a reading since the last release (never on a CPU plan)."""
        return self._reading_from is not None

    def fresh(self) -> bool:
        """Whether the cached sample is still within its TTL for the same server."""
        target = self.target()
        return (
            self._cached is not None
            and self._cached_key == _key(target)
            and self._cached_at is not None
            and self.clock() - self._cached_at < self.ttl
        )

    async def sample(self) -> dict[str, Any]:
        """The current sample: the cached one within the TTL, else a new one."""
        async with self._lock:
            if self.fresh():
                assert self._cached is not None
                return self._cached
            target = self.target()
            sample = await self._take(target)
            self._cached, self._cached_at, self._cached_key = sample, self.clock(), _key(target)
            if target is not None:
                self.samples_taken += 1
                self._history.append(history_point(sample))
                if self.on_sample is not None:
                    self.on_sample(sample)
            return sample

    async def _take(self, target: ServerTarget | None) -> dict[str, Any]:
        sample: dict[str, Any] = {
            "time": round(time.time(), 3),
            "ttl_s": self.ttl,
            "state": None if target is None else target.state,
            "backend": None if target is None else target.backend,
            "planned_backend": None if target is None else target.loaded_backend,
            "layers": None
            if target is None or target.total_layers is None
            else {"offloaded": target.offloaded_layers, "total": target.total_layers},
            "pid": None if target is None else target.pid,
            "gpu": None,
            "gpu_error": None,
            "process": None,
            "process_error": None,
            "engine": None,
            "engine_error": None,
        }
        if target is None:
            self.close()  # a stopped server holds no GPU library open
            sample["activity"] = "stopped"
            return sample
        # The activity is judged on the backend really in use; the accelerator is read through
        # the plan's backend, whose runtime the process loaded (a GPU server demoted to the CPU
        # still holds its context there). A backend that offloads nothing (the CPU) has no
        # accelerator to read; one that is not loaded cannot be read, and says so.
        in_use = self.backends.get(target.backend)
        plugin = self.backends.get(target.loaded_backend)
        on_gpu = in_use is None or in_use.offloads
        if plugin is None:
            sample["gpu_error"] = f"LookupError: no backend plugin named {target.loaded_backend!r} is loaded"
        reading_from = plugin if plugin is not None and plugin.offloads else None
        if reading_from is not self._reading_from:
            self.close()  # a server that moved off a GPU leaves that GPU's library released
            self._reading_from = reading_from

        def read_local() -> None:
            if reading_from is not None:
                try:
                    sample["gpu"] = read_gpu(reading_from, target.pid)
                except Exception as err:
                    if on_gpu:  # unread figures of a GPU the server does not compute on are no error
                        sample["gpu_error"] = f"{type(err).__name__}: {err}"
            try:
                sample["process"] = self._process.read(target.pid)
            except Exception as err:  # psutil.NoSuchProcess/AccessDenied: gone or not ours
                sample["process_error"] = f"{type(err).__name__}: {err}"

        await trio.to_thread.run_sync(read_local)
        if target.base_url is not None:
            try:
                sample["engine"] = await self.engine_fetch(target.base_url, target.api_key)
            except Exception as err:  # an old server without --metrics, or a busy one
                sample["engine_error"] = f"{type(err).__name__}: {err}"[:300]
        sample["activity"] = activity_of(target, sample["gpu"], sample["process"], sample["engine"], on_gpu=on_gpu)
        return sample

    def snapshot(self, sample: dict[str, Any]) -> dict[str, Any]:
        """The `telemetry` reply for `sample`: the sample and the history."""
        return {"sample": sample, "history": self.history, "ttl_s": self.ttl}

    async def reading(self) -> dict[str, Any]:
        """The `telemetry` reply now: the current (cached within the TTL) sample and the history."""
        return self.snapshot(await self.sample())

    def close(self) -> None:
        """Let the plugin last read release its library (NVML), if one was read."""
        if self._reading_from is not None:
            try:
                self._reading_from.release_telemetry()
            finally:
                self._reading_from = None


def _key(target: ServerTarget | None) -> tuple[Any, ...]:
    if target is None:
        return (None,)
    return (target.backend, target.planned_backend, target.pid, target.state, target.base_url, target.offloaded_layers)
