"""Live telemetry of the running server: GPU through NVML, CPU and RSS through psutil,
throughput from the engine's own `/metrics`.

A `TelemetrySampler` takes at most one sample per TTL (5 s), however many clients ask: the
`telemetry` handler and the publisher (daemon.telemetry.service) share its cache. A sample is
cheap on a GPU backend (NVML is sub-millisecond once initialised) but it is still work, so:

- NVML is initialised only when the live server's plan is on a GPU backend; a CPU plan, a
  CPU-only machine or a stopped server never loads it.
- Nothing is read while no server process is live (the sample just says `stopped`).
- llama-server's `/metrics` resets its throughput window on every scrape, so exactly one
  scraper (this sampler, at most once per TTL) keeps the figure meaningful.

`activity` is one of `busy`, `idle`, `stopped`, `unavailable`: a GPU server that shows no
compute activity while it serves no request is `idle`, not `unavailable`; `unavailable`
means the GPU could not be read at all (NVML missing or failing).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable, Protocol

import attrs
import trio

TTL_S = 5.0
HISTORY = 60
_MIB = 1024 * 1024
# CPU use of an otherwise idle llama-server is ~0%; above this it is computing.
CPU_BUSY_PERCENT = 5.0
METRICS_TIMEOUT_S = 2.0
GPU_BACKENDS_WITH_NVML = frozenset({"cuda"})


@attrs.frozen
class ServerTarget:
    """Which server to sample: its backend, pid, and (once ready) where its HTTP API is."""

    backend: str
    pid: int
    state: str = "ready"
    base_url: str | None = None
    api_key: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.backend != "cpu"


class GpuReader(Protocol):
    def read(self, pid: int | None) -> dict[str, Any]:
        """One GPU reading (blocking, fast); raises when the GPU cannot be read."""

    def close(self) -> None:
        """Release the library (NVML shutdown)."""


# --- NVML -------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _attempt(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # NVMLError_NotSupported and friends: that one figure is unknown
        return None


@attrs.define(eq=False)
class NvmlReader:
    """Reads every NVIDIA GPU through NVML; `nvml` is the pynvml module (tests pass a fake)."""

    nvml: Any = None
    initialised: bool = False

    def _library(self) -> Any:
        if self.nvml is None:
            import pynvml  # nvidia-ml-py: importing loads nothing, nvmlInit loads the .so

            self.nvml = pynvml
        if not self.initialised:
            self.nvml.nvmlInit()  # ~110 ms once; later readings are sub-millisecond
            self.initialised = True
        return self.nvml

    def read(self, pid: int | None) -> dict[str, Any]:
        """Utilisation, memory, temperature and power per device, and `pid`'s own VRAM."""
        nvml = self._library()
        devices = []
        process_bytes: int | None = None if pid is None else 0
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = _attempt(lambda: nvml.nvmlDeviceGetHandleByIndex(index))
            if handle is None:
                continue
            mem = _attempt(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
            util = _attempt(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
            temp = _attempt(lambda: nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)))
            power = _attempt(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
            name = _attempt(lambda: nvml.nvmlDeviceGetName(handle))
            procs = _attempt(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            mine = None
            if pid is not None and procs is not None:
                mine = sum(int(p.usedGpuMemory or 0) for p in procs if int(p.pid) == pid)
                process_bytes = None if process_bytes is None else process_bytes + mine
            elif pid is not None:
                process_bytes = None
            devices.append(
                {
                    "index": index,
                    "name": None if name is None else _text(name),
                    "utilization_percent": None if util is None else int(util.gpu),
                    "memory_utilization_percent": None if util is None else int(util.memory),
                    "memory_used_mib": None if mem is None else int(mem.used) // _MIB,
                    "memory_total_mib": None if mem is None else int(mem.total) // _MIB,
                    "temperature_c": None if temp is None else int(temp),
                    "power_w": None if power is None else round(power / 1000.0, 1),
                    "process_vram_mib": None if mine is None else mine // _MIB,
                    "compute_processes": None if procs is None else len(procs),
                }
            )
        return summarise_gpus("nvml", devices, None if process_bytes is None else process_bytes // _MIB)

    def close(self) -> None:
        if self.initialised and self.nvml is not None:
            _attempt(self.nvml.nvmlShutdown)
        self.initialised = False


@attrs.define(eq=False)
class PluginGpuReader:
    """Any other GPU backend: its plugin's `read_telemetry` (ROCm, Vulkan, Metal)."""

    backend: Any

    def read(self, pid: int | None) -> dict[str, Any]:
        from daemon.backends.base import TelemetryRequest

        reading = self.backend.read_telemetry(TelemetryRequest(pid=pid))
        if reading is None:
            raise RuntimeError(f"the {self.backend.name} backend cannot read telemetry here")
        devices = [
            {
                "index": d.index,
                "name": None,
                "utilization_percent": d.utilization_percent,
                "memory_utilization_percent": None,
                "memory_used_mib": d.memory_used_mib,
                "memory_total_mib": d.memory_total_mib,
                "temperature_c": d.temperature_c,
                "power_w": d.power_w,
                "process_vram_mib": None,
                "compute_processes": None,
            }
            for d in reading.devices
        ]
        return summarise_gpus(self.backend.name, devices, reading.process_memory_mib)

    def close(self) -> None:
        pass


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


def default_gpu_reader(backend: str) -> GpuReader:
    """NVML for CUDA; the backend plugin's own reader for the other GPU backends."""
    if backend in GPU_BACKENDS_WITH_NVML:
        return NvmlReader()
    from daemon.backends.registry import load_backend

    return PluginGpuReader(load_backend(backend))


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
    from daemon.engine.api import EngineClient

    async with EngineClient.open(base_url, api_key, timeout=METRICS_TIMEOUT_S) as engine:
        reply = await engine.metrics()
    if reply.status_code != 200:
        raise ValueError(f"/metrics answered HTTP {reply.status_code}")
    return engine_figures(parse_metrics(reply.text))


EngineFetch = Callable[[str, "str | None"], Any]


# --- the sampler ------------------------------------------------------------------------


def activity_of(
    target: ServerTarget | None,
    gpu: dict[str, Any] | None,
    gpu_error: str | None,
    process: dict[str, Any] | None,
    engine: dict[str, Any] | None,
) -> str:
    """busy | idle | stopped | unavailable: see the module docstring."""
    if target is None:
        return "stopped"
    serving = bool(engine and (engine.get("requests_processing") or 0) > 0)
    if target.on_gpu:
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

    `target` says which server is live (None: none). `on_sample` is told of every new sample
    (the daemon publishes it as `telemetry.sample`). `clock` is monotonic seconds.
    """

    target: Callable[[], ServerTarget | None]
    on_sample: Callable[[dict[str, Any]], None] | None = None
    ttl: float = TTL_S
    history_size: int = HISTORY
    clock: Callable[[], float] = time.monotonic
    gpu_reader_factory: Callable[[str], GpuReader] = default_gpu_reader
    engine_fetch: Callable[..., Any] = fetch_engine_metrics
    samples_taken: int = 0
    _cached: dict[str, Any] | None = None
    _cached_at: float | None = None
    _cached_key: tuple[Any, ...] | None = None
    _history: collections.deque = attrs.field(init=False)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _gpu: GpuReader | None = None
    _gpu_backend: str | None = None
    _process: ProcessReader = attrs.field(factory=ProcessReader)

    def __attrs_post_init__(self) -> None:
        self._history = collections.deque(maxlen=self.history_size)

    @property
    def history(self) -> list[dict[str, Any]]:
        """Oldest first, at most `history_size` points."""
        return list(self._history)

    @property
    def gpu_initialised(self) -> bool:
        """Whether a GPU library was ever loaded (never on a CPU plan)."""
        return self._gpu is not None

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
        gpu_reader = self._gpu_reader_for(target.backend) if target.on_gpu else None

        def read_local() -> None:
            if gpu_reader is not None:
                try:
                    sample["gpu"] = gpu_reader.read(target.pid)
                except Exception as err:
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
        sample["activity"] = activity_of(
            target, sample["gpu"], sample["gpu_error"], sample["process"], sample["engine"]
        )
        return sample

    def _gpu_reader_for(self, backend: str) -> GpuReader:
        if self._gpu is None or self._gpu_backend != backend:
            self.close()
            self._gpu = self.gpu_reader_factory(backend)
            self._gpu_backend = backend
        return self._gpu

    def snapshot(self, sample: dict[str, Any]) -> dict[str, Any]:
        """The `telemetry` reply for `sample`: the sample and the history."""
        return {"sample": sample, "history": self.history, "ttl_s": self.ttl}

    async def reading(self) -> dict[str, Any]:
        """The `telemetry` reply now: the current (cached within the TTL) sample and the history."""
        return self.snapshot(await self.sample())

    def close(self) -> None:
        """Release the GPU library, if one was loaded."""
        if self._gpu is not None:
            try:
                self._gpu.close()
            finally:
                self._gpu = None
                self._gpu_backend = None


def _key(target: ServerTarget | None) -> tuple[Any, ...]:
    if target is None:
        return (None,)
    return (target.backend, target.pid, target.state, target.base_url)
