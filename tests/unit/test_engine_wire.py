"""The front door's engine connections (daemon/engine/wire.py), against a small loopback server
that speaks raw HTTP/1.1 bytes the way llama-server does: what a client of the front door would
notice is whether each request gets its answer, whole, and what kind of failure it gets when
the engine is not there, cuts an answer, or says nothing."""

from __future__ import annotations

import contextlib
import socket
from functools import partial
from typing import Awaitable, Callable

import httpx
import pytest
import trio
import trio.testing

from stoker.daemon.config.model import Config
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.wire import EngineWire, WireTimeouts
from stoker.daemon.frontdoor.relay import first_bytes, relay
from stoker.daemon.frontdoor.http11 import Request, open_listeners, serve_http
from tests.unit.test_frontdoor_metrics import Daemon, metrics_for
from tests.waits import until

SSE = b"data: {}\n\n"


async def read_request(stream: trio.SocketStream, buffered: bytearray) -> bytes | None:
    """One request's head and body (Content-Length framed), or None at EOF."""
    while b"\r\n\r\n" not in buffered:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffered += data
    end = buffered.index(b"\r\n\r\n") + 4
    head = bytes(buffered[:end])
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(buffered) < end + length:
        buffered += await stream.receive_some(65536)
    request = bytes(buffered[: end + length])
    del buffered[: end + length]
    return request


Handler = Callable[[trio.SocketStream, bytes], Awaitable[bool]]  # False: close the connection


async def serve(nursery: trio.Nursery, handler: Handler, seen: list[bytes]) -> str:
    async def connection(stream: trio.SocketStream) -> None:
        buffered = bytearray()
        async with stream:
            while (request := await read_request(stream, buffered)) is not None:
                seen.append(request)
                if not await handler(stream, request):
                    return

    listeners = await nursery.start(partial(trio.serve_tcp, connection, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def llama_like(stream: trio.SocketStream, request: bytes) -> bool:
    """A JSON answer kept alive; a streamed one (SSE, chunked) closed after it, as llama-server does."""
    if b'"stream": true' in request:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Keep-Alive: timeout=5, max=100\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(SSE), SSE) for _ in range(3))
        )
        await stream.send_all(b"0\r\n\r\n")
        return False
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    return True


async def relaying_front(nursery, client: EngineClient, daemon, metrics, seen=None) -> int:
    """The front door's HTTP server on a loopback port, relaying every request's streamed answer
    from `client`'s engine as the front door does (`seen` gets each answer's decoded headers):
    its port."""

    async def relayed(request: Request) -> None:
        async with client.forward("POST", "/x", content=b"{}", streamed=True) as answer:
            first, chunks = await first_bytes(answer, True)
            await relay(request, answer, True, first, chunks)
            if seen is not None:
                seen(answer.headers)

    listeners = await open_listeners("127.0.0.1", 0)
    await nursery.start(serve_http, listeners, daemon, metrics.requests, relayed)
    return listeners[0].getsockname()[1]


async def chat_through(port: int, first_seen: trio.Event | None = None) -> bytes:
    """A chat request to the front door on `port`, and its whole chunked answer as it came;
    `first_seen` is set once the engine's first event has come through."""
    got = b""
    with trio.fail_after(5):
        async with await trio.open_tcp_stream("127.0.0.1", port) as front:
            await front.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            while not got.endswith(b"\r\n0\r\n\r\n"):
                got += await front.receive_some(65536)
                if first_seen is not None and SSE in got:
                    first_seen.set()
    return got


async def ask(client: EngineClient, body: bytes, streamed: bool) -> tuple[int, bytes]:
    async with client.forward("POST", "/v1/chat/completions", content=body, streamed=streamed) as answer:
        return answer.status_code, b"".join([chunk async for chunk in answer.aiter_raw()])


