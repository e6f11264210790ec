"""Telemetry sampler: GPU figures through the cuda plugin (a fake NVML with recorded H200
answers), the 5 s cache, idle vs unavailable, the CPU path never touching NVML, the history
ring and the telemetry service. NVML's own readings are tested in test_backends_cuda.py."""

from __future__ import annotations

import os

import trio
import trio.testing

import backend_recordings as rec
from stoker.daemon.backends.cpu import CpuBackend
from stoker.daemon.backends.cuda import CudaBackend
from stoker.daemon.backends.vulkan import VulkanBackend
from stoker.daemon.core.events import EventBus
from stoker.daemon.telemetry.publisher import TOPIC, serve_telemetry
from stoker.daemon.telemetry.sampler import (
    HISTORY,
    ServerTarget,
    TelemetrySampler,
    activity_of,
    engine_figures,
    parse_metrics,
    read_gpu,
)
from tests.waits import until

SERVER_PID = 4242

# `GET /metrics` of this llama.cpp build (tools/server/server-task.cpp to_metrics), trimmed.
RECORDED_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 118
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 64
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 912.5
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 41.25
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


class H200Nvml(rec.FakeNvml):
    """The recorded NVML answers plus a counter of device readings."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.reads += 1
        return super().nvmlDeviceGetUtilizationRates(handle)


def loaded_h200(**overrides):
    """The H200 with a 2 GiB server (ours) and another tenant's 10 MiB process."""
    gpu = rec.h200(
        util=87,
        temp=54,
        power_mw=312_345,
        free=(143771 - 2700) * rec.MIB,
        processes=[(SERVER_PID, 2048 * rec.MIB), (7, 10 * rec.MIB)],
    )
    gpu.update(overrides)
    return gpu


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def idle_engine():
    return engine_figures(parse_metrics(RECORDED_METRICS.replace("requests_processing 1", "requests_processing 0")))


def plugins(nvml=None):
    """The daemon's loaded plugins as the sampler sees them: the cuda one reads `nvml`."""
    return {"cpu": CpuBackend(), "cuda": CudaBackend(nvml=nvml), "vulkan": VulkanBackend()}


def make_sampler(target, nvml=None, engine=None, clock=None, **kwargs):
    published = []

    async def fetch(base_url, api_key):
        if isinstance(engine, Exception):
            raise engine
        return engine if engine is not None else idle_engine()

    sampler = TelemetrySampler(
        target=lambda: target[0],
        on_sample=published.append,
        clock=clock or Clock(),
        backends=plugins(nvml),
        engine_fetch=fetch,
        **kwargs,
    )
    return sampler, published


def cuda_target(pid=SERVER_PID):
    return ServerTarget("cuda", pid, "ready", "http://127.0.0.1:1", "key")


# --- the GPU section, as the cuda plugin reads it ---------------------------------------


def test_recorded_h200_with_a_process_holding_vram_is_idle_not_unavailable():
    nvml = H200Nvml(gpus=[rec.h200(**rec.H200_HOLDING)], driver="580.159.04")
    gpu = read_gpu(CudaBackend(nvml=nvml), 456)
    assert (gpu["memory_used_mib"], gpu["memory_total_mib"]) == (3189, 143771)
    assert gpu["process_vram_mib"] == 2566 and gpu["utilization_percent"] == 0
    assert gpu["temperature_c"] == 33 and gpu["power_w"] == 104.2
    target = ServerTarget("cuda", 456, "ready")
    assert activity_of(target, gpu, None, idle_engine(), on_gpu=True) == "idle"


def test_the_gpu_section_shows_every_figure_nvml_reads():
    nvml = H200Nvml(gpus=[loaded_h200(memory_util=41)])
    gpu = read_gpu(CudaBackend(nvml=nvml), SERVER_PID)
    assert gpu["source"] == "nvml"
    (dev,) = gpu["devices"]
    assert dev == {
        "index": 0,
        "name": "NVIDIA H200",
        "utilization_percent": 87,
        "memory_utilization_percent": 41,
        "memory_used_mib": 2700,
        "memory_total_mib": 143771,
        "temperature_c": 54,
        "power_w": 312.3,  # 312345 mW, to a tenth of a watt
        "process_vram_mib": 2048,
        "compute_processes": 2,
    }
    assert gpu["process_vram_mib"] == 2048  # the other tenant's 10 MiB is not ours
    assert (gpu["utilization_percent"], gpu["memory_utilization_percent"]) == (87, 41)
    assert (gpu["memory_used_mib"], gpu["memory_total_mib"]) == (2700, 143771)


