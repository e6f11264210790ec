"""The front door's own HTTP/1.1 server against Hypercorn's trio worker, on the same relay, side
by side in one run.

    .venv/bin/python tests/bench/frontdoor_server.py [--model gemma|tiny|PATH] [--quick] [--no-write]

(Hypercorn comes with the `bench` extra: `pip install -e '.[bench]'`.)

One daemon on a temporary STOKER_HOME runs llama-server with the model (`parallel` slots); its
engine's endpoint and per-launch key come from `status`. Three more processes serve the same
relay to that engine, each on its own port, started from this file (`--serve ARM`):

- `own`: `serve_frontdoor`, the daemon's front door service itself (daemon/frontdoor/http11.py
  under `FrontDoor.handle`), with a stand-in daemon whose one model is the engine, ready;
- `own, no pump`: the same, a stream's rest relayed on trio's loop rather than pumped from socket
  to socket by the relay loop (what any ASGI server must do: it hands the app no socket);
- `hypercorn`: `hypercorn.trio.serve` with an ASGI app that gives every request to the same
  `FrontDoor.handle` (the same key check, body limits, hold, engine wire, relay and request
  figures) through a `Request` of ASGI messages.

The same raw client (tests/bench/rawchat.py: asyncio sockets, keep-alive, chunked SSE parsed from
the bytes) sends the same streamed chat completions (`ignore_eos`: every arm generates as many
tokens) to the engine directly and to each server; the arms take turns going first, round by
round (the machine is shared and noisy: what drifts, drifts for all). Each phase warms every arm
up first. Figures:

1. Time to first token, one stream at a time (`--ttft-tokens`-token answers): p50/p99 per arm,
   and the time each server adds, paired against the direct request of its round.
2. One long stream: the serving process's CPU (all its threads, its CPU clock) per
   streamed token, per round (median and range), and tokens/s.
3. `--streams` concurrent streams, one connection each: time to first token over every stream,
   CPU per streamed token, aggregate tokens/s.

Ratios are hypercorn / own: above 1, the own server is ahead. Results go to docs/benchmarks.md
"Front door: own HTTP server against Hypercorn" (`--no-write`: print only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
import trio

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.daemon.config.model import Config  # noqa: E402
from stoker.daemon.config.instances import ServedModel  # noqa: E402
from stoker.daemon.config.remote import is_loopback_host  # noqa: E402
from stoker.daemon.core.http import loopback_client  # noqa: E402
from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from stoker.daemon.engine.wire import EngineWire  # noqa: E402
from stoker.daemon.fleet.remote import Remotes  # noqa: E402
from stoker.daemon.fleet.usage import Usage  # noqa: E402
from stoker.daemon.frontdoor.access import log_access  # noqa: E402
from stoker.daemon.frontdoor.app import FrontDoor  # noqa: E402
from stoker.daemon.frontdoor.hold import Hold  # noqa: E402
from stoker.daemon.frontdoor.http11 import ClientGone, Request  # noqa: E402
from stoker.daemon.frontdoor.metrics import Exchange  # noqa: E402
from stoker.daemon.frontdoor.daemon_view import allow_loopback  # noqa: E402
from stoker.daemon.frontdoor.server import ENGINE_TIMEOUT, serve_frontdoor, settle_gc  # noqa: E402
from stoker.daemon.models.known import WELL_KNOWN  # noqa: E402
from stoker.states.launch import records as LR  # noqa: E402
from tests.bench.frontdoor import checked, prepare_model  # noqa: E402
from tests.bench.rawchat import Conn, Stream, chat_body  # noqa: E402
from tests.bench.report import engine_bundle, machine, percentile, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, write_config  # noqa: E402
from tests.model_files import GEMMA  # noqa: E402

SERVERS = ("own", "own, no pump", "hypercorn")
ARMS = ("direct", *SERVERS)
SECTION = "Front door: own HTTP server against Hypercorn"
# What "a clear win" for the own server means: hypercorn / own at least this on the p99 time to
# first token it adds, or on CPU per streamed token.
CLEAR_WIN = 1.10
METHOD = (
    "Does the front door's hand-written HTTP/1.1 server (daemon/frontdoor/http11.py) earn its place "
    "against a well-kept one? The same relay (`FrontDoor.handle`: key check, body limits, hold, engine "
    "wire, relay, request figures) is served by `own` (`serve_frontdoor`, as the daemon runs it), `own, "
    "no pump` (the same, a stream's rest relayed on trio's loop instead of pumped by the relay loop, as "
    "any ASGI server must) and `hypercorn` (Hypercorn's trio worker, `hypercorn.trio.serve`, with an ASGI "
    "app handing each request to `FrontDoor.handle`), each in its own process, against the same engine; "
    "`direct` is the engine itself. The same raw client sends the same streamed chat completions to each "
    "arm, the arms taking turns going first round by round, after a warm-up. CPU is the serving "
    "process's (every thread, its CPU clock); time added is each request's time to first token less the "
    "direct one of its round. Hypercorn is installed by the `bench` extra (`pip install -e '.[bench]'`) "
    "only: it is this comparison's baseline, never imported by Stoker. Ratios are hypercorn / own (above "
    f"1: the own server is ahead); a clear win is {CLEAR_WIN:.2f} or more on the p99 time added or on "
    "CPU per streamed token.\n\n"
)


# --- the servers (child processes) -----------------------------------------------------------


@attrs.define
class EngineMember:
    """The one model: the engine under test, ready (what `FrontDoor` reads of a fleet member)."""

    base_url: str
    api_key: str | None
    name: str = "default"
    loads_on_demand: bool = False
    usage: Usage = attrs.field(factory=Usage)
    state: LR.LaunchState = LR.LaunchState.READY

    def endpoint(self) -> tuple[str | None, str | None]:
        return self.base_url, self.api_key

    @property
    def served(self) -> ServedModel:
        """What the front door's rename reads: the id the engine answers under."""
        return ServedModel(self.name, Config(), default=True)


