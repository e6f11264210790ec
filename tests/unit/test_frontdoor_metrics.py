"""/metrics: the collector of the daemon's state, the counters read from history, the request figures.

History is written by the real machines (MachineRunner over an in-memory store), so the
counters read what the daemon really records; the exposition is parsed back with
prometheus_client's own parser, as Prometheus would read it.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from stoker.daemon.config.model import Config
from stoker.daemon.config.ollama import OllamaConfig
from stoker.daemon.core.machines import MachineRunner
from stoker.daemon.fleet.usage import Usage
from stoker.daemon.frontdoor.relay import relay
from stoker.daemon.frontdoor.hold import Hold
from stoker.daemon.frontdoor.http11 import Request, open_listeners, serve_http
from stoker.daemon.frontdoor.metrics import HISTORY_BATCH, Exchange, FrontDoorMetrics, engine_figures
from stoker.daemon.fleet.remote import Remotes
from stoker.daemon.frontdoor.tallies import KINDS, HistoryTally
from stoker.daemon.telemetry.sampler import ServerTarget
from stoker.states.fallback import table as F
from stoker.states.fallback.proof import AccelerationProof
from stoker.states.install import table as I
from stoker.states.install.slot import SlotBundle
from stoker.states.launch import table as L
from stoker.states.launch import records as LR
from stoker.states.reasons import ReasonCode
from stoker.store import open_store

PLAN = LR.LaunchPlan("cpu", "x86-64", "/b", "/b/llama-server", "/m.gguf", port=8091)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages", "/v1/models")
POST = ROUTES[:4]

# What llama-server (b11434) answered the tiny model, byte for byte.
CHAT_JSON = (
    b'{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant","content":"notime greenV"}}],'
    b'"created":1796047891,"model":"tiny.gguf","system_fingerprint":"b11434-b11434","object":"chat.completion",'
    b'"usage":{"completion_tokens":5,"prompt_tokens":53,"total_tokens":58,"prompt_tokens_details":{"cached_tokens":0}},'
    b'"id":"chatcmpl-nzxW9qMOEwC9tzpiCqjvYsGvotFTaZth","timings":{"cache_n":0,"prompt_n":53,"prompt_ms":1.171,'
    b'"prompt_per_token_ms":0.02209433962264151,"prompt_per_second":45260.461144321096,"predicted_n":5,'
    b'"predicted_ms":0.585,"predicted_per_token_ms":0.14625,"predicted_per_second":6837.606837606838}}'
)
SSE_LAST = (
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1796047892,'
    b'"id":"chatcmpl-KyH1EjNEa5x524GC2kOAi7Sx3kRcVbrb","model":"tiny.gguf","system_fingerprint":"b11434-b11434",'
    b'"object":"chat.completion.chunk","timings":{"cache_n":52,"prompt_n":1,"prompt_ms":0.293,'
    b'"prompt_per_token_ms":0.293,"prompt_per_second":3412.969283276451,"predicted_n":3,"predicted_ms":0.323,'
    b'"predicted_per_token_ms":0.1615,"predicted_per_second":6191.950464396285}}\n\n'
)
ANTHROPIC_TAIL = (
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
    b'"usage":{"output_tokens":3}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels: str) -> float | None:
    """The sample `name` with exactly these labels in an exposition, None if absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


# --- the engine's figures ---------------------------------------------------------------------