async def test_answers_come_whole_streamed_ones_alone_on_their_connection(nursery):
    seen: list[bytes] = []
    url = await serve(nursery, llama_like, seen)
    async with EngineWire() as wire:
        client = EngineClient(url, "k", httpx.AsyncClient(), wire=wire)
        for _ in range(3):
            assert await ask(client, b'{"stream": false}', False) == (200, b"{}")
            assert await ask(client, b'{"stream": true}', True) == (200, SSE * 3)
    assert len(seen) == 6
    assert all(b"authorization: Bearer k" in r and r.endswith(b"}") for r in seen)  # head and body, the key
    assert [b"connection: close" in r for r in seen] == [False, True] * 3


async def test_a_kept_connection_the_engine_closed_is_not_used_again(nursery):
    async def one_answer_per_connection(stream: trio.SocketStream, request: bytes) -> bool:
        await llama_like(stream, request)
        return False  # closes though its answer said nothing of it

    url = await serve(nursery, one_answer_per_connection, [])
    async with EngineWire() as wire:
        client = EngineClient(url, None, httpx.AsyncClient(), wire=wire)
        for _ in range(5):
            assert await ask(client, b"{}", False) == (200, b"{}")
            await trio.testing.wait_all_tasks_blocked()  # the engine's FIN has arrived before the next request


async def test_a_whole_stream_leaves_a_connection_ready_for_the_next_request_closed_before_a_stop(nursery):
    """llama-server closes a connection after each streamed answer: the wire opens the next one
    as the answer ends, so the next request's connect (and the engine's accept) are behind it;
    a cut stream leaves none; `forget` (before the engine is stopped) closes it."""
    requests_on: list[int] = []  # for each request, the number of the connection it came on
    connections: list[trio.Event] = []  # one per accepted connection, set when the wire closed it

    async def connection(stream: trio.SocketStream) -> None:
        number, closed = len(connections), trio.Event()
        connections.append(closed)
        buffered = bytearray()
        async with stream:
            while (request := await read_request(stream, buffered)) is not None:
                requests_on.append(number)
                if b"cut" in request:
                    await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    return
                if not await llama_like(stream, request):
                    return
            closed.set()

    listeners = await nursery.start(partial(trio.serve_tcp, connection, 0, host="127.0.0.1"))
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    async with EngineWire() as wire:
        client = EngineClient(url, None, httpx.AsyncClient(), wire=wire)
        assert await ask(client, b'{"stream": true}', True) == (200, SSE * 3)
        await trio.testing.wait_all_tasks_blocked()
        assert len(connections) == 2  # the spare, accepted before any request needed it
        assert await ask(client, b'{"stream": true}', True) == (200, SSE * 3)
        assert await ask(client, b'{"stream": false}', False) == (200, b"{}")  # any request takes it
        assert requests_on == [0, 1, 2]
        await trio.testing.wait_all_tasks_blocked()
        wire.forget(url)  # the kept-alive connection 2 goes, as a spare would
        with trio.fail_after(5):
            await connections[2].wait()
        async with client.forward("POST", "/v1/chat/completions", content=b'"stream": true, cut', streamed=True) as a:
            with pytest.raises(httpx.RemoteProtocolError):
                [chunk async for chunk in a.aiter_raw()]
        await trio.testing.wait_all_tasks_blocked()  # a spare, had one been opened, is accepted by now
        assert len(connections) == 4 and requests_on == [0, 1, 2, 3]  # no spare after a cut stream


async def test_failures_are_the_transport_errors_the_front_door_handles(nursery, autojump_clock):
    async def cut(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(SSE), SSE))
        return False  # closed midway

    async def silent(stream: trio.SocketStream, request: bytes) -> bool:
        await trio.sleep_forever()
        return False

    with trio.socket.socket() as unused:
        await unused.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{unused.getsockname()[1]}"  # bound, not listening
        async with EngineWire() as wire:
            with pytest.raises(httpx.ConnectError):
                await ask(EngineClient(refused, None, httpx.AsyncClient(), wire=wire), b"{}", True)
    cut_url = await serve(nursery, cut, [])
    silent_url = await serve(nursery, silent, [])
    async with EngineWire(WireTimeouts(read=0.5)) as wire:
        async with EngineClient(cut_url, None, httpx.AsyncClient(), wire=wire).forward(
            "POST", "/x", content=b"{}"
        ) as answer:
            chunks = answer.aiter_raw()
            assert await anext(chunks) == SSE  # what came before the cut is handed on
            with pytest.raises(httpx.RemoteProtocolError):
                await anext(chunks)
        with trio.fail_after(5), pytest.raises(httpx.ReadTimeout):
            await ask(EngineClient(silent_url, None, httpx.AsyncClient(), wire=wire), b"{}", True)