@attrs.define
class EngineFleet:
    member: EngineMember
    remotes: Any

    def serving(self) -> list[EngineMember]:
        return [self.member]

    def lookup(self, model: str | None) -> EngineMember | None:
        return self.member if model in (None, "default") else None


@attrs.define
class StandIn:
    """The daemon as the front door sees it (FrontDoorDaemon), serving only the engine."""

    config: Any
    fleet: EngineFleet
    ollama_url: str | None = None  # Ollama's listener is not part of this comparison
    ollama_error: str | None = None

    async def wait_state(self, states: Any) -> None:
        raise AssertionError("the engine is always ready here")

    def transitions_after(self, after_id: int, kinds: Any, limit: int) -> list[Any]:
        return []


def stand_in(engine: str, key: str | None, port: int) -> StandIn:
    base = Config()
    # Ollama's listener is not part of this comparison (and its port is Ollama's own).
    config = attrs.evolve(
        base, frontdoor=attrs.evolve(base.frontdoor, port=port), ollama=attrs.evolve(base.ollama, enabled=False)
    )
    return StandIn(config, EngineFleet(EngineMember(engine, key), Remotes()))


class AsgiRequest:
    """One ASGI request with the calls `FrontDoor.handle` makes of daemon/frontdoor/http11.py's
    `Request`: the head, the body read, the answer given whole or in pieces, the client's
    leaving watched. Hypercorn frames the body (chunked) and writes it."""

    def __init__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        self._receive, self._send = receive, send
        self.method = scope["method"]
        self.path = scope["path"]
        query = scope.get("query_string") or b""
        self.target = scope.get("raw_path", self.path.encode()) + (b"?" + query if query else b"")
        self.headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        self.client = scope.get("client")
        self.loopback = self.client is not None and is_loopback_host(self.client[0])
        self.exchange: Any = None
        self.caller: Any = None
        self.model: object = None
        self.instance: str | None = None
        self.gone = False
        self._started = False
        self._body_done = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def answered(self) -> bool:
        return self._started

    async def receive(self) -> bytes:
        if self._body_done:
            return b""
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone("the client closed before sending its whole body")
            body = message.get("body", b"")
            if not message.get("more_body", False):
                self._body_done = True
            if body or self._body_done:
                return bytes(body)

    def receive_now(self) -> bytes | None:
        return None  # ASGI has no "what already arrived": `receive` awaits it

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self._started = True
        if self.exchange is not None:
            self.exchange.status_sent(status)
            self.exchange.body_sent(body)
            self.exchange.body_complete()
        head = [*headers, (b"content-length", b"%d" % len(body))]
        await self._send({"type": "http.response.start", "status": status, "headers": head})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        self._started = True
        if self.exchange is not None:
            self.exchange.status_sent(status)
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        if first:
            await self.send(first)

    async def send(self, data: bytes) -> None:
        if data:
            if self.exchange is not None:
                self.exchange.body_sent(data)
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def pumpable(self) -> bool:
        return False  # an ASGI app is handed no socket

    async def end(self, last: bytes = b"") -> None:
        if self.exchange is not None:
            if last:
                self.exchange.body_sent(last)
            self.exchange.body_complete()
        await self._send({"type": "http.response.body", "body": last, "more_body": False})

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """As http11's: the block is cancelled if the client leaves (ASGI's `http.disconnect`)."""

        async def watch(scope: trio.CancelScope) -> None:
            while (await self._receive())["type"] != "http.disconnect":
                pass
            self.gone = True
            scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                try:
                    yield
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) != 1:
                raise
            raise group.exceptions[0] from None