def test_the_engine_figures_come_from_the_answers_last_bytes():
    plain = engine_figures(CHAT_JSON)
    assert (plain.generated, plain.per_second, plain.seconds) == (5, pytest.approx(6837.6068), pytest.approx(0.000585))
    streamed = engine_figures(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' + SSE_LAST + b"data: [DONE]\n\n")
    assert (streamed.generated, streamed.per_second) == (3, pytest.approx(6191.95))
    # Anthropic's stream counts tokens in `usage` and says nothing of speed.
    anthropic = engine_figures(ANTHROPIC_TAIL)
    assert (anthropic.generated, anthropic.per_second, anthropic.seconds) == (3, None, None)
    # A model that writes the key in its answer is not read: inside a JSON string it is escaped.
    said = engine_figures(b'data: {"choices":[{"delta":{"content":"\\"predicted_n\\": 999"}}]}\n\n')
    assert said.generated is None
    assert engine_figures(b"") == engine_figures(b'{"object":"list","data":[{"embedding":[0.1,0.2]}]}')


# --- counters from history --------------------------------------------------------------------


@pytest.fixture
def store():
    s = open_store(":memory:")
    yield s
    s.close()


def record_history(store) -> None:
    """A daemon's life as its machines record it: fallbacks, restarts, crashes, a crash loop, installs."""
    fallback = MachineRunner(F.FALLBACK, "fallback", store)
    # auto on a machine without a GPU: cuda passed over for the CPU.
    fallback.fire(F.PlanRequested(("cuda", "cpu")))
    fallback.fire(F.CheckFailed("cuda", ReasonCode.GPU_MISSING))
    fallback.fire(F.CheckPassed("cpu"))
    fallback.fire(F.LaunchSucceeded("cpu"))
    # a GPU plan whose server offloaded nothing: the proof demotes it to the CPU.
    fallback.fire(F.PlanRequested(("cuda", "cpu")))
    fallback.fire(F.CheckPassed("cuda"))
    fallback.fire(F.LaunchSucceeded("cuda", AccelerationProof(0, layers_zero=ReasonCode.CUDA_GPU_LAYERS_ZERO)))
    # a forced backend that cannot run: nowhere left.
    fallback.fire(F.PlanRequested(("cuda",), forced=True))
    fallback.fire(F.CheckFailed("cuda", ReasonCode.GPU_MISSING))

    launch = MachineRunner(L.LAUNCH, "launch", store)
    ready = (LR.PlanReady(PLAN), LR.Spawned(11), LR.Ready({}))
    for event in (LR.UpRequested(LR.LaunchSettings(max_restarts=1)), *ready):
        launch.fire(event)
    for event in (LR.RestartRequested(), LR.StopCompleted(0), *ready):  # stoker restart
        launch.fire(event)
    for event in (LR.ConfigChanged(), LR.StopCompleted(0), *ready):  # a config change relaunches
        launch.fire(event)
    launch.fire(LR.ServerExited(-9, ReasonCode.SERVER_CRASHED))  # crash 1: respawned
    for event in (LR.BackoffStarted(0.1), LR.BackoffElapsed(), LR.Spawned(12)):
        launch.fire(event)
    launch.fire(LR.ServerExited(-11, ReasonCode.SERVER_CRASHED))  # crash 2 > max_restarts 1: crash loop
    assert launch.state is LR.LaunchState.FAILED and launch.data.reason is ReasonCode.CRASH_LOOP

    failed = MachineRunner(I.INSTALL, I.INSTALL.machine_id("cuda", "cu12"), store)
    failed.fire(I.InstallRequested("cuda", "cu12"))
    failed.fire(I.InstallFailed(ReasonCode.BUNDLE_DIGEST_MISMATCH))
    done = MachineRunner(I.INSTALL, I.INSTALL.machine_id("cpu", "x86-64"), store)
    for event in (
        I.InstallRequested("cpu", "x86-64"),
        I.Resolved("https://b/cpu.zip", "ab" * 32, 10),
        I.Downloaded("/a.zip", "ab" * 32, 10),
        I.Verified(),
        I.Unpacked("/staging"),
        I.Validated(),
        I.SmokePassed(),
        I.Promoted(SlotBundle("cd" * 32, "b1")),
    ):
        done.fire(event)


def test_history_counts_fallbacks_restarts_crashes_and_installs(store):
    record_history(store)
    tally = HistoryTally()
    tally.read(store.transitions_after(0, KINDS, 10_000))
    assert tally.fallbacks == {
        ("default", "cuda", "cpu", "gpu_missing"): 1,
        ("default", "cuda", "cpu", "cuda_gpu_layers_zero"): 1,
        ("default", "cuda", "none", "gpu_missing"): 1,
    }
    assert tally.restarts == {("default", "requested"): 1, ("default", "config"): 1, ("default", "crash"): 1}
    assert tally.crashes == {("default", "server_crashed"): 2} and tally.crash_loops == {"default": 1}
    assert tally.installs == {("cuda", "failed", "bundle_digest_mismatch"): 1, ("cpu", "installed", ""): 1}

    # A restarted daemon reads the same counts from the same history; reading on takes only the new rows.
    again = HistoryTally()
    again.read(store.transitions_after(0, KINDS, 10_000))
    assert (again.fallbacks, again.restarts, again.crashes, again.installs) == (
        tally.fallbacks,
        tally.restarts,
        tally.crashes,
        tally.installs,
    )
    launch = MachineRunner(L.LAUNCH, "launch", store)
    for event in (LR.UpRequested(), LR.PlanReady(PLAN), LR.Spawned(13), LR.Ready({})):
        launch.fire(event)
    launch.fire(LR.ServerExited(-9, ReasonCode.SERVER_CRASHED))
    new = store.transitions_after(again.after_id, KINDS, 10_000)
    assert len(new) == 5
    again.read(new)
    assert again.restarts[("default", "crash")] == 2 and again.crashes[("default", "server_crashed")] == 3
    again.read(store.transitions_after(0, KINDS, 10_000))  # rows already read are never counted twice
    assert again.restarts[("default", "crash")] == 2


# --- the collector ----------------------------------------------------------------------------


@attrs.define
class Instance:
    state: LR.LaunchState = LR.LaunchState.READY
    data: LR.LaunchData = LR.LaunchData(plan=PLAN)

    def endpoint(self) -> tuple[str | None, str | None]:
        return "http://127.0.0.1:1", "k"


@attrs.define
class Member:
    """A configured model as /metrics reads it (daemon/fleet/member.py)."""

    name: str
    supervisor: Instance
    target: ServerTarget | None
    usage: Usage = attrs.field(factory=Usage)

    @property
    def state(self) -> LR.LaunchState:
        return self.supervisor.state

    def server_target(self) -> ServerTarget | None:
        return self.target


@attrs.define
class Fleet:
    members: list[Member]
    remotes: Remotes = attrs.field(factory=Remotes)  # none: the remote models' series are test_remote_endpoint's

    def serving(self) -> list[Member]:
        return self.members


@attrs.define
class Daemon:
    """What the front door reads of the daemon (FrontDoorDaemon), over a real store: the model
    `default` serving `target`, and `others`."""

    store: Any
    target: ServerTarget | None
    supervisor: Instance = attrs.field(factory=Instance)
    config: Config = attrs.field(factory=Config)
    batches: list[int] = attrs.field(factory=list)  # the history rows each read returned
    others: list[Member] = attrs.field(factory=list)
    installs: list[dict[str, Any]] = attrs.field(factory=list)  # install_statistics' rows
    # Ollama's listener: its port is never 11434 here (other tests, or Ollama itself, may hold it).
    ollama_url: str | None = None
    ollama_error: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.config.ollama.port == OllamaConfig().port:
            self.config = attrs.evolve(self.config, ollama=attrs.evolve(self.config.ollama, enabled=False))

    def install_statistics(self) -> list[dict[str, Any]]:
        return self.installs

    @property
    def fleet(self) -> Fleet:
        return Fleet([Member("default", self.supervisor, self.target), *self.others])

    async def wait_state(self, states: Any) -> None:
        raise AssertionError("not waited on here")

    def transitions_after(self, after_id: int, kinds: Sequence[str], limit: int) -> Sequence[Any]:
        rows = self.store.transitions_after(after_id, kinds, limit)
        self.batches.append(len(rows))
        return rows


def metrics_for(daemon: Daemon) -> FrontDoorMetrics:
    return FrontDoorMetrics(daemon, Hold(daemon), ROUTES, POST)


async def test_a_gpu_plan_served_on_the_cpu_says_both(store):
    record_history(store)
    daemon = Daemon(store, ServerTarget("cpu", 11, planned_backend="cuda", offloaded_layers=0, total_layers=33))
    text = (await metrics_for(daemon).scrape()).decode()
    m = {"model": "default"}
    assert value(text, "stoker_server_state", state="ready", **m) == 1
    assert value(text, "stoker_server_state", state="loading", **m) == 0
    assert value(text, "stoker_backend_info", planned="cuda", in_use="cpu", **m) == 1
    assert value(text, "stoker_accelerated", **m) == 0
    assert value(text, "stoker_offloaded_layers", **m) == 0 and value(text, "stoker_model_layers", **m) == 33
    assert value(text, "stoker_offload_partial", **m) == 0
    assert value(text, "stoker_queue_depth", **m) == 0 and value(text, "stoker_queue_limit") == 256
    assert value(text, "stoker_requests_held_total", **m) == 0 and value(text, "stoker_requests_in_flight", **m) == 0
    zero = {"from": "cuda", "to": "cpu", "reason": "cuda_gpu_layers_zero"}
    assert value(text, "stoker_fallbacks_total", **zero, **m) == 1
    assert value(text, "stoker_fallbacks_total", **{"from": "cuda", "to": "none", "reason": "gpu_missing"}, **m) == 1
    assert value(text, "stoker_server_restarts_total", cause="crash", **m) == 1
    assert value(text, "stoker_server_restarts_total", cause="requested", **m) == 1
    assert value(text, "stoker_server_restarts_total", cause="config", **m) == 1
    assert value(text, "stoker_server_crashes_total", reason="server_crashed", **m) == 2
    assert value(text, "stoker_crash_loops_total", **m) == 1
    assert value(text, "stoker_installs_total", backend="cuda", result="failed", reason="bundle_digest_mismatch") == 1
    assert value(text, "stoker_installs_total", backend="cpu", result="installed", reason="") == 1
    kinds = {name: f.type for name, f in families(text).items()}
    assert kinds["stoker_server_state"] == "gauge" and kinds["stoker_fallbacks"] == "counter"


async def test_a_gpu_engine_built_beside_shows_its_progress(store):
    building = {
        "backend": "cuda",
        "variant": "cuda13",
        "progress": {"phase": "building", "step": "compile", "percent": 29},
    }
    over = {"backend": "cpu", "variant": "avx2", "progress": None}
    daemon = Daemon(store, ServerTarget("cpu", 11), installs=[building, over])
    text = (await metrics_for(daemon).scrape()).decode()
    assert value(text, "stoker_install_progress_percent", backend="cuda", variant="cuda13", phase="building") == 29
    assert 'stoker_install_progress_percent{backend="cpu"' not in text


async def test_a_partial_offload_is_accelerated_and_partial(store):
    daemon = Daemon(store, ServerTarget("cuda", 11, offloaded_layers=15, total_layers=33))
    text = (await metrics_for(daemon).scrape()).decode()
    m = {"model": "default"}
    assert value(text, "stoker_backend_info", planned="cuda", in_use="cuda", **m) == 1
    assert value(text, "stoker_accelerated", **m) == 1
    assert (value(text, "stoker_offloaded_layers", **m), value(text, "stoker_offload_partial", **m)) == (15, 1)
    assert value(text, "stoker_crash_loops_total", **m) == 0  # present, at zero, from an empty history
    assert value(text, "stoker_server_restarts_total", cause="crash", **m) == 0


async def test_nothing_is_in_use_while_the_server_loads(store):
    daemon = Daemon(store, ServerTarget("cuda", 11, state="loading"), Instance(state=LR.LaunchState.LOADING))
    text = (await metrics_for(daemon).scrape()).decode()
    m = {"model": "default"}
    assert value(text, "stoker_server_state", state="loading", **m) == 1
    assert value(text, "stoker_backend_info", planned="cuda", in_use="none", **m) == 1
    assert value(text, "stoker_accelerated", **m) == 0
    assert value(text, "stoker_offloaded_layers", **m) is None  # not said yet
    stopped = Daemon(store, None, Instance(state=LR.LaunchState.STOPPED, data=LR.LaunchData()))
    text = (await metrics_for(stopped).scrape()).decode()
    assert "stoker_backend_info{" not in text and value(text, "stoker_server_state", state="stopped", **m) == 1


async def test_every_model_has_its_own_series_and_its_own_history(store):
    """Two models: alpha on a partial CUDA offload with a request in flight and one held, beta a
    GPU plan demoted to the CPU that crashed once; a model configured before (gamma) keeps its
    history's counts. The default model's machines (`launch`, `fallback`) are model `default`."""
    record_history(store)  # the default instance's: launch, fallback
    beta_launch = MachineRunner(L.LAUNCH, "launch:beta", store)
    for event in (LR.UpRequested(), LR.PlanReady(PLAN), LR.Spawned(21), LR.Ready({})):
        beta_launch.fire(event)
    beta_launch.fire(LR.ServerExited(-9, ReasonCode.SERVER_CRASHED))
    beta_fallback = MachineRunner(F.FALLBACK, "fallback:beta", store)
    beta_fallback.fire(F.PlanRequested(("cuda", "cpu")))
    beta_fallback.fire(F.CheckPassed("cuda"))
    beta_fallback.fire(F.LaunchSucceeded("cuda", AccelerationProof(0, layers_zero=ReasonCode.CUDA_GPU_LAYERS_ZERO)))
    gamma = MachineRunner(L.LAUNCH, "launch:gamma", store)
    for event in (LR.UpRequested(), LR.PlanReady(PLAN), LR.Spawned(31), LR.Ready({}), LR.RestartRequested()):
        gamma.fire(event)

    alpha = Member("alpha", Instance(), ServerTarget("cuda", 11, offloaded_layers=15, total_layers=33))
    alpha.usage.sent()
    with alpha.usage.held():
        beta = Member("beta", Instance(), ServerTarget("cpu", 21, planned_backend="cuda", total_layers=19))
        daemon = Daemon(store, None, Instance(state=LR.LaunchState.STOPPED, data=LR.LaunchData()), others=[alpha, beta])
        text = (await metrics_for(daemon).scrape()).decode()

    a, b = {"model": "alpha"}, {"model": "beta"}
    assert (
        value(text, "stoker_server_state", state="ready", **a)
        == value(text, "stoker_server_state", state="ready", **b)
        == 1
    )
    assert value(text, "stoker_server_state", state="stopped", model="default") == 1
    assert value(text, "stoker_backend_info", planned="cuda", in_use="cuda", **a) == 1
    assert value(text, "stoker_backend_info", planned="cuda", in_use="cpu", **b) == 1
    assert (value(text, "stoker_accelerated", **a), value(text, "stoker_accelerated", **b)) == (1, 0)
    assert (value(text, "stoker_offloaded_layers", **a), value(text, "stoker_model_layers", **a)) == (15, 33)
    assert (value(text, "stoker_offloaded_layers", **b), value(text, "stoker_model_layers", **b)) == (0, 19)
    assert (value(text, "stoker_offload_partial", **a), value(text, "stoker_offload_partial", **b)) == (1, 0)
    assert (value(text, "stoker_queue_depth", **a), value(text, "stoker_requests_in_flight", **a)) == (1, 1)
    assert (value(text, "stoker_requests_held_total", **a), value(text, "stoker_requests_held_total", **b)) == (1, 0)
    assert (value(text, "stoker_queue_depth", **b), value(text, "stoker_requests_in_flight", **b)) == (0, 0)
    # History, by the model whose machine wrote it.
    assert value(text, "stoker_server_crashes_total", reason="server_crashed", **b) == 1
    assert value(text, "stoker_server_crashes_total", reason="server_crashed", model="default") == 2
    assert value(text, "stoker_server_restarts_total", cause="crash", **b) == 1
    assert value(text, "stoker_server_restarts_total", cause="requested", model="gamma") == 1
    assert value(text, "stoker_server_restarts_total", cause="crash", **a) == 0  # configured: from zero
    assert value(text, "stoker_crash_loops_total", **a) == 0 and value(text, "stoker_crash_loops_total", **b) == 0
    zero = {"from": "cuda", "to": "cpu", "reason": "cuda_gpu_layers_zero"}
    assert (
        value(text, "stoker_fallbacks_total", **zero, **b)
        == value(text, "stoker_fallbacks_total", **zero, model="default")
        == 1
    )
    assert value(text, "stoker_fallbacks_total", **zero, **a) is None


async def test_two_front_doors_have_registries_of_their_own(store):
    first = metrics_for(Daemon(store, None))
    second = metrics_for(Daemon(store, None))  # the global registry would refuse the same names twice
    first.requests.requests.labels("/v1/models", "200").inc()
    assert value((await second.scrape()).decode(), "stoker_requests_total", route="/v1/models", code="200") is None


async def test_a_long_history_is_read_in_batches_that_let_the_streams_run(store):
    launch = MachineRunner(L.LAUNCH, "launch", store)
    for event in (LR.UpRequested(LR.LaunchSettings(max_restarts=10_000)), LR.PlanReady(PLAN), LR.Spawned(1)):
        launch.fire(event)
    for pid in range(2, 152):  # 150 crashes, each respawned: 3 + 750 rows
        launch.fire(LR.Ready({}))
        launch.fire(LR.ServerExited(-9, ReasonCode.SERVER_CRASHED))
        for event in (LR.BackoffStarted(0.1), LR.BackoffElapsed(), LR.Spawned(pid)):
            launch.fire(event)
    daemon = Daemon(store, None)
    others = []

    async def relaying() -> None:
        others.append("ran")

    metrics = metrics_for(daemon)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relaying)
        text = (await metrics.scrape()).decode()
        assert others, "the first scrape held the event loop through the whole history"
    m = {"model": "default"}
    assert value(text, "stoker_server_restarts_total", cause="crash", **m) == 150
    assert sum(daemon.batches) == 753 and max(daemon.batches) == HISTORY_BATCH
    daemon.batches.clear()
    assert value((await metrics.scrape()).decode(), "stoker_server_restarts_total", cause="crash", **m) == 150
    assert daemon.batches == [0]  # later scrapes read only what is new: nothing