def received(sock: socket.socket) -> bytes:
    """What waits in a socket now (the peer of a relay's sink)."""
    got = b""
    with contextlib.suppress(BlockingIOError):
        while data := sock.recv(65536):
            got += data
    return got


async def test_a_stream_pumped_by_the_relay_loop_ends_whole_cut_silent_or_interrupted(nursery):
    """`pump_to` (the front door's relay of a stream's rest, in the relay loop's thread) goes on
    where `aiter_raw` stopped: each event shaped and written to the sink as it arrives, the last
    read returned; a cut and a silence raise what `aiter_raw` raises; an interrupt (the client
    left) ends it at once and shuts the engine's connection."""

    async def paced(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(4):
            event = b"data: %d\n\n" % i
            await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
            await trio.sleep(0.02)  # paced, as an engine's tokens are (real time: the loop reads in a thread)
        tail = request.split(b"\r\n\r\n", 1)[1]
        if tail == b"cut":
            return False  # closed midway
        if tail == b"silent":
            await trio.sleep_forever()
        await stream.send_all(b"0\r\n\r\n")
        return False

    url = await serve(nursery, paced, [])

    async def pumped(body: bytes, interrupt_after: float | None = None) -> tuple[bytes, bytes, bytes]:
        """The first piece, what the loop wrote to the sink (shaped: upper case), the last piece."""
        sink, peer = socket.socketpair()
        sink.setblocking(False)
        peer.setblocking(False)
        with sink, peer:
            async with EngineClient(url, None, httpx.AsyncClient(), wire=wire).forward(
                "POST", "/x", content=body, streamed=True
            ) as answer:
                chunks = answer.aiter_raw()
                first = await anext(chunks)
                await chunks.aclose()
                assert answer.pumpable()
                last = b""
                with trio.move_on_after(interrupt_after if interrupt_after is not None else 5) as scope:
                    last = await answer.pump_to(bytes.upper, sink)
                assert scope.cancelled_caught == (interrupt_after is not None)
                assert answer.interrupted == (interrupt_after is not None)
            return first, received(peer), last

    async with EngineWire(WireTimeouts(read=0.5)) as wire:
        async with EngineClient(url, None, httpx.AsyncClient(), wire=wire).forward(
            "POST", "/x", content=b"whole", streamed=True
        ) as answer:
            assert not answer.pumpable()  # nothing decoded yet: `aiter_raw` begins it
            assert [piece async for piece in answer.aiter_raw()]
            assert not answer.pumpable()  # read to its end: nothing left to pump
        with trio.fail_after(5):
            first, written, last = await pumped(b"whole")
            assert first + written.lower() + last == b"".join(b"data: %d\n\n" % i for i in range(4))
            assert written.startswith(b"DATA: ")  # shaped on its way
            with pytest.raises(httpx.RemoteProtocolError):
                await pumped(b"cut")
            with pytest.raises(httpx.ReadTimeout):
                await pumped(b"silent")
            # Several at once, in the one loop: each whole, none mixed into another's sink.
            async with trio.open_nursery() as several:
                results: list[tuple[bytes, bytes, bytes]] = []

                async def one() -> None:
                    results.append(await pumped(b"whole"))

                for _ in range(8):
                    several.start_soon(one)
            assert len(results) == 8
            for first, written, last in results:
                assert first + written.lower() + last == b"".join(b"data: %d\n\n" % i for i in range(4))
    # A read timeout far from the interrupt, so that a loaded machine cannot blur the two.
    async with EngineWire(WireTimeouts(read=5.0)) as wire:
        with trio.fail_after(10):
            began = trio.current_time()
            first, written, last = await pumped(b"silent", interrupt_after=0.2)
            assert (first + written).count(b"data: ") + written.count(b"DATA: ") == 4  # every event before it
            assert last == b""
            assert trio.current_time() - began < 2.5  # not the read timeout: the interrupt woke it


async def test_a_client_that_stops_reading_holds_only_its_own_stream_and_one_that_leaves_ends_it(nursery):
    """The relay loop writes without blocking: a sink whose window is full holds its stream
    (the engine's socket is not read meanwhile) while another stream goes on, gets all of it
    once it reads again, and a sink whose peer left ends the pump with `SinkGone`."""
    from stoker.daemon.core.relay_loop import SinkGone

    big = b"x" * 60_000

    async def flood(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        count = 40 if request.endswith(b"big") else 4
        for i in range(count):
            event = (big if request.endswith(b"big") else b"") + b"data: %d\n\n" % i
            await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
            await trio.sleep(0.01)
        await stream.send_all(b"0\r\n\r\n")
        return False

    url = await serve(nursery, flood, [])

    async def start(wire: EngineWire, body: bytes, sink: socket.socket, got: list[object]) -> None:
        async with EngineClient(url, None, httpx.AsyncClient(), wire=wire).forward(
            "POST", "/x", content=body, streamed=True
        ) as answer:
            chunks = answer.aiter_raw()
            got.append(await anext(chunks))
            await chunks.aclose()
            try:
                got.append(await answer.pump_to(lambda data: data, sink))
            except SinkGone as exc:
                got.append(exc)

    async with EngineWire(WireTimeouts(read=5.0)) as wire:
        slow_sink, slow_peer = socket.socketpair()
        fast_sink, fast_peer = socket.socketpair()
        for sock in (slow_sink, slow_peer, fast_sink, fast_peer):
            sock.setblocking(False)
        slow_sink.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with slow_sink, slow_peer, fast_sink, fast_peer, trio.fail_after(20):
            slow: list[object] = []
            fast: list[object] = []
            async with trio.open_nursery() as both:
                both.start_soon(start, wire, b"big", slow_sink, slow)
                both.start_soon(start, wire, b"small", fast_sink, fast)
                # The other stream ends while the slow one's client reads nothing.
                await until(lambda: len(fast) == 2, timeout=10, what="the other stream's end")
                assert len(slow) == 1
                held = b""
                while len(slow) < 2:  # now the slow client reads: its stream goes on to its end
                    with trio.move_on_after(0.5):  # its pump may end while this waits
                        await trio.lowlevel.wait_readable(slow_peer)
                    held += received(slow_peer)
                held += received(slow_peer)
            assert isinstance(slow[1], bytes) and isinstance(fast[1], bytes)
            whole = slow[0] + held + slow[1]  # type: ignore[operator]
            assert whole == b"".join(big + b"data: %d\n\n" % i for i in range(40))
            assert fast[0] + received(fast_peer) + fast[1] == b"".join(b"data: %d\n\n" % i for i in range(4))

        gone_sink, gone_peer = socket.socketpair()
        gone_sink.setblocking(False)
        gone_peer.close()
        with gone_sink, trio.fail_after(10):
            gone: list[object] = []
            await start(wire, b"small", gone_sink, gone)
            assert isinstance(gone[1], SinkGone)


@pytest.mark.parametrize("size", [b"+5", b"0x5", b"5_0", b" 5", b"5 ", "\u0665".encode(), b"1" * 20], ids=repr)
async def test_an_engine_chunk_size_that_is_not_hexadecimal_ends_the_relay_with_an_error(nursery, size):
    """Whether the bad size comes first (the front door has relayed nothing: the wire raises the
    engine's protocol error, which names it) or midway (the client's stream ends with the
    `engine_stream_cut` event that names it, through the relay's worker thread)."""
    relayed_first = trio.Event()  # the client has the first event: the rest is the relay's to pump

    async def bad_size(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        if b"midway" in request:
            await stream.send_all(b"%x\r\n%s\r\n" % (len(SSE), SSE))
            await relayed_first.wait()
        await stream.send_all(size + b"\r\nhello\r\n0\r\n\r\n")
        return False

    url = await serve(nursery, bad_size, [])
    async with EngineWire() as wire:
        engine = EngineClient(url, None, httpx.AsyncClient(), wire=wire)
        with trio.fail_after(5), pytest.raises(httpx.RemoteProtocolError, match="chunk size") as raised:
            await ask(engine, b'{"stream": true}', True)
        assert repr(size[:10])[2:-1] in str(raised.value)

        async def relayed(request: Request) -> None:
            async with engine.forward("POST", "/x", content=b"midway", streamed=True) as answer:
                first, chunks = await first_bytes(answer, True)
                await relay(request, answer, True, first, chunks)

        listeners = await open_listeners("127.0.0.1", 0)
        await nursery.start(
            serve_http,
            listeners,
            Daemon(None, None, config=Config()),
            metrics_for(Daemon(None, None)).requests,
            relayed,
        )
        got = await chat_through(listeners[0].getsockname()[1], relayed_first)
    assert got.startswith(b"HTTP/1.1 200 ") and SSE in got
    assert b"engine_stream_cut" in got and b"chunk size" in got, got


async def test_a_relayed_answer_keeps_the_engines_content_type_and_cache_control_only(nursery):
    """The relay passes on the engine's Content-Type and Cache-Control as the engine wrote them
    (read from the parsed head, not decoded and encoded back), and none of its other headers;
    the answer's decoded `headers` still has them all for a caller that asks."""
    decoded: list[dict[str, str]] = []

    async def engine(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nCache-Control: no-cache\r\n"
            b"X-Engine-Own: slot 3\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(SSE), SSE)
        )
        return False

    url = await serve(nursery, engine, [])
    async with EngineWire() as wire:
        client = EngineClient(url, "k", httpx.AsyncClient(), wire=wire)

        daemon = Daemon(None, None, config=Config())
        port = await relaying_front(nursery, client, daemon, metrics_for(daemon), decoded.append)
        got = await chat_through(port)
    head = got.split(b"\r\n\r\n")[0].lower()
    assert b"content-type: text/event-stream; charset=utf-8" in head and b"cache-control: no-cache" in head
    assert b"x-engine-own" not in head and SSE in got
    assert decoded == [
        {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-engine-own": "slot 3",
            "transfer-encoding": "chunked",
        }
    ]


async def test_a_client_that_stops_reading_at_done_finds_the_pumped_stream_counted(nursery):
    """The openai SDK stops reading a stream at its `data: [DONE]`, before the chunked body's end:
    a scrape of /metrics right then must already count the answer and its tokens. The pump leaves
    the answer's last piece to trio's thread, which writes it with the body's end, counted as it
    leaves (before, the pump wrote `[DONE]` and the count came after its thread returned)."""
    from prometheus_client import generate_latest

    async def engine(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        await stream.send_all(b"%x\r\n%s\r\n" % (len(SSE), SSE))
        await trio.sleep(0.05)  # the rest comes once the relay pumps it in a worker thread
        tail = b'data: {"timings":{"predicted_n":3}}\n\ndata: [DONE]\n\n'
        await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
        return False

    url = await serve(nursery, engine, [])
    daemon = Daemon(None, None, config=Config())
    metrics = metrics_for(daemon)
    async with EngineWire() as wire:
        client = EngineClient(url, "k", httpx.AsyncClient(), wire=wire)

        port = await relaying_front(nursery, client, daemon, metrics)
        for _ in range(5):
            got = b""
            with trio.fail_after(5):
                async with await trio.open_tcp_stream("127.0.0.1", port) as front:
                    await front.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                    while b"[DONE]" not in got:
                        got += await front.receive_some(65536)
                    text = generate_latest(metrics.registry).decode()  # at once, with no await between
            assert 'stoker_requests_total{code="200",route="/v1/chat/completions"}' in text, text
            assert 'stoker_generated_tokens_total{route="/v1/chat/completions"}' in text, text


async def test_answers_framed_by_length_by_close_or_after_an_interim_answer_come_whole(nursery):
    """The wire reads an answer's head itself: a Content-Length body that arrives in pieces (the
    connection kept for the next request), a body that ends when the engine closes (never
    kept), an empty 204, and a `100 Continue` before the real answer, headers as the engine wrote
    them (names in lower case)."""

    connections: list[object] = []  # for each request, the connection it came on (its client's port)

    async def framed(stream: trio.SocketStream, request: bytes) -> bool:
        connections.append(stream.socket.getpeername())
        tail = request.split(b"\r\n\r\n", 1)[1]
        if tail == b"pieces":
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nX-Slot:  3 \r\n\r\n01234")
            await trio.sleep(0.01)
            await stream.send_all(b"56789")
            return True
        if tail == b"to-close":
            await stream.send_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
            return False
        if tail == b"empty":
            await stream.send_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            return True
        await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 \r\ncontent-length: 2\r\n\r\nok")
        return True

    url = await serve(nursery, framed, [])
    async with EngineWire() as wire:
        client = EngineClient(url, None, httpx.AsyncClient(), wire=wire)
        with trio.fail_after(5):
            async with client.forward("POST", "/x", content=b"pieces") as answer:
                assert answer.raw_headers == [(b"content-length", b"10"), (b"x-slot", b"3")]
                assert b"".join([piece async for piece in answer.aiter_raw()]) == b"0123456789"
            assert await ask(client, b"to-close", False) == (200, b"all of it")
            assert await ask(client, b"empty", False) == (204, b"")
            assert await ask(client, b"interim", False) == (201, b"ok")
            assert await ask(client, b"pieces", False) == (200, b"0123456789")
    # Each connection kept for the next request, but the one whose body ended with its close.
    first, second = connections[0], connections[2]
    assert connections == [first, first, second, second, second] and first != second


@pytest.mark.parametrize(
    "answer",
    [
        b"",  # closed without a word
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n",  # closed within the head
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Type : text/plain\r\n\r\n",  # a blank before the colon
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\n\r\n",  # obsolete line folding
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234",  # cut within its body
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * 70_000,  # a head that never ends
    ],
    ids=repr,
)
async def test_a_malformed_or_cut_answer_is_the_engines_protocol_error_never_a_hang(nursery, answer):
    """What the front door answers with its reason codes (a 502 `engine_unreachable` before the
    first byte, the `engine_stream_cut` event midway): a protocol error, at once."""

    async def engine(stream: trio.SocketStream, request: bytes) -> bool:
        await stream.send_all(answer)
        return False

    url = await serve(nursery, engine, [])
    async with EngineWire() as wire:
        with trio.fail_after(5), pytest.raises(httpx.RemoteProtocolError):
            await ask(EngineClient(url, None, httpx.AsyncClient(), wire=wire), b"{}", False)


async def test_a_request_whose_target_or_header_would_break_its_head_is_not_sent(nursery):
    seen: list[bytes] = []
    url = await serve(nursery, llama_like, seen)
    async with EngineWire() as wire:
        client = EngineClient(url, None, httpx.AsyncClient(), wire=wire)
        for target, headers in [("/x HTTP/1.1\r\nX-Evil: 1", {}), ("/x", {"X-Key": "a\r\nX-Evil: 1"})]:
            with trio.fail_after(5), pytest.raises(httpx.LocalProtocolError):
                async with client.forward("POST", target, content=b"{}", headers=headers):
                    pass
        assert await ask(client, b"{}", False) == (200, b"{}")
    assert len(seen) == 1 and b"evil" not in seen[0].lower()