def asgi_front_door(front: Any) -> Callable[..., Awaitable[None]]:
    """`FrontDoor.handle` as an ASGI app, each request counted and logged as http11's
    `Connection.serve` counts and logs it."""
    figures = front.metrics.requests

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        request = AsgiRequest(scope, receive, send)
        route = figures.route_of(request.path)
        exchange = request.exchange = Exchange(route, time.perf_counter()) if route is not None else None
        failure: BaseException | None = None
        try:
            await front.handle(request)
        except ClientGone as exc:
            failure = OSError(str(exc))
        except Exception as exc:
            failure = exc
            raise
        finally:
            if exchange is not None:
                log_access(request, exchange, figures.finish(exchange, failure))

    return app


async def serve_arm(arm: str, engine: str, key: str | None, port: int) -> None:
    """Serve the relay to `engine` on 127.0.0.1:`port` with `arm`'s HTTP server, until killed."""
    daemon = stand_in(engine, key, port)
    if arm in ("own", "own, no pump"):
        if arm == "own, no pump":
            Request.pumpable = lambda self: False  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_frontdoor, daemon)
        return
    from hypercorn.config import Config as HypercornConfig  # the `bench` extra
    from hypercorn.trio import serve

    settle_gc()  # as serve_frontdoor does: the same collector for both servers
    config = HypercornConfig()
    config.bind = [f"127.0.0.1:{port}"]
    config.backlog = 1024
    config.accesslog = None
    async with loopback_client() as http, EngineWire(ENGINE_TIMEOUT) as wire:
        front = FrontDoor(daemon, http, allow_loopback, Hold(daemon), wire)  # type: ignore[arg-type]
        await serve(asgi_front_door(front), config)  # type: ignore[arg-type]