# --- the request figures ----------------------------------------------------------------------


Handler = Callable[[Request], Awaitable[None]]


async def exchange(metrics: FrontDoorMetrics, path: str, handler: Handler, *, leave_after: int | None = None) -> bytes:
    """One request to `path`, answered by `handler` on the front door's HTTP server over a real
    loopback socket; what the client got. `leave_after`: the client closes its connection once
    it has read that many bytes. It returns once the server has counted the exchange."""
    daemon = Daemon(None, None)
    ended = trio.Event()

    async def answer(request: Request) -> None:
        try:
            await handler(request)
        finally:
            ended.set()  # the server counts the exchange as the handler returns, before it checkpoints

    async with trio.open_nursery() as nursery:
        listeners = await open_listeners("127.0.0.1", 0)
        await nursery.start(serve_http, listeners, daemon, metrics.requests, answer)
        port = listeners[0].getsockname()[1]
        got = b""
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            await client.send_all(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
            )
            with trio.fail_after(10):
                while (leave_after is None or len(got) < leave_after) and not got.endswith(b"0\r\n\r\n"):
                    if not (data := await client.receive_some(65536)):
                        break  # the server closed it: a cut answer
                    got += data
        with trio.fail_after(10):
            await ended.wait()  # a client that left is noticed at the handler's next write
        nursery.cancel_scope.cancel()
    return got