def test_two_gpus_sum_memory_and_take_peak_utilisation():
    nvml = H200Nvml(gpus=[loaded_h200(), rec.a6000(util=3, processes=[(SERVER_PID, 512 * rec.MIB)])])
    gpu = read_gpu(CudaBackend(nvml=nvml), SERVER_PID)
    assert gpu["utilization_percent"] == 87
    assert gpu["memory_total_mib"] == 143771 + 49140
    assert gpu["process_vram_mib"] == 2048 + 512
    assert gpu["power_w"] == 312.3  # the A6000 recording has no power reading: not counted as 0 W


async def test_a_gpu_backend_without_a_reader_is_unavailable_with_its_name():
    sampler, _ = make_sampler([ServerTarget("vulkan", os.getpid(), "ready", "http://127.0.0.1:1", "key")])
    sample = await sampler.sample()
    assert sample["activity"] == "unavailable" and sample["gpu"] is None
    assert sample["gpu_error"] == "RuntimeError: the vulkan backend cannot read telemetry here"
    assert sample["process"]["rss_mib"] > 1  # the CPU side is still read


# --- the engine's /metrics ---------------------------------------------------------------


def test_metrics_parse_to_throughput_and_totals():
    figures = engine_figures(parse_metrics(RECORDED_METRICS + 'other{label="x"} 3\nbroken line\n'))
    assert figures == {
        "tokens_per_s": 41.25,
        "prompt_tokens_per_s": 912.5,
        "tokens_predicted_total": 64,
        "prompt_tokens_total": 118,
        "requests_processing": 1,
        "requests_deferred": 0,
    }


def test_missing_metrics_are_none():
    assert engine_figures({})["tokens_per_s"] is None


# --- the sampler --------------------------------------------------------------------------


async def test_one_sample_per_ttl_however_many_callers():
    nvml = H200Nvml(gpus=[loaded_h200()])
    clock = Clock()
    sampler, published = make_sampler([cuda_target()], nvml, clock=clock)
    results = []

    async def ask():
        results.append(await sampler.sample())

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(ask)
    assert nvml.reads == 1 and sampler.samples_taken == 1 and len(published) == 1
    assert all(r is results[0] for r in results)
    clock.now += 4.9
    await sampler.sample()
    assert nvml.reads == 1
    clock.now += 0.2
    await sampler.sample()
    assert nvml.reads == 2 and len(published) == 2


async def test_a_new_server_is_sampled_at_once():
    nvml = H200Nvml(gpus=[loaded_h200()])
    target = [cuda_target()]
    sampler, _ = make_sampler(target, nvml)
    await sampler.sample()
    target[0] = cuda_target(pid=SERVER_PID + 1)
    sample = await sampler.sample()
    assert nvml.reads == 2 and sample["pid"] == SERVER_PID + 1


async def test_gpu_sample_is_busy_with_utilisation():
    nvml = H200Nvml(gpus=[loaded_h200()])
    sampler, _ = make_sampler([cuda_target()], nvml)
    sample = await sampler.sample()
    assert nvml.reads == 1 and sampler.gpu_initialised
    assert sample["activity"] == "busy"
    assert sample["gpu"]["process_vram_mib"] == 2048
    assert sample["backend"] == "cuda" and sample["state"] == "ready"


async def test_quiet_gpu_and_idle_server_is_idle_not_unavailable():
    nvml = H200Nvml(gpus=[loaded_h200(util=0)])
    sampler, _ = make_sampler([cuda_target()], nvml)
    sample = await sampler.sample()
    assert sample["activity"] == "idle"
    assert sample["gpu"]["utilization_percent"] == 0 and sample["gpu_error"] is None


