"""`/metrics`: what only Stoker knows, and the front door's request figures, for Prometheus.

One `CollectorRegistry` per front door (never prometheus_client's global one: a process may
hold several daemons in tests). Three sources, each named in docs/frontdoor.md, "Metrics":
- the daemon's live state, read at scrape time (`StokerCollector`), per configured model
  (label `model`): its launch machine's state, the backend planned and the one really in use
  (the fallback machine's verdict from the proof after ready, never the config), the layers
  the engine said it offloaded, its requests held and in flight;
- counters that must survive a daemon restart, read from the store's history at scrape time
  (daemon/frontdoor/tallies.py): fallbacks, restarts, crashes, crash loops, install outcomes;
- request figures kept in memory as the answers go by (`Exchange`, fed by the HTTP server,
  daemon/frontdoor/http11.py): requests by route and status, time to first byte and total
  duration, tokens and tokens/s from the engine's own `timings`/`usage` in the answer's last
  bytes, responses cut midway by reason.

The data path pays O(1) per chunk: a clock read for the first byte and keeping a reference to
the last three chunks. The answer's tail is parsed once, after its last byte was sent.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import attrs
import httpx
import trio
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stoker.daemon.frontdoor.routes import route_label
from stoker.daemon.frontdoor.tallies import KINDS, HistoryTally
from stoker.states.launch import records as LR

if TYPE_CHECKING:
    from stoker.daemon.frontdoor.hold import Hold
    from stoker.daemon.frontdoor.daemon_view import FrontDoorDaemon

log = logging.getLogger("stoker.frontdoor")

# The classic text format (version 0.0.4): every Prometheus, and every scraper that speaks it.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
NONE = "none"  # backend_info's in_use while no server serves; a request's code when none was sent
# Seconds: a token from a warm tiny model is ~1 ms; a held request or a long answer is minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The front door's own share of a first byte: tenths of a millisecond to tens.
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025, 0.1)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# How much of an answer's end is read for the engine's figures: its last event or JSON fields.
TAIL = 8192
# What the relay writes as the last event of an SSE stream the engine cut (daemon/frontdoor/app.py).
STREAM_CUT_EVENT = b'"code": "engine_stream_cut"'
# History rows read between two checkpoints (2-4 ms each on the 2-core test machine).
HISTORY_BATCH = 128
_NUMBER = re.compile(rb"\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)")


# --- the engine's own figures in an answer ------------------------------------------------


@attrs.frozen
class EngineFigures:
    """What the engine said about the generation it just finished (None: it did not say)."""

    generated: int | None = None  # tokens generated (timings.predicted_n, else usage's count)
    prompt: int | None = None  # the prompt's tokens (usage's count, else timings' prompt_n + cache_n)
    per_second: float | None = None  # timings.predicted_per_second
    seconds: float | None = None  # timings.predicted_ms / 1000


def _last_number(tail: bytes, key: bytes) -> float | None:
    """The number after the last `"key":` in `tail` (a key inside a JSON string is escaped: `\\"key\\"`)."""
    at = tail.rfind(b'"' + key + b'":')
    if at < 0:
        return None
    found = _NUMBER.match(tail, at + len(key) + 3)
    return float(found.group(1)) if found else None


def engine_figures(tail: bytes) -> EngineFigures:
    """The engine's figures from an answer's last bytes: llama-server ends a completion (its
    JSON, or its last SSE event) with `timings` (predicted_n, predicted_ms,
    predicted_per_second); `usage` (completion_tokens, Anthropic's output_tokens) counts
    tokens where `timings` is absent; the prompt's tokens are usage's (prompt_tokens, Anthropic's
    input_tokens), else timings' prompt_n and cache_n (evaluated, and found in the cache).
    With several choices, the last one's figures."""
    generated = _last_number(tail, b"predicted_n")
    for key in (b"completion_tokens", b"output_tokens", b"eval_count"):
        if generated is None:
            generated = _last_number(tail, key)
    # The prompt's tokens: usage's count, else timings' (those evaluated plus those the cache had).
    prompt = _last_number(tail, b"prompt_tokens")
    if prompt is None:
        prompt = _last_number(tail, b"input_tokens")
    if prompt is None and (evaluated := _last_number(tail, b"prompt_n")) is not None:
        prompt = evaluated + (_last_number(tail, b"cache_n") or 0)
    if prompt is None:
        prompt = _last_number(tail, b"prompt_eval_count")
    ms = _last_number(tail, b"predicted_ms")
    per_second = _last_number(tail, b"predicted_per_second")
    if ms is None and (ns := _last_number(tail, b"eval_duration")) is not None:
        # Ollama's last line (daemon/frontdoor/ollama.py) carries the engine's timings in nanoseconds.
        ms = ns / 1e6
        per_second = generated / (ms / 1000.0) if generated and ms > 0 else None
    return EngineFigures(
        generated=None if generated is None else int(generated),
        prompt=None if prompt is None else int(prompt),
        per_second=per_second,
        seconds=None if ms is None else ms / 1000.0,
    )


# --- request figures (in memory) ----------------------------------------------------------


class Exchange:
    """One request as the server saw it go by: its status, when its first body byte left,
    whether its body was complete, and its last three chunks (references, never copies)."""

    __slots__ = ("route", "started", "ended", "status", "first_byte", "engine_s", "complete", "cut", "c1", "c2", "c3")

    def __init__(self, route: str, started: float | None = None) -> None:
        self.route = route
        self.started = time.perf_counter() if started is None else started  # its head read
        self.ended = self.started  # set when the request is recorded (`RequestFigures.finish`)
        self.status: int | None = None
        self.first_byte: float | None = None  # the first body byte handed to the client's socket
        # From the request handed to the engine's socket to its answer's first event read whole:
        # the engine's part of the time to the first byte. Set for a request sent once, not held
        # (`added`).
        self.engine_s: float | None = None
        self.complete = False
        self.cut: str | None = None  # why a started body did not end whole (`cut_reason`)
        self.c1 = self.c2 = self.c3 = b""

    def status_sent(self, status: int) -> None:
        """The answer's head is on its way."""
        self.status = status

    def body_sent(self, body: bytes) -> None:
        """One piece of the body on its way to the client: O(1)."""
        if body:
            if self.first_byte is None:
                self.first_byte = time.perf_counter()
            self.c1, self.c2, self.c3 = self.c2, self.c3, body

    def body_complete(self) -> None:
        """The body is whole."""
        self.complete = True

    def added(self) -> float | None:
        """Seconds the front door itself added before the first byte: from the request's head
        read to its answer's first byte handed to the client's socket, less the engine's part
        (`engine_s`). Both ends are taken as the bytes go into a socket, not when the write
        returns: a write that wakes its reader may be preempted by it, and that time is the
        reader's (the engine computing, the client reading), as it is on the direct path. None
        for a request held, sent again, or answered without the engine."""
        if self.engine_s is None or self.first_byte is None:
            return None
        return max(0.0, self.first_byte - self.started - self.engine_s)

    def tail(self) -> bytes:
        return b"".join((bytes(self.c1[-TAIL:]), bytes(self.c2[-TAIL:]), bytes(self.c3[-TAIL:])))[-TAIL:]


def cut_reason(exc: BaseException | None) -> str:
    """Why a response whose body never completed stopped: the engine's side or the client's."""
    if isinstance(exc, httpx.TransportError):
        return "engine_cut"
    if exc is None or isinstance(exc, (OSError, trio.Cancelled)):
        return "client_gone"
    return "error"


class RequestFigures:
    """The request instruments, on the front door's own registry."""

    def __init__(self, registry: CollectorRegistry, routes: Sequence[str], generating: Sequence[str]) -> None:
        self.routes = frozenset(routes)
        self.generating = frozenset(generating)
        self.requests = Counter(
            "stoker_requests",
            "Requests answered by the front door, by route and HTTP status.",
            ["route", "code"],
            registry=registry,
        )
        self.first_byte = Histogram(
            "stoker_request_first_byte_seconds",
            "Time from a request's arrival to the first byte of a successful answer (holding included).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "stoker_request_duration_seconds",
            "Time from a request's arrival to the end of its answer (holding included).",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.added = Histogram(
            "stoker_frontdoor_added_seconds",
            "What the front door itself added to a request's time to first byte (its time from the "
            "request's arrival to the first byte's write, less the engine's part); requests sent once, not held.",
            ["route"],
            buckets=ADDED_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "stoker_generated_tokens", "Tokens generated, as the engine counted them.", ["route"], registry=registry
        )
        self.generation_seconds = Counter(
            "stoker_generation_seconds",
            "Time the engine spent generating, as it measured it.",
            ["route"],
            registry=registry,
        )
        self.rate = Histogram(
            "stoker_generation_tokens_per_second",
            "Tokens per second of each answer, as the engine measured it.",
            ["route"],
            buckets=RATE_BUCKETS,
            registry=registry,
        )
        self.cut = Counter(
            "stoker_responses_cut",
            "Answers cut midway (headers sent, body incomplete), by route and reason.",
            ["route", "reason"],
            registry=registry,
        )

        # Each labelled series as first used, looked up once (prometheus_client's `labels` takes
        # a lock and builds its key at every call): settling a request then costs dict lookups.
        self._children: dict[tuple[object, ...], Any] = {}

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered (a series shows in /metrics from its first use, as before)."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def route_of(self, path: str) -> str | None:
        """The route label of a path; None for /metrics itself (a scrape is not a request)."""
        if path == "/metrics":
            return None
        # A path with an id counts under its pattern (/v1/models/{id}); one the route table does
        # not hold (Ollama's API on its listener) under itself.
        label = route_label(path) or path
        return label if label in self.routes else "other"

    def finish(self, exchange: Exchange, exc: BaseException | None) -> EngineFigures | None:
        """Record a request once its answer ended (or failed): as its last byte goes out. The
        engine's figures read from a whole generating answer (for the access log), else None."""
        route, status = exchange.route, exchange.status
        end = exchange.ended = time.perf_counter()
        child = self._child
        child(self.requests, route, NONE if status is None else str(status)).inc()
        child(self.duration, route).observe(end - exchange.started)
        if status is None:
            return None
        if exchange.first_byte is not None and status < 400:  # the first token, not an error's JSON
            child(self.first_byte, route).observe(exchange.first_byte - exchange.started)
            if (added := exchange.added()) is not None:
                child(self.added, route).observe(added)
        if not exchange.complete:
            exchange.cut = cut_reason(exc)
            child(self.cut, route, exchange.cut).inc()
            return None
        if status != 200 or route not in self.generating:
            return None
        tail = exchange.tail()
        if STREAM_CUT_EVENT in tail:
            child(self.cut, route, "engine_stream_cut").inc()
        figures = engine_figures(tail)
        if figures.generated is not None:
            child(self.tokens, route).inc(figures.generated)
        if figures.seconds is not None:
            child(self.generation_seconds, route).inc(figures.seconds)
        if figures.per_second is not None:
            child(self.rate, route).observe(figures.per_second)
        return figures


# --- the daemon's state, read at scrape time ----------------------------------------------


def _model_gauges(*rows: tuple[str, str]) -> list[GaugeMetricFamily]:
    """One gauge a (name, help) row, each with the single label `model`."""
    return [GaugeMetricFamily(name, help_text, labels=["model"]) for name, help_text in rows]


class StokerCollector(Collector):
    """Gauges of the daemon's live state and counters from its history, read at each scrape."""

    def __init__(self, daemon: FrontDoorDaemon, hold: Hold) -> None:
        self.daemon = daemon
        self.hold = hold
        self.tally = HistoryTally()

    def collect(self) -> Iterable[Metric]:
        yield from self.live()
        yield from self.history()

    def live(self) -> Iterable[Metric]:
        """One series per configured model (label `model`: its NAME, `default` without [models])."""
        states = GaugeMetricFamily(
            "stoker_server_state", "A model's server state: 1 for the state it is in.", labels=["model", "state"]
        )
        info = GaugeMetricFamily(
            "stoker_backend_info",
            "The backend a model's plan chose and the one really in use (proven after ready; none while not serving).",
            labels=["model", "planned", "in_use"],
        )
        accelerated, offloaded_layers, model_layers, partial, depth, in_flight = _model_gauges(
            ("stoker_accelerated", "1 while the model serves on an accelerator it really uses."),
            ("stoker_offloaded_layers", "Layers the engine said it offloaded to the accelerator."),
            ("stoker_model_layers", "The model's layers, as the engine counted them."),
            ("stoker_offload_partial", "1 when some but not all layers are offloaded (the rest computes on the CPU)."),
            ("stoker_queue_depth", "Requests waiting for the model to be ready."),
            ("stoker_requests_in_flight", "Requests sent to the model's engine, answer not over."),
        )
        held = CounterMetricFamily(
            "stoker_requests_held", "Requests that had to wait for the model to be ready.", labels=["model"]
        )
        for member in self.daemon.fleet.serving():
            name, state = member.name, member.state
            for each in LR.LaunchState:
                states.add_metric([name, each.value], 1.0 if each is state else 0.0)
            target = member.server_target()
            in_use = target.backend if state is LR.LaunchState.READY and target is not None else None
            if target is not None:
                info.add_metric([name, target.planned_backend or target.backend, in_use or NONE], 1.0)
            accelerated.add_metric([name], float(in_use is not None and in_use != LR.CPU_BACKEND))
            offloaded = target.offloaded_layers if target is not None and in_use is not None else None
            if offloaded is None and in_use == LR.CPU_BACKEND:
                offloaded = 0  # a CPU engine prints no offload line: nothing is offloaded
            total = target.total_layers if target is not None and in_use is not None else None
            if offloaded is not None:
                offloaded_layers.add_metric([name], offloaded)
            if total is not None:
                model_layers.add_metric([name], total)
            if offloaded is not None and total is not None:
                partial.add_metric([name], float(0 < offloaded < total))
            usage = member.usage
            depth.add_metric([name], usage.waiting)
            in_flight.add_metric([name], usage.in_flight)
            held.add_metric([name], usage.held_total)
        remote_series = self.remotes(info, in_flight)
        yield from (states, info, accelerated, offloaded_layers, model_layers, partial, depth, in_flight, held)
        yield from remote_series
        yield self.installs()
        yield GaugeMetricFamily(
            "stoker_queue_limit",
            "How many requests may wait at once, every model together ([frontdoor] max_queue).",
            value=self.daemon.config.frontdoor.max_queue,
        )

    def installs(self) -> Metric:
        """A bundle being installed, by backend and variant: the percent its build (or
        download) said last; no sample once it is over (a GPU engine built beside the CPU)."""
        progress = GaugeMetricFamily(
            "stoker_install_progress_percent",
            "An engine bundle install in progress: the percent its build or download reached.",
            labels=["backend", "variant", "phase"],
        )
        for row in self.daemon.install_statistics():
            figures = row.get("progress") or {}
            if figures.get("percent") is not None:
                labels = [str(row.get("backend")), str(row.get("variant")), str(figures.get("phase") or "")]
                progress.add_metric(labels, float(figures["percent"]))
        return progress

    def remotes(self, info: GaugeMetricFamily, in_flight: GaugeMetricFamily) -> tuple[Metric, ...]:
        """The remote models (`[models.NAME] endpoint`): backend "remote", their requests in
        flight, their endpoint and its last check. No `stoker_accelerated` sample: Stoker runs
        nothing there, so it cannot prove acceleration (`accelerated="unknown"` says so)."""
        remote_info = GaugeMetricFamily(
            "stoker_remote_info",
            "1 per model served by an external endpoint; accelerated is unknown: Stoker runs nothing there to prove it.",
            labels=["model", "endpoint", "accelerated"],
        )
        up, latency = _model_gauges(
            ("stoker_remote_up", "1 when the endpoint answered its last check (GET /models) with 2xx."),
            ("stoker_remote_check_seconds", "How long the endpoint took to answer its last check."),
        )
        for remote in self.daemon.fleet.remotes.serving():
            name, check = remote.name, remote.check
            info.add_metric([name, "remote", "remote"], 1.0)
            in_flight.add_metric([name], remote.usage.in_flight)
            remote_info.add_metric([name, remote.config.endpoint, "unknown"], 1.0)
            if check is not None and check.reachable is not None:
                up.add_metric([name], float(check.reachable and check.error is None))
            if check is not None and check.latency_ms is not None:
                latency.add_metric([name], check.latency_ms / 1000.0)
        return remote_info, up, latency

    async def catch_up(self) -> None:
        """Count the history written since the last scrape, a batch at a time: the first scrape
        of a daemon's life reads it all, without holding the event loop (and the streams it
        relays) for more than one batch."""
        tally = self.tally
        while True:
            try:
                batch = self.daemon.transitions_after(tally.after_id, KINDS, HISTORY_BATCH)
            except Exception as exc:  # a failing disk: serve the counts read so far, not an error
                log.warning("metrics: the state database's history cannot be read now (%s)", exc)
                return
            tally.read(batch)
            if len(batch) < HISTORY_BATCH:
                return
            await trio.sleep(0)

    def history(self) -> Iterable[Metric]:
        """Counters from history, by model where the machine id says which (launch:<NAME>,
        fallback:<NAME>; `launch`/`fallback`: the model `default`)."""
        tally = self.tally
        fallbacks = CounterMetricFamily(
            "stoker_fallbacks",
            "Backends passed over or left, by model, from, to and reason.",
            labels=["model", "from", "to", "reason"],
        )
        for key, count in sorted(tally.fallbacks.items()):
            fallbacks.add_metric(list(key), count)
        yield fallbacks
        # Configured models show their restart causes and crash loops from zero.
        configured = {m.name for m in self.daemon.fleet.serving()}
        models = sorted(configured | set(tally.crash_loops) | {model for model, _ in tally.restarts})
        restarts = CounterMetricFamily(
            "stoker_server_restarts",
            "Server relaunches, by model and cause: crash, requested, config.",
            labels=["model", "cause"],
        )
        for model in models:
            for cause in ("crash", "requested", "config"):
                restarts.add_metric([model, cause], tally.restarts[(model, cause)])
        yield restarts
        crashes = CounterMetricFamily(
            "stoker_server_crashes", "Server exits counted as crashes, by model and reason.", labels=["model", "reason"]
        )
        for (model, reason), count in sorted(tally.crashes.items()):
            crashes.add_metric([model, reason], count)
        yield crashes
        loops = CounterMetricFamily(
            "stoker_crash_loops",
            "Times a model's server was given up on after too many crashes in a row.",
            labels=["model"],
        )
        for model in models:
            loops.add_metric([model], tally.crash_loops[model])
        yield loops
        installs = CounterMetricFamily(
            "stoker_installs",
            "Engine bundle installs that ended, by backend, result and reason.",
            labels=["backend", "result", "reason"],
        )
        for (backend, result, reason), count in sorted(tally.installs.items()):
            installs.add_metric([backend, result, reason], count)
        yield installs


class FrontDoorMetrics:
    """The front door's registry: the collector of the daemon's state and the request figures."""

    def __init__(self, daemon: FrontDoorDaemon, hold: Hold, routes: Sequence[str], generating: Sequence[str]) -> None:
        self.registry = CollectorRegistry()
        self.collector = StokerCollector(daemon, hold)
        self.registry.register(self.collector)
        self.requests = RequestFigures(self.registry, routes, generating)

    async def scrape(self) -> bytes:
        """The Prometheus text format of everything: the history caught up, the rest read now."""
        await self.collector.catch_up()
        return generate_latest(self.registry)