def streaming(*chunks: bytes, fail: Exception | None = None, pause: float = 0.0) -> Handler:
    async def handler(request: Request) -> None:
        await request.start(200, [])
        for chunk in chunks:
            await request.send(chunk)
            await trio.sleep(pause)
        if fail is not None:
            raise fail
        await request.end()

    return handler


async def test_a_streamed_answer_is_counted_timed_and_its_tokens_read(store):
    metrics = metrics_for(Daemon(store, None))
    route = "/v1/chat/completions"
    got = await exchange(metrics, route, streaming(b'data: {"choices":[]}\n\n', SSE_LAST, b"data: [DONE]\n\n"))
    assert SSE_LAST in got and got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    await exchange(metrics, route, streaming(CHAT_JSON[:100], CHAT_JSON[100:]))
    text = (await metrics.scrape()).decode()
    assert value(text, "stoker_requests_total", route=route, code="200") == 2
    assert value(text, "stoker_request_first_byte_seconds_count", route=route) == 2
    assert value(text, "stoker_request_duration_seconds_count", route=route) == 2
    assert value(text, "stoker_generated_tokens_total", route=route) == 3 + 5
    assert value(text, "stoker_generation_seconds_total", route=route) == pytest.approx((0.323 + 0.585) / 1000)
    assert value(text, "stoker_generation_tokens_per_second_count", route=route) == 2
    assert value(text, "stoker_generation_tokens_per_second_bucket", route=route, le="5000.0") == 0
    assert value(text, "stoker_generation_tokens_per_second_bucket", route=route, le="10000.0") == 2
    assert "stoker_responses_cut_total{" not in text