async def stand_in_engine(port: int, token_ms: float) -> None:
    """A scripted engine for `--model stand-in`: llama-server's streamed answer in its framing
    (chunked SSE, one chunk per token, the connection closed after the answer), one token each
    `token_ms`, no model behind it: the servers' layers alone, nothing of a model's timing."""

    async def connection(stream: trio.SocketStream) -> None:
        buffered = b""
        async with stream:
            while b"\r\n\r\n" not in buffered:
                if not (data := await stream.receive_some(65536)):
                    return
                buffered += data
            head, _, buffered = buffered.partition(b"\r\n\r\n")
            lines = head.lower().split(b"\r\n")
            length = next(int(line[15:]) for line in lines if line.startswith(b"content-length:"))
            while len(buffered) < length:
                buffered += await stream.receive_some(65536)
            tokens = json.loads(buffered[:length])["max_tokens"]
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                b"Keep-Alive: timeout=5, max=100\r\n\r\n"
            )
            for i in range(tokens):
                await trio.sleep(token_ms / 1000)
                event = (
                    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" word%d"}}],'
                    b'"created":1796047892,"id":"chatcmpl-stand-in","model":"stand-in","system_fingerprint":"b0",'
                    b'"object":"chat.completion.chunk"}\n\n' % i
                )
                await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
            last = b'data: {"choices":[],"timings":{"predicted_n":%d}}\n\ndata: [DONE]\n\n' % tokens
            await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))

    await trio.serve_tcp(connection, port, host="127.0.0.1", backlog=1024)


# --- the client (this process) -----------------------------------------------------------------


class ServerCPU:
    """Each serving process's CPU time, every thread (those that ended too), read from its CPU
    clock to the nanosecond (/proc's figures count 10 ms ticks: a short request's CPU is less)."""

    def __init__(self, pids: dict[str, int]) -> None:
        # Linux's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED): the clock clock_getcpuclockid gives.
        self.clocks = {arm: (~pid << 3) | 2 for arm, pid in pids.items()}

    def now(self, arm: str) -> float:
        clock = self.clocks.get(arm)
        return 0.0 if clock is None else time.clock_gettime(clock)


@attrs.define
class Round:
    """One arm's share of one round: its streams, its wall time, its server's CPU seconds."""

    streams: list[Stream]
    wall: float
    cpu: float

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)


def order(i: int, n: int) -> list[int]:
    """The order the `n` arms go in round i: each goes first in turn."""
    return [(i + k) % n for k in range(n)]


async def rounds(
    urls: dict[str, str], key: str, cpu: ServerCPU, n: int, prompt: str, tokens: int, count: int, warm: int
) -> dict[str, list[Round]]:
    """`count` rounds of `n` streams at once (one connection each) on every arm, in turn, after
    `warm` rounds of short answers (connections open, the prompt cached in the slots, the
    servers' pools filled)."""
    pools = {arm: [Conn(url, key if arm == "direct" else None) for _ in range(n)] for arm, url in urls.items()}
    arms = list(urls)
    body, warm_body = chat_body(prompt, tokens), chat_body(prompt, 2)
    for _ in range(warm):
        for arm in arms:
            for s in await asyncio.gather(*(c.chat(warm_body) for c in pools[arm])):
                checked(s, f"{arm}: warm-up")
    out: dict[str, list[Round]] = {arm: [] for arm in arms}
    for i in range(count):
        for a in order(i, len(arms)):
            arm = arms[a]
            before, started = cpu.now(arm), time.perf_counter()
            streams = await asyncio.gather(*(c.chat(body) for c in pools[arm]))
            wall, spent = time.perf_counter() - started, cpu.now(arm) - before
            out[arm].append(Round([checked(s, arm) for s in streams], wall, spent))
    for pool in pools.values():
        for c in pool:
            c.close()
    return out


def start_server(arm: str, engine: str, key: str | None, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, __file__, "--serve", arm, "--engine", engine, "--port", str(port), *extra]
    env = {**os.environ, "BENCH_ENGINE_KEY": key or ""}
    proc = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{arm} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{arm} did not listen on {port} within 60 s")


