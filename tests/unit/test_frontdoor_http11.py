"""The front door's HTTP/1.1 server (daemon/frontdoor/http11.py) over real loopback sockets, with
a small handler: keep-alive across requests with and without a body, a client's next request
sent before the answer to its last one is over, `Expect: 100-continue`, and what a client gets
for a malformed request or a head that never ends."""

from __future__ import annotations

import socket
from typing import AsyncIterator

import httpx
import pytest
import trio
import trio.testing

from stoker.daemon.config.model import Config
from stoker.daemon.frontdoor.http11 import PIPELINED_BYTES, READ_BYTES, ClientGone, Request, open_listeners, serve_http
from stoker.daemon.frontdoor.metrics import FrontDoorMetrics
from tests.unit.test_frontdoor_metrics import Daemon, metrics_for, value


async def echo(request: Request) -> None:
    """Answers with the method, path and body it got (a GET's is not read, as the front door's
    own GET routes do not); /slow streams three pieces."""
    body = b""
    while request.method == "POST" and (piece := await request.receive()):
        body += piece
    if request.path == "/slow":
        await request.start(200, [(b"content-type", b"text/event-stream")])
        for i in range(3):
            await request.send(b"data: %d\n\n" % i)
            await trio.sleep(0.01)  # paced, as an engine's tokens are
        await request.end()
        return
    await request.respond(200, [], f"{request.method} {request.path} {len(body)}".encode())


async def front(nursery, handler) -> tuple[int, FrontDoorMetrics]:
    """The HTTP server on a loopback port with `handler` for every request: (its port, its metrics)."""
    daemon = Daemon(None, None, config=Config())
    metrics: FrontDoorMetrics = metrics_for(daemon)
    listeners = await open_listeners("127.0.0.1", 0)
    await nursery.start(serve_http, listeners, daemon, metrics.requests, handler)
    return listeners[0].getsockname()[1], metrics


@pytest.fixture
async def server(nursery) -> AsyncIterator[int]:
    port, _ = await front(nursery, echo)
    yield port


async def more(stream: trio.SocketStream) -> bytes:
    """The stream's next bytes; a server that closed the connection midway fails the test."""
    data = await stream.receive_some(65536)
    assert data, "the server closed the connection before its answer was whole"
    return data


async def read_answer(stream: trio.SocketStream, buffered: bytearray) -> bytes:
    """One answer (Content-Length or chunked) off the stream, head included."""
    while b"\r\n\r\n" not in buffered:
        buffered += await more(stream)
    end = buffered.index(b"\r\n\r\n") + 4
    head = bytes(buffered[:end]).lower()
    if b"content-length:" in head:
        total = end + int(head.split(b"content-length:")[1].split(b"\r\n")[0])
    else:
        while b"\r\n0\r\n\r\n" not in buffered[end - 2 :]:
            buffered += await more(stream)
        total = buffered.index(b"\r\n0\r\n\r\n", end - 2) + 7
    while len(buffered) < total:
        buffered += await more(stream)
    answer = bytes(buffered[:total])
    del buffered[:total]
    return answer