async def test_serving_with_a_quiet_gpu_is_busy():
    busy = engine_figures(parse_metrics(RECORDED_METRICS))
    sampler, _ = make_sampler([cuda_target()], H200Nvml(gpus=[loaded_h200(util=0)]), engine=busy)
    assert (await sampler.sample())["activity"] == "busy"


async def test_nvml_that_cannot_load_is_unavailable_with_the_error():
    nvml = H200Nvml(init_error=rec.NVMLError_LibraryNotFound)
    sampler, _ = make_sampler([cuda_target()], nvml)
    sample = await sampler.sample()
    assert sample["activity"] == "unavailable"
    assert sample["gpu"] is None and "NVMLError_LibraryNotFound" in sample["gpu_error"]


async def test_cpu_plan_never_initialises_nvml():
    nvml = H200Nvml(gpus=[loaded_h200()])
    target = [ServerTarget("cpu", os.getpid(), "ready", "http://127.0.0.1:1", "key")]
    sampler, _ = make_sampler(target, nvml)
    clock = sampler.clock
    first = await sampler.sample()
    clock.now += 10
    second = await sampler.sample()
    assert nvml.init_calls == 0 and nvml.reads == 0 and not sampler.gpu_initialised
    assert first["gpu"] is None and first["activity"] == "idle"
    assert first["process"]["rss_mib"] > 1 and first["process"]["cpu_percent"] is None  # needs two readings
    assert second["process"]["cpu_percent"] is not None
    assert second["engine"]["tokens_per_s"] == 41.25


async def test_engine_errors_are_reported_not_raised():
    target = [ServerTarget("cpu", os.getpid(), "ready", "http://127.0.0.1:1", "key")]
    sampler, _ = make_sampler(target, engine=ValueError("/metrics answered HTTP 501"))
    sample = await sampler.sample()
    assert sample["engine"] is None and "501" in sample["engine_error"]
    assert sample["activity"] == "idle"


async def test_a_loading_server_is_not_scraped():
    fetched = []
    target = [ServerTarget("cpu", os.getpid(), "loading")]

    async def fetch(base_url, api_key):
        fetched.append(base_url)

    sampler = TelemetrySampler(target=lambda: target[0], engine_fetch=fetch, clock=Clock())
    sample = await sampler.sample()
    assert fetched == [] and sample["engine"] is None and sample["state"] == "loading"


async def test_no_server_reads_nothing_and_releases_nvml():
    nvml = H200Nvml(gpus=[loaded_h200()])
    target = [cuda_target()]
    sampler, published = make_sampler(target, nvml)
    await sampler.sample()
    target[0] = None
    sample = await sampler.sample()
    assert sample["activity"] == "stopped" and sample["gpu"] is None and sample["process"] is None
    assert nvml.shutdown_calls == 1 and not sampler.gpu_initialised
    assert len(published) == 1 and len(sampler.history) == 1  # the stopped sample is not history


async def test_a_server_that_fell_back_to_the_cpu_releases_nvml():
    nvml = H200Nvml(gpus=[loaded_h200()])
    target = [cuda_target()]
    sampler, _ = make_sampler(target, nvml)
    assert (await sampler.sample())["gpu"]["process_vram_mib"] == 2048
    target[0] = ServerTarget("cpu", os.getpid(), "ready", "http://127.0.0.1:1", "key")
    sample = await sampler.sample()
    assert sample["gpu"] is None and sample["gpu_error"] is None and sample["activity"] == "idle"
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 1) and not sampler.gpu_initialised