async def test_a_scrape_is_not_a_request_an_unknown_path_is_other_and_an_error_no_first_token(store):
    metrics = metrics_for(Daemon(store, None))
    await exchange(metrics, "/metrics", streaming(b"x"))
    await exchange(metrics, "/v2/secret/42", streaming(b"x"))

    async def refused(request: Request) -> None:
        await request.respond(503, [], b'{"error": {"code": "frontdoor_hold_timeout"}}')

    await exchange(metrics, "/v1/completions", refused)
    text = (await metrics.scrape()).decode()
    assert value(text, "stoker_requests_total", route="other", code="200") == 1
    assert value(text, "stoker_requests_total", route="/metrics", code="200") is None
    assert value(text, "stoker_requests_total", route="/v1/completions", code="503") == 1
    assert value(text, "stoker_request_duration_seconds_count", route="/v1/completions") == 1
    assert value(text, "stoker_request_first_byte_seconds_count", route="/v1/completions") is None


@attrs.frozen
class EngineHead:
    """An engine answer's status and headers (what `relay` reads of it besides its chunks)."""

    status_code: int = 200
    raw_headers: list[tuple[bytes, bytes]] = attrs.field(factory=lambda: [(b"content-type", b"text/event-stream")])

    def pumpable(self) -> bool:
        return False  # its chunks come from the test, not from an engine's socket