@attrs.define
class Results:
    ttft: dict[str, list[Round]]
    long: dict[str, list[Round]]
    conc: dict[str, list[Round]]


def measure(engine: str, key: str, args: argparse.Namespace, logs: Path) -> Results:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls = {"direct": engine}
    try:
        for arm in SERVERS:
            log = logs / f"frontdoor-server-{arm.replace(', ', '-').replace(' ', '-')}.log"
            procs[arm], urls[arm] = start_server(arm, engine, key, log)
        cpu = ServerCPU({arm: p.pid for arm, p in procs.items()})
        began = time.perf_counter()

        def lap(what: str) -> None:
            print(f"{what}: done at {time.perf_counter() - began:.0f} s", file=sys.stderr)

        ttft = asyncio.run(rounds(urls, key, cpu, 1, "hi there", args.ttft_tokens, args.ttft_rounds, 5))
        lap("time to first token")
        long = asyncio.run(
            rounds(urls, key, cpu, 1, "Write a long story about a river.", args.long_tokens, args.long_rounds, 2)
        )
        lap("one stream")
        conc = asyncio.run(
            rounds(urls, key, cpu, args.streams, "Tell me about rivers.", args.conc_tokens, args.conc_rounds, 2)
        )
        lap(f"{args.streams} streams")
        return Results(ttft, long, conc)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
            if p.poll() is None:
                p.kill()


# --- the report --------------------------------------------------------------------------------


def ttfts_ms(rs: list[Round]) -> list[float]:
    return [s.ttft * 1000 for r in rs for s in r.streams if s.ttft is not None]


def per_token_us(rs: list[Round]) -> list[float]:
    return [r.cpu / r.tokens * 1e6 for r in rs if r.tokens]