async def test_a_gpu_server_demoted_to_the_cpu_is_named_cpu_and_its_vram_still_shown():
    """status said `cpu` (cuda_gpu_layers_zero) while telemetry said `cuda`: the sample names the
    backend really in use, and the plan's beside it. The process still holds its CUDA context,
    so its VRAM is read through the plan's plugin; its activity is judged as a CPU server's."""
    nvml = H200Nvml(gpus=[loaded_h200(util=0)])
    demoted = ServerTarget("cpu", os.getpid(), "ready", "http://127.0.0.1:1", "key", planned_backend="cuda")
    sampler, _ = make_sampler([demoted], nvml)
    sample = await sampler.sample()
    assert sample["backend"] == "cpu" and sample["planned_backend"] == "cuda"
    assert sample["gpu"]["source"] == "nvml" and sample["process"] is not None
    assert sample["activity"] == "idle"
    from stoker.daemon.cli.telemetry import format_sample

    assert "cpu (planned cuda: not accelerated)" in format_sample(sample)
    # Where the plan's plugin cannot read, nothing is claimed and no error is shown for a GPU
    # the server does not compute on.
    unreadable = H200Nvml(init_error=rec.NVMLError_LibraryNotFound)
    sampler, _ = make_sampler([demoted], unreadable)
    sample = await sampler.sample()
    assert sample["gpu"] is None and sample["gpu_error"] is None and sample["activity"] == "idle"


async def test_a_partial_offload_says_partial():
    nvml = H200Nvml(gpus=[loaded_h200()])
    partial = ServerTarget("cuda", SERVER_PID, "ready", "http://127.0.0.1:1", "key", None, 15, 33)
    sampler, _ = make_sampler([partial], nvml)
    sample = await sampler.sample()
    assert sample["backend"] == "cuda" and sample["layers"] == {"offloaded": 15, "total": 33}
    from stoker.daemon.cli.telemetry import format_sample

    assert "cuda (partial: 15/33 layers)" in format_sample(sample)


async def test_history_is_a_ring_of_compact_points():
    nvml = H200Nvml(gpus=[loaded_h200()])
    sampler, _ = make_sampler([cuda_target()], nvml)
    for _ in range(HISTORY + 5):
        sampler.clock.now += 5
        await sampler.sample()
    history = sampler.history
    assert len(history) == HISTORY
    assert history[-1]["gpu_utilization_percent"] == 87 and history[-1]["process_vram_mib"] == 2048
    assert history[0]["time"] <= history[-1]["time"]
    reply = sampler.snapshot(await sampler.sample())
    assert set(reply) == {"sample", "history", "ttl_s"} and reply["ttl_s"] == 5.0


async def test_the_service_publishes_only_while_somebody_subscribes():
    # A real clock with a short TTL: the sample runs NVML in a thread, which an autojump
    # clock would race past. Each round of the service asks for the target first, so the
    # rounds are counted there; the rate is checked against the time that really passed.
    nvml = H200Nvml(gpus=[loaded_h200()])
    bus = EventBus()
    rounds = []
    ttl = 0.05

    def target():
        rounds.append(trio.current_time())
        return cuda_target()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            sampler = await nursery.start(
                lambda task_status: serve_telemetry(
                    target,
                    bus,
                    plugins(nvml),
                    ttl=ttl,
                    engine_fetch=lambda url, key: _idle_async(),
                    task_status=task_status,
                )
            )
            await until(lambda: len(rounds) >= 3, timeout=10, what="three rounds with nobody subscribed")
            assert bus.seq == 0 and nvml.init_calls == 0  # nobody watches: nothing is read
            events = bus.subscribe()
            since = trio.current_time()
            published = [await events.receive() for _ in range(3)]
            elapsed = trio.current_time() - since
            while True:
                try:
                    published.append(events.receive_nowait())
                except trio.WouldBlock:
                    break
            assert len(published) <= elapsed / ttl + 2  # about one per TTL, never more
            assert {e["topic"] for e in published} == {TOPIC}
            assert published[-1]["point"] == sampler.history[-1]  # the point it added to the history
            reading = await sampler.reading()  # what the `telemetry` method answers
            assert reading["sample"]["backend"] == "cuda" and reading["history"] == sampler.history
            nursery.cancel_scope.cancel()
    assert nvml.shutdown_calls == 1  # the service releases NVML when it ends


async def _idle_async():
    return idle_engine()


def test_activity_without_a_target_is_stopped():
    assert activity_of(None, None, None, None, on_gpu=False) == "stopped"
    cpu = ServerTarget("cpu", 1)
    assert activity_of(cpu, None, {"cpu_percent": 90.0}, None, on_gpu=False) == "busy"
    assert activity_of(cpu, None, {"cpu_percent": 0.5}, None, on_gpu=False) == "idle"