async def test_one_connection_carries_requests_with_and_without_a_body(server, autojump_clock):
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", server) as client:
            buffered = bytearray()
            for request, expected in (
                (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /v1/models 0"),
                (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /v1/models 0"),
                (b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", b"POST /v1/x 3"),
                (b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", b"data: 2\n\n"),
                (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /v1/models 0"),
            ):
                await client.send_all(request)
                answer = await read_answer(client, buffered)
                assert answer.startswith(b"HTTP/1.1 200 ") and expected in answer, answer


async def test_a_request_sent_before_the_last_answer_is_over_is_answered(server, autojump_clock):
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", server) as client:
            buffered = bytearray()
            await client.send_all(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            while b"data: 0" not in buffered:  # the stream has begun
                buffered += await client.receive_some(65536)
            await client.send_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"data: 2" in await read_answer(client, buffered)
            assert b"GET /v1/models 0" in await read_answer(client, buffered)


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    got = b""
    while data := await stream.receive_some(65536):
        got += data
    return got


async def test_clients_that_close_get_their_framing_and_the_close_heads_get_no_body(server, autojump_clock):
    """The answers' heads are written by the server itself, as h11 wrote them: an HTTP/1.0
    client's stream comes unchunked and ends with the connection; `Connection: close` is
    answered with it and honoured; a HEAD gets the head a GET would, no body, and the connection
    goes on."""
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", server) as client:
            await client.send_all(b"POST /slow HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
            got = await read_to_eof(client)
        head, body = got.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower()
        assert b"connection: close" in head.lower() and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        async with await trio.open_tcp_stream("127.0.0.1", server) as client:
            await client.send_all(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi")
            got = await read_to_eof(client)
        assert got.startswith(b"HTTP/1.1 200 ") and b"connection: close\r\n" in got and got.endswith(b"POST /v1/x 2")
        async with await trio.open_tcp_stream("127.0.0.1", server) as client:
            await client.send_all(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            await client.send_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            buffered = bytearray()
            while buffered.count(b"\r\n\r\n") < 2:
                buffered += await more(client)
            head, rest = bytes(buffered).split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: 17" in head  # "HEAD /v1/models 0", unsent
            assert rest.startswith(b"HTTP/1.1 200 ")
            assert b"GET /v1/models 0" in await read_answer(client, bytearray(rest))


async def test_a_refusal_before_the_body_says_close_once_and_closes(nursery, autojump_clock):
    """An answer given before the request's body was read (a refused key, a body too large) says
    `Connection: close` once, whether the handler said it or not, and the connection closes."""

    async def refuse(request: Request) -> None:
        said = [(b"connection", b"close")] if request.path == "/said" else []
        await request.respond(413, said, b"no")

    port, _ = await front(nursery, refuse)
    for path in (b"/said", b"/unsaid"):
        with trio.fail_after(10):
            async with await trio.open_tcp_stream("127.0.0.1", port) as client:
                await client.send_all(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n" % path)
                got = await read_to_eof(client)
        assert got.startswith(b"HTTP/1.1 413 ") and got.endswith(b"\r\n\r\nno"), got
        assert got.lower().count(b"connection:") == 1 and b"connection: close\r\n" in got, got


async def test_expect_100_continue_is_answered_before_the_body(server):
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", server) as client:
            await client.send_all(
                b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
            )
            got = await client.receive_some(65536)
            assert got.startswith(b"HTTP/1.1 100 "), got
            await client.send_all(b"hi")
            assert b"POST /v1/x 2" in await read_answer(client, bytearray())


async def test_a_malformed_request_gets_400_and_a_head_that_never_ends_431(server):
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", server) as client:
            await client.send_all(b"NOT HTTP AT ALL\r\n\r\n")
            assert (await client.receive_some(65536)).startswith(b"HTTP/1.1 400 ")
        with socket.create_connection(("127.0.0.1", server)) as raw:  # past max_header_bytes (16 KiB)
            raw.sendall(b"GET / HTTP/1.1\r\n" + b"X-Fat: " + b"y" * 20000)
            raw.settimeout(5)
            assert (await trio.to_thread.run_sync(raw.recv, 65536)).startswith(b"HTTP/1.1 431 ")


async def test_an_answer_cut_while_the_client_is_watched_is_counted_as_what_cut_it(nursery):
    """A stream's write to a client that left (the relay's thread raises ClientGone) and an
    engine that cut its answer, both while the client's connection is watched: /metrics says
    client_gone and engine_cut, not error."""

    async def cut(request: Request) -> None:
        async with request.watching():
            await request.start(200, [(b"content-type", b"text/event-stream")], b"data: 0\n\n")
            if request.path == "/v1/chat/completions":
                raise ClientGone("the client's socket broke")
            raise httpx.ReadError("the engine's connection broke")

    port, metrics = await front(nursery, cut)
    for path in (b"/v1/chat/completions", b"/v1/completions"):
        with trio.fail_after(10):
            async with await trio.open_tcp_stream("127.0.0.1", port) as client:
                await client.send_all(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" % path)
                got = b""
                while data := await client.receive_some(65536):  # the first event, then the connection closed
                    got += data
                assert b"data: 0" in got and not got.endswith(b"0\r\n\r\n"), got
    text = (await metrics.scrape()).decode()
    cuts = "stoker_responses_cut_total"
    assert value(text, cuts, route="/v1/chat/completions", reason="client_gone") == 1, text
    assert value(text, cuts, route="/v1/completions", reason="engine_cut") == 1, text
    assert value(text, cuts, route="/v1/chat/completions", reason="error") is None, text


async def post_and_leave(port: int, *, once: trio.Event | None = None) -> None:
    """A client that sends an empty POST and closes its connection (`once`: after that event)."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as client:
        await client.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        if once is not None:
            await once.wait()


async def test_a_client_that_leaves_cancels_the_watched_wait_and_is_counted_gone(nursery):
    """A request waiting under `watching()` (held, or the engine thinking) whose client closes
    its connection: the wait is cancelled at once, the request says `gone`, the handler's code
    after the block still runs, and /metrics counts it with no status (none was sent)."""
    waiting, left = trio.Event(), trio.Event()
    seen: list[bool] = []

    async def held(request: Request) -> None:
        async with request.watching():
            waiting.set()
            await trio.sleep_forever()  # only the client's leaving ends this
        seen.append(request.gone)
        left.set()

    port, metrics = await front(nursery, held)
    with trio.fail_after(10):
        await post_and_leave(port, once=waiting)
        await left.wait()
    assert seen == [True]
    text = (await metrics.scrape()).decode()
    assert value(text, "stoker_requests_total", route="/v1/chat/completions", code="none") == 1, text


async def test_a_client_that_left_before_the_watched_block_began_cancels_it_at_once(nursery):
    """The connection's reader notices a client that leaves while its request is still being
    checked (before `watching()`): the watched block is cancelled as it begins."""
    closed, left = trio.Event(), trio.Event()
    seen: list[bool] = []

    async def slow_check(request: Request) -> None:
        await closed.wait()  # the key check, the body: the client leaves meanwhile
        await trio.testing.wait_all_tasks_blocked()  # its EOF has been read
        async with request.watching():
            await trio.sleep_forever()
        seen.append(request.gone)
        left.set()

    port, _ = await front(nursery, slow_check)
    with trio.fail_after(10):
        await post_and_leave(port)
        closed.set()
        await left.wait()
    assert seen == [True]


async def test_a_client_far_ahead_of_its_answers_is_read_no_further_until_it_is_answered(nursery):
    """While an answer is under way, a client's next requests are read up to `PIPELINED_BYTES`
    and no further (its socket waits in the kernel); once the answer is over, the next request,
    a large body, is read and answered whole."""
    answering = trio.Event()
    buffered_while_answering: list[int] = []

    async def handler(request: Request) -> None:
        if request.path == "/wait":
            async with request.watching():
                answering.set()
                await trio.testing.wait_all_tasks_blocked()  # the client has sent its next, large request
                buffered_while_answering.append(len(request._conn.h11.trailing_data[0]))
        await echo(request)

    port, _ = await front(nursery, handler)
    body = b"x" * (4 * PIPELINED_BYTES)
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            await client.send_all(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
            await answering.wait()
            async with trio.open_nursery() as sending:
                sending.start_soon(
                    client.send_all,
                    b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body),
                )
                buffered = bytearray()
                assert b"GET /wait 0" in await read_answer(client, buffered)
                assert b"POST /big %d" % len(body) in await read_answer(client, buffered)
    assert PIPELINED_BYTES < buffered_while_answering[0] <= PIPELINED_BYTES + READ_BYTES


async def test_an_answer_is_counted_by_the_time_its_client_has_it_whole(nursery, autojump_clock):
    """A client that scrapes /metrics once it has read an answer to its end finds it counted,
    whether streamed or whole, even while the handler has more to do after its last byte."""
    after_the_answer = trio.Event()

    async def answer(request: Request) -> None:
        if request.path == "/v1/chat/completions":
            await request.start(200, [(b"content-type", b"text/event-stream")], b"data: 0\n\n")
            await request.send(b'data: {"timings":{"predicted_n":3}}\n\ndata: [DONE]\n\n')
            await request.end()
        else:
            await request.respond(200, [], b"{}")
        await after_the_answer.wait()  # the handler goes on; the client already has it all

    port, metrics = await front(nursery, answer)
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            buffered = bytearray()
            for path in (b"/v1/chat/completions", b"/v1/models"):
                await client.send_all(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n" % path)
                await read_answer(client, buffered)
                text = (await metrics.scrape()).decode()
                assert value(text, "stoker_requests_total", route=path.decode(), code="200") == 1, text
                after_the_answer.set()
                after_the_answer = trio.Event()
    assert value(text, "stoker_generated_tokens_total", route="/v1/chat/completions") == 3, text


async def test_a_connection_that_fails_outside_its_handler_leaves_the_others_served(nursery, autojump_clock):
    """A fault in the server's own code on one connection ends that connection, logged, and
    nothing else: the next client is answered."""
    daemon = Daemon(None, None, config=Config())
    metrics = metrics_for(daemon)
    figures = metrics.requests
    route_of = figures.route_of

    def failing(path: str) -> str | None:
        if path == "/boom":
            raise RuntimeError("a fault in the server's own code")
        return route_of(path)

    figures.route_of = failing
    listeners = await open_listeners("127.0.0.1", 0)
    await nursery.start(serve_http, listeners, daemon, figures, echo)
    port = listeners[0].getsockname()[1]
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            await client.send_all(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await client.receive_some(65536) == b""  # closed, unanswered
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            await client.send_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await read_answer(client, bytearray())
            assert answer.startswith(b"HTTP/1.1 200 ") and b"GET /v1/models 0" in answer, answer


CHUNKED_HEAD = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"


async def chunked_answers(port: int, coded: bytes, *, apart: bool) -> list[bytes]:
    """The server's answers, until it closes the connection, to a POST of the chunked body `coded`
    followed by a GET that says `Connection: close`. `apart`: the body is sent once the server
    asked for it (`Expect: 100-continue`), so it is read after the head rather than with it."""
    following = b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            buffered = bytearray()
            if apart:
                await client.send_all(CHUNKED_HEAD + b"Expect: 100-continue\r\n\r\n")
                while b"\r\n\r\n" not in buffered:
                    buffered += await client.receive_some(65536)
                assert buffered.startswith(b"HTTP/1.1 100 "), buffered
                del buffered[: buffered.index(b"\r\n\r\n") + 4]
                await client.send_all(coded + following)
            else:
                await client.send_all(CHUNKED_HEAD + b"\r\n" + coded + following)
            while data := await client.receive_some(65536):
                buffered += data
            answers = []
            while buffered:
                answers.append(await read_answer(client, buffered))
            return answers


MALFORMED_SIZES = [b"+5", b"-5", b"0x5", b"5_0", b" 5", b"5 ", b"", "\u0665".encode(), "\uff15".encode(), b"1" * 20]


@pytest.mark.parametrize("apart", [False, True], ids=["with-head", "after-head"])
@pytest.mark.parametrize("size", MALFORMED_SIZES, ids=repr)
async def test_a_chunk_size_that_is_not_hexadecimal_digits_gets_400_and_the_connection_closed(server, size, apart):
    answers = await chunked_answers(server, size + b"\r\nhello\r\n0\r\n\r\n", apart=apart)
    assert answers[0].startswith(b"HTTP/1.1 400 ") and b"hexadecimal digits" in answers[0], answers
    assert len(answers) == 1  # then closed: nothing after the bad size is read as a request


@pytest.mark.parametrize("apart", [False, True], ids=["with-head", "after-head"])
@pytest.mark.parametrize(("size", "length"), [(b"a", 10), (b"A", 10), (b"0", 0), (b"5;ext=1", 5)], ids=repr)
async def test_a_hexadecimal_chunk_size_with_or_without_extensions_is_read(server, size, length, apart):
    coded = size + b"\r\n" + (b"x" * length + b"\r\n0\r\n" if length else b"") + b"\r\n"
    answer, following = await chunked_answers(server, coded, apart=apart)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"POST /v1/x %d" % length), answer
    assert following.endswith(b"GET /next 0")  # the connection carried the next request


async def test_an_ipv4_loopback_client_of_a_dual_stack_socket_is_judged_loopback(nursery):
    """Bound on `::` (every interface, both families), a client of 127.0.0.1 arrives as
    ::ffff:127.0.0.1: it is on loopback (a keyless local client passes as on 127.0.0.1)."""
    seen: list[tuple[str, bool]] = []

    async def who(request: Request) -> None:
        assert request.client is not None
        seen.append((request.client[0], request.loopback))
        await request.respond(200, [], b"ok")

    try:
        listeners = await open_listeners("::", 0)
    except OSError:
        pytest.skip("no IPv6 on this machine")
    daemon = Daemon(None, None, config=Config())
    await nursery.start(serve_http, listeners, daemon, metrics_for(daemon).requests, who)
    port = listeners[0].getsockname()[1]
    with trio.fail_after(10):
        for host in ("127.0.0.1", "::1"):
            async with await trio.open_tcp_stream(host, port) as client:
                await client.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await read_answer(client, bytearray())).startswith(b"HTTP/1.1 200 ")
    assert seen == [("::ffff:127.0.0.1", True), ("::1", True)]