def spread(values: list[float], unit: str, digits: int = 0) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} {unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio(hyper: float, own: float) -> str:
    return f"{hyper / own:.2f}" if own > 0 else "-"


def report(r: Results, args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    """The tables, and the ratios hypercorn / own that decide."""
    direct = ttfts_ms(r.ttft["direct"])
    ttft = {arm: ttfts_ms(r.ttft[arm]) for arm in ARMS}
    added = {arm: [t - d for t, d in zip(ttft[arm], direct)] for arm in SERVERS}
    conc = {arm: ttfts_ms(r.conc[arm]) for arm in ARMS}
    conc_added_p99 = {arm: percentile(conc[arm], 99) - percentile(conc["direct"], 99) for arm in SERVERS}
    cpu_req = {arm: [x.cpu * 1000 for x in r.ttft[arm]] for arm in SERVERS}
    cpu_long = {arm: per_token_us(r.long[arm]) for arm in SERVERS}
    cpu_conc = {arm: per_token_us(r.conc[arm]) for arm in SERVERS}
    tps_long = {arm: [x.tokens / x.wall for x in r.long[arm]] for arm in ARMS}
    tps_conc = {arm: [x.tokens / x.wall for x in r.conc[arm]] for arm in ARMS}
    n = len(direct)
    head = "| figure | " + " | ".join(ARMS) + " | hypercorn / own |"
    lines = [head, "|---|" + "---:|" * (len(ARMS) + 1)]

    def line(name: str, cells: dict[str, str], decided: str) -> None:
        lines.append(f"| {name} | " + " | ".join(cells.get(arm, "-") for arm in ARMS) + f" | {decided} |")

    p = {q: {arm: percentile(ttft[arm], q) for arm in ARMS} for q in (50, 99)}
    line(
        f"time to first token p50 / p99, one stream ({args.ttft_tokens}-token answers, {n} rounds)",
        {arm: f"{p[50][arm]:.2f} / {p[99][arm]:.2f} ms" for arm in ARMS},
        f"{ratio(p[50]['hypercorn'], p[50]['own'])} / {ratio(p[99]['hypercorn'], p[99]['own'])}",
    )
    a = {q: {arm: percentile(added[arm], q) for arm in SERVERS} for q in (50, 99)}
    line(
        "time added to the first token, paired with the direct request of its round, p50 / p99",
        {arm: f"{a[50][arm]:+.2f} / {a[99][arm]:+.2f} ms" for arm in SERVERS},
        f"{ratio(a[50]['hypercorn'], a[50]['own'])} / {ratio(a[99]['hypercorn'], a[99]['own'])}",
    )
    line(
        "the server's CPU per short request (median, range over rounds)",
        {arm: spread(cpu_req[arm], "ms", 2) for arm in SERVERS},
        ratio(statistics.median(cpu_req["hypercorn"]), statistics.median(cpu_req["own"])),
    )
    line(
        f"one stream of {args.long_tokens} tokens: the server's CPU per streamed token (median, range over "
        f"{len(r.long['own'])} rounds)",
        {arm: spread(cpu_long[arm], "µs") for arm in SERVERS},
        ratio(statistics.median(cpu_long["hypercorn"]), statistics.median(cpu_long["own"])),
    )
    line(
        "one stream: tokens/s (median)",
        {arm: f"{statistics.median(tps_long[arm]):.0f}" for arm in ARMS},
        ratio(statistics.median(tps_long["own"]), statistics.median(tps_long["hypercorn"])) + " (own / hypercorn)",
    )
    pc = {q: {arm: percentile(conc[arm], q) for arm in ARMS} for q in (50, 99)}
    line(
        f"{args.streams} concurrent streams of {args.conc_tokens} tokens ({len(r.conc['own'])} rounds): time to "
        "first token p50 / p99",
        {arm: f"{pc[50][arm]:.1f} / {pc[99][arm]:.1f} ms" for arm in ARMS},
        f"{ratio(pc[50]['hypercorn'], pc[50]['own'])} / {ratio(pc[99]['hypercorn'], pc[99]['own'])}",
    )
    line(
        f"{args.streams} streams: p99 time to first token added (p99 against the direct p99)",
        {arm: f"{conc_added_p99[arm]:+.1f} ms" for arm in SERVERS},
        ratio(conc_added_p99["hypercorn"], conc_added_p99["own"]),
    )
    line(
        f"{args.streams} streams: the server's CPU per streamed token (median, range over rounds)",
        {arm: spread(cpu_conc[arm], "µs") for arm in SERVERS},
        ratio(statistics.median(cpu_conc["hypercorn"]), statistics.median(cpu_conc["own"])),
    )
    line(
        f"{args.streams} streams: aggregate tokens/s (median)",
        {arm: f"{statistics.median(tps_conc[arm]):.0f}" for arm in ARMS},
        ratio(statistics.median(tps_conc["own"]), statistics.median(tps_conc["hypercorn"])) + " (own / hypercorn)",
    )
    decisive = {
        "ttft_added_p99": a[99]["hypercorn"] / a[99]["own"] if a[99]["own"] > 0 else float("nan"),
        "cpu_per_token_one": statistics.median(cpu_long["hypercorn"]) / statistics.median(cpu_long["own"]),
        "cpu_per_token_conc": statistics.median(cpu_conc["hypercorn"]) / statistics.median(cpu_conc["own"]),
        "cpu_per_request": statistics.median(cpu_req["hypercorn"]) / statistics.median(cpu_req["own"]),
    }
    return "\n".join(lines) + "\n", decisive


def verdict(decisive: dict[str, float]) -> str:
    wins = [k for k, v in decisive.items() if k != "cpu_per_request" and v >= CLEAR_WIN]
    figures = ", ".join(f"{k} {v:.2f}" for k, v in decisive.items())
    if wins:
        return f"The own server wins clearly (hypercorn / own >= {CLEAR_WIN:.2f}) on: {', '.join(wins)} ({figures})."
    return (
        f"The own server does NOT win clearly: no decisive ratio hypercorn / own reaches {CLEAR_WIN:.2f} ({figures})."
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        default="gemma",
        help="gemma (Gemma 3 270M, default), tiny (generated), a GGUF path, or stand-in (a scripted engine)",
    )
    ap.add_argument("--token-ms", type=float, default=2.0, help="the stand-in engine's time per token")
    ap.add_argument("--quick", action="store_true", help="the tiny model and few rounds: shows the bench runs")
    ap.add_argument("--ttft-rounds", type=int, default=300)
    ap.add_argument("--ttft-tokens", type=int, default=4)
    ap.add_argument("--long-rounds", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--conc-rounds", type=int, default=6)
    ap.add_argument("--conc-tokens", type=int, default=128)
    ap.add_argument("--slot-ctx", type=int, default=2048, help="tokens of context per slot")
    ap.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    ap.add_argument("--serve", choices=(*SERVERS, "stand-in"), help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve == "stand-in":
        trio.run(stand_in_engine, args.port, args.token_ms)
        return 0
    if args.serve:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # as the daemon logs
        trio.run(serve_arm, args.serve, args.engine, os.environ.get("BENCH_ENGINE_KEY") or None, args.port)
        return 0
    if args.quick:
        args.model = "tiny" if args.model == "gemma" else args.model
        args.ttft_rounds, args.long_rounds, args.long_tokens, args.conc_rounds, args.conc_tokens = 40, 2, 128, 2, 32
    load_before = os.getloadavg()[0]
    logs = Path(tempfile.gettempdir())
    if args.model == "stand-in":
        log = logs / "frontdoor-server-stand-in.log"
        engine, url = start_server("stand-in", "-", None, log, "--token-ms", str(args.token_ms))
        try:
            results = measure(url, "-", args, logs)
        finally:
            engine.terminate()
        what = f"the stand-in engine (llama-server's SSE framing, one token each {args.token_ms:g} ms, no model)"
    else:
        results, what = real_engine(args, logs)
    table, decisive = report(results, args)
    command = f".venv/bin/python tests/bench/frontdoor_server.py {' '.join(sys.argv[1:])}".strip()
    smoke = "**A smoke run (`--quick`): it shows that the bench runs; its figures measure little.**\n\n"
    body = (
        (smoke if args.quick else "")
        + f"`{command}` on {machine()}; {what}. Load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end.\n\n" + METHOD + table + "\n" + verdict(decisive) + "\n"
    )
    print(body)
    if not args.no_write:
        write_section(SECTION + (" (stand-in engine)" if args.model == "stand-in" else ""), body)
    return 0


def real_engine(args: argparse.Namespace, logs: Path) -> tuple[Results, str]:
    """The measure against llama-server serving the model, under a daemon of its own."""
    parallel = max(args.streams, 1)
    with tempfile.TemporaryDirectory(prefix="frontdoor-server-bench-") as tmp:
        home = Path(tmp)
        os.environ["STOKER_HOME"] = str(home)
        paths = StokerPaths.from_env()
        bundle = engine_bundle(paths, args.bundle)
        spec, model = prepare_model(args.model, paths, home)
        d = DaemonProcess(home)
        config = f"[server]\nmodel = {json.dumps(spec)}\nctx_size = {parallel * args.slot_ctx}\nparallel = {parallel}\n"
        if args.model == "gemma":
            config += f"extra_args = {json.dumps(list(WELL_KNOWN[GEMMA].launch_args))}\n"
        write_config(d.paths, config + "[frontdoor]\nenabled = false\n")
        d.start()
        try:
            st = d.wait_state("ready", timeout=600)
            results = measure(st["endpoint"], st["api_key"], args, logs)
        finally:
            d.stop()
    return results, f"engine {bundle.meta.version} ({bundle.meta.backend}); {model.name}, `parallel` {parallel}"


if __name__ == "__main__":
    sys.exit(main())