async def test_answers_cut_midway_are_counted_by_reason(store, autojump_clock):
    metrics = metrics_for(Daemon(store, None))
    route = "/v1/chat/completions"

    async def cut_by_the_engine() -> AsyncIterator[bytes]:
        yield b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
        raise httpx.ReadError("peer closed connection")

    async def relayed(request: Request) -> None:
        # The front door's own relay: a cut SSE stream ends with its error event.
        await relay(
            request, EngineHead(), True, b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', cut_by_the_engine()
        )

    got = await exchange(metrics, route, relayed)
    assert b"engine_stream_cut" in got and got.endswith(b"\r\n0\r\n\r\n")  # then the stream ends well
    # A plain body cut by the engine: the connection is aborted before the body's end.
    cut = await exchange(metrics, route, streaming(b'{"choices":', fail=httpx.ReadError("cut")))
    assert b'{"choices":' in cut and not cut.endswith(b"0\r\n\r\n")
    await exchange(metrics, route, streaming(*[b"data: a\n\n"] * 50, pause=0.02), leave_after=1)
    text = (await metrics.scrape()).decode()
    assert value(text, "stoker_responses_cut_total", route=route, reason="engine_stream_cut") == 1
    assert value(text, "stoker_responses_cut_total", route=route, reason="engine_cut") == 1
    assert value(text, "stoker_responses_cut_total", route=route, reason="client_gone") == 1
    assert value(text, "stoker_requests_total", route=route, code="200") == 3


def test_the_per_chunk_work_keeps_references_not_copies():
    seen = Exchange("/v1/completions")
    big = b"x" * 1_000_000
    for chunk in (b"a", big, b"b" * 10, CHAT_JSON):
        seen.body_sent(chunk)
    assert seen.c1 is big and seen.c3 is CHAT_JSON
    assert len(seen.tail()) <= 8192 and seen.tail().endswith(CHAT_JSON)
