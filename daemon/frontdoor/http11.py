"""The front door's HTTP/1.1 server on trio sockets: h11 parses what clients send (untrusted
input, read strictly), the answers' heads are written here (values the front door built), and
nothing else stands between a client's socket and the relay loop but the request figures.

Why not Hypercorn and Starlette, which served the first slice: measured on the 2-core test
machine, Hypercorn's trio worker spends ~90 µs of CPU per SSE event it sends (a lock, a shielded
scope and two scheduler passes per event, under four layers of calls) and Starlette ~1.7 ms per
request with its middleware and a task group per streamed response; this server, the same h11
underneath, ~27 µs per event and ~0.55 ms per request (docs/frontdoor.md, "Design"). On a machine
whose engine generates thousands of tokens a second, that CPU is taken from the engine.

What it keeps of Hypercorn's behaviour, read from `[frontdoor]` at each connection (so a reload
applies to the next one): a connection with no request under way, kept alive or still sending
its request line and headers, is closed `idle_timeout_s` after it opened or its last answer
ended; h11 buffers at most `max_header_bytes` of an incomplete head (past it: a bare 431 and the
connection closed); a malformed request gets a bare 400. A chunked body whose coding is
malformed (a chunk size that is not hexadecimal digits: daemon/core/chunked.py) raises
`MalformedBody` where the handler reads the body (the app answers it in the API's shape,
daemon/frontdoor/limits.py); a handler that lets it through gets a plain 400 that says why; the
connection is closed either way. `Expect: 100-continue` is answered when the body is first read.
The handler reads the body (`receive`) and answers (`respond`, or
`start`/`send`/`end` for a body relayed as it arrives: chunked, one `send_all` per piece);
`watching()` cancels what it wraps when the client leaves, so the engine under a request nobody
waits for any more is closed: one reader per connection (`Connection._read_all`) reads the
client's socket for the connection's life, feeds h11, and notices the client's EOF, so a
request costs no task of its own. Every request but a scrape of /metrics is counted as it goes
by (`Exchange`: O(1) per piece sent). What each of these saves per request: docs/frontdoor.md,
"The fixed work per request".
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from types import TracebackType
from typing import Awaitable, Callable

import h11
import trio

from stoker.daemon.config.remote import is_loopback_host
from stoker.daemon.core.chunked import Dechunker, MalformedChunk
from stoker.daemon.core.http_heads import HeadLineBreak, head_bytes, says_close
from stoker.daemon.core.relay_socket import RelaySocket, accept_errors_to_retry
from stoker.daemon.frontdoor.access import log_access
from stoker.daemon.frontdoor.metrics import Exchange, RequestFigures
from stoker.daemon.frontdoor.daemon_view import Caller, FrontDoorDaemon

log = logging.getLogger("stoker.frontdoor")

READ_BYTES = 64 * 1024
# While an answer is under way, what a client sends (its next, pipelined request) is kept up to
# this much; past it the client is not read until the answer is over.
PIPELINED_BYTES = 64 * 1024
# Connections that may wait to be accepted: 1000 clients connecting at once are not dropped
# (the kernel caps it at net.core.somaxconn).
BACKLOG = 1024


class ClientGone(Exception):
    """The client closed its connection before its answer was over."""


class MalformedBody(Exception):
    """The client's body breaks HTTP/1.1's framing: answered 400, the connection closed."""


def framed(data: bytes, chunked: bool) -> bytes:
    """One piece of an answer's body as it goes on the wire: a chunk, or as it is to an HTTP/1.0
    client (which knows no chunks)."""
    return b"%x\r\n%b\r\n" % (len(data), data) if chunked else data


def response_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """An answer's status line and headers as they go on the wire, as h11 wrote them (no reason
    phrase). The values are the front door's own (or a client's header echoed, already parsed by
    h11, or the engine's, read strictly): a line break in one raises `h11.LocalProtocolError`
    rather than end the head early."""
    try:
        return head_bytes(b"HTTP/1.1 %d " % status, headers)
    except HeadLineBreak as exc:
        raise h11.LocalProtocolError("an answer's header cannot carry a line break") from exc


class Request:
    """One request on a connection: its head, its body to read, and its answer to give."""

    __slots__ = (
        "method",
        "path",
        "target",
        "headers",
        "client",
        "exchange",
        "caller",
        "model",
        "instance",
        "added_headers",
        "_conn",
        "_started",
        "_ended",
        "_chunked",
        "_bodyless",
        "keep_alive",
        "gone",
        "settled",
    )

    def __init__(self, conn: Connection, event: h11.Request) -> None:
        self._conn = conn
        self.method = event.method.decode("ascii")
        self.target = event.target
        path = event.target.partition(b"?")[0]
        self.path = path.decode("latin-1")
        self.headers: list[tuple[bytes, bytes]] = list(event.headers)
        self.client = conn.client
        self.exchange: Exchange | None = None
        # For the access log (daemon/frontdoor/access.py), as the app learns them: who passed
        # the key check, the model the body asked for, the configured model that answered.
        self.caller: Caller | None = None
        self.model: object = None
        self.instance: str | None = None
        # Headers every answer to it carries, whoever gives it (the Access-Control-* of CORS).
        self.added_headers: list[tuple[bytes, bytes]] = []
        self._started = False
        self._ended = False  # the answer was written whole
        # To an HTTP/1.0 client, which knows no chunks, a body goes as it is, ended by the close.
        self._chunked = event.http_version >= b"1.1"
        self._bodyless = self.method == "HEAD"  # its answer is the head a GET would get
        # The connection carries the client's next request after this one's answer (HTTP/1.1,
        # no `Connection: close` from either side), as h11 judges it.
        self.keep_alive = self._chunked and not says_close(self.headers)
        self.gone = False
        self.settled = False  # counted and logged (`Connection.settle`)

    def header(self, name: bytes) -> bytes | None:
        """A header's value (the first, if repeated); `name` in lower case."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def answered(self) -> bool:
        """An answer's head was sent (nothing else can be)."""
        return self._started

    async def receive(self) -> bytes:
        """The body's next piece as it arrives; b"" once it is whole."""
        return await self._conn.receive_body()

    def receive_now(self) -> bytes | None:
        """The body's next piece if it has already arrived (b"" once it is whole), else None:
        a small body comes with its head, and needs no wait (nor a timeout)."""
        return self._conn.body_received()

    @property
    def loopback(self) -> bool:
        """The client connected from a loopback address."""
        return self._conn.loopback

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The answer's head, written here (not by h11: its event objects and validation cost as
        much as parsing the request did): `Connection: close` added when the connection will not
        carry another request, and remembered when the handler's headers say it."""
        if self._started:
            raise h11.LocalProtocolError("the answer to this request has already begun")
        self._started = True
        if not self.keep_alive:
            if not says_close(headers):
                headers.append((b"connection", b"close"))
        elif says_close(headers):
            self.keep_alive = False
        return response_head(status, headers)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer at once (errors, /metrics, the model list)."""
        headers = [*headers, *self.added_headers, (b"content-length", b"%d" % len(body))]
        if self.keep_alive and not says_close(headers) and not self._conn.request_ended():
            # Answered before its body was read (a refusal): the connection cannot carry the client's
            # next request, and says so, rather than closing under a client that would reuse it.
            headers.append((b"connection", b"close"))
        data = self._head(status, headers)
        if self.exchange is not None:
            self.exchange.status_sent(status)
            self.exchange.body_sent(body)
            self.exchange.body_complete()
        self._ended = True
        await self._conn.send_all(data if self._bodyless else data + body, self._settled)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        """The head of an answer whose body follows in pieces (`send`, then `end`): chunked to an
        HTTP/1.1 client; to an HTTP/1.0 one, which knows no chunks, the body as it is, ended by
        closing the connection (no Transfer-Encoding, `Connection: close`). `first`, the body's
        first piece, leaves in the same write as the head (one wake-up of the client, not two,
        before its first token)."""
        headers = [*headers, *self.added_headers]
        if self._chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        head = self._head(status, headers)
        if self.exchange is not None:
            self.exchange.status_sent(status)
        if not first or self._bodyless:
            await self._conn.send_all(head)
            return
        if self.exchange is not None:
            self.exchange.body_sent(first)
        await self._conn.send_all(head + framed(first, self._chunked))

    async def send(self, data: bytes) -> None:
        """One piece of the body, in one write (as one chunk, but to an HTTP/1.0 client). The
        framing is written here rather than by h11 (whose chunked writer keeps no state between
        pieces), which saves a call layer per SSE event."""
        if data and not self._bodyless:
            if self.exchange is not None:
                self.exchange.body_sent(data)
            await self._conn.send_all(framed(data, self._chunked))

    def pumpable(self) -> bool:
        """`sink` can take this answer's body (a plain socket)."""
        return self._started and not self._bodyless and isinstance(self._conn.stream, RelaySocket)

    def sink(self) -> tuple[socket.socket, Callable[[bytes], bytes]]:
        """For a relay loop (daemon/core/relay_loop.py) that writes the body from its own thread:
        the client's non-blocking socket, and what makes one piece the bytes `send` would write
        (framed as `send` frames it, counted; b"" for an empty piece, which would end the body)."""
        chunked, exchange = self._chunked, self.exchange

        def frame(data: bytes) -> bytes:
            if not data:
                return b""
            if exchange is not None:
                exchange.body_sent(data)
            return framed(data, chunked)

        return self._conn.stream.sock, frame

    async def end(self, last: bytes = b"") -> None:
        """The body is whole: `last`, its last piece, and its end leave in one write, counted as
        they leave (`_settled`), so that a client that stops reading at its last event (a stream's
        `[DONE]`, Ollama's `done` line) finds the answer counted."""
        if self.exchange is not None:
            if last:
                self.exchange.body_sent(last)
            self.exchange.body_complete()
        if not self._started or self._ended:
            raise h11.LocalProtocolError("no answer under way to end")
        self._ended = True
        if self._bodyless:
            data = b""
        elif self._chunked:
            data = framed(last, True) + b"0\r\n\r\n" if last else b"0\r\n\r\n"
        else:
            data = last
        await self._conn.send_all(data, self._settled)
        # Several answers ending at once (the engine ends a round of streams in one step) each
        # go out before any of them goes on to what follows its end (its connection's next
        # request, the engine's spare connection): the last of 16 left ~16 such tails later.
        if trio.lowlevel.current_statistics().tasks_runnable:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def _settled(self) -> None:
        """The answer's last byte is in the client's socket: count it and log it now, before
        the client can ask anything else (a scrape of /metrics, a read of the log)."""
        self._conn.settle(self, None)

    def watching(self) -> Watching:
        """Cancel the block if the client leaves meanwhile (`gone` says so afterwards): nothing
        it waits for (a held request, an engine thinking) outlives the client that asked. What
        the block raises comes out as itself: a relay's write that failed (`ClientGone`) or an
        engine's cut is counted as what it is."""
        return Watching(self)


class Watching:
    """`Request.watching()`: a cancel scope that the connection's reader (`Connection._read_all`,
    which reads the client's socket for the connection's life) cancels when the client leaves.
    No task of its own: entered once per forwarded request, on the path to the first byte."""

    __slots__ = ("_request", "_scope")

    def __init__(self, request: Request) -> None:
        self._request = request
        self._scope = trio.CancelScope()

    async def __aenter__(self) -> None:
        request, scope = self._request, self._scope
        scope.__enter__()
        conn = request._conn
        conn.watched = request, scope
        if conn.eof:  # it left before the block began
            request.gone = True
            scope.cancel()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:  # the Cancelled of a client that left is swallowed
        self._request._conn.watched = None
        return self._scope.__exit__(kind, exc, tb)


Handler = Callable[[Request], Awaitable[None]]


class Connection:
    """One client connection: requests read one after the other, each answered before the next."""

    def __init__(self, stream: RelaySocket, daemon: FrontDoorDaemon, figures: RequestFigures) -> None:
        self.stream = stream
        self.daemon = daemon
        self.figures = figures
        limits = daemon.config.frontdoor
        self.max_head = limits.max_header_bytes  # h11 buffers no more of an incomplete head
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head)
        self.client = stream.peer()
        self.loopback = self.client is not None and is_loopback_host(self.client[0])
        self.arrived = 0.0  # when the read that brought a request's head returned (`_next_request`)
        # A chunked request body's coding, checked as its bytes arrive (`_check_body`).
        self.body_check: Dechunker | None = None
        # A malformed body that came with the head: raised when the handler reads the body, so
        # the handler answers it in its API's error shape.
        self.malformed: MalformedBody | None = None
        # The reader (`_read_all`) feeds h11 what the client sends, for the connection's life;
        # the serving task waits for it (`_more`) rather than reading itself.
        self.eof = False  # the client closed its side (or the socket broke): no more will come
        self.watched: tuple[Request, trio.CancelScope] | None = None  # `Request.watching()`, under way
        self._waiting: trio.lowlevel.Task | None = None  # the serving task, in `_more`
        self._held: trio.lowlevel.Task | None = None  # the reader, holding back past PIPELINED_BYTES
        self._read_at = 0.0  # when the reader's last read returned

    def settle(self, request: Request, failure: BaseException | None) -> None:
        """Count the request and write its access line, once: as its answer's last byte goes
        out (`Request._settled`), or when the handler ends without one (a failure, a client
        gone)."""
        exchange = request.exchange
        if exchange is not None and not request.settled:
            request.settled = True
            log_access(request, exchange, self.figures.finish(exchange, failure))

    async def send_all(self, data: bytes, on_sent: Callable[[], None] | None = None) -> None:
        try:
            await self.stream.send_all(data, on_sent)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone(str(exc.__cause__ or exc)) from exc

    async def _read(self) -> bytes:
        try:
            return await self.stream.receive_some(READ_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def serve(self, handler: Handler) -> None:
        """Read and answer requests until the client or the protocol ends the connection."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_all)
                try:
                    await self._serve(handler)
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the reader raises nothing: what serving raised
            if len(group.exceptions) != 1:
                raise
            raise group.exceptions[0] from None

    async def _read_all(self) -> None:
        """The connection's one reader: what the client sends is fed to h11 as it arrives and
        the serving task woken if it waits for it; past `PIPELINED_BYTES` not yet parsed (a
        client that sends ahead of its answers) the client is not read until the serving task
        wants more. The client's EOF cancels the watched block (`Request.watching()`), if one is
        under way: so a client that leaves is noticed without a task per request."""
        while True:
            if self._waiting is None and len(self.h11.trailing_data[0]) > PIPELINED_BYTES:
                self._held = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._release_held)
                continue
            data = await self._read()
            self._read_at = time.perf_counter()
            if not data:
                if self.watched is not None:
                    request, scope = self.watched
                    request.gone = True
                    scope.cancel()
                self._stop_reading()
                return
            if self.body_check is not None:
                try:
                    self._check_body(data)
                except MalformedBody as exc:  # raised where the handler reads the body
                    self.malformed = self.malformed or exc
                    self._stop_reading()  # nothing more of this connection is read
                    return
            self.h11.receive_data(data)
            self._wake()

    def _stop_reading(self) -> None:
        """No more of the client is read: h11 told its end, the serving task woken."""
        self.eof = True
        self.h11.receive_data(b"")
        self._wake()

    def _release_held(self, _: object) -> trio.lowlevel.Abort:
        self._held = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake(self) -> None:
        """The serving task, if it waits in `_more`, goes on."""
        task, self._waiting = self._waiting, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def _more(self) -> None:
        """Wait until the reader has fed h11 more of what the client sends, or its EOF."""
        if self.eof:
            await trio.lowlevel.checkpoint()
            return
        held, self._held = self._held, None
        if held is not None:
            trio.lowlevel.reschedule(held)
        self._waiting = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._stop_waiting)

    def _stop_waiting(self, _: object) -> trio.lowlevel.Abort:
        self._waiting = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _serve(self, handler: Handler) -> None:
        while True:
            event = None
            with trio.move_on_after(self.daemon.config.frontdoor.idle_timeout_s):
                try:
                    event = await self._next_request()
                except h11.RemoteProtocolError as exc:
                    await self._refuse(exc.error_status_hint)
                    return
            if event is None:
                return  # idle too long, or the client closed
            request = Request(self, event)
            route = self.figures.route_of(request.path)
            request.exchange = Exchange(route, self.arrived) if route is not None else None
            failure: BaseException | None = None
            chunked = request.header(b"transfer-encoding") == b"chunked"  # h11 admits no other coding
            self.body_check = Dechunker() if chunked else None
            self.malformed = None
            if chunked:
                try:
                    self._check_body(self.h11.trailing_data[0])  # what came with the head
                except MalformedBody as exc:
                    self.malformed = exc
            try:
                await handler(request)
            except ClientGone as exc:
                failure = OSError(str(exc))
            except MalformedBody as exc:
                failure = exc if request.answered else None
                log.info("refused %s %s: %s", request.method, request.path, exc)
                with contextlib.suppress(ClientGone, h11.LocalProtocolError):
                    text = f"Bad Request: {exc}\n".encode()
                    await request.respond(400, [(b"content-type", b"text/plain"), (b"connection", b"close")], text)
            except BaseException as exc:
                failure = exc
                if isinstance(exc, Exception) and request.answered:
                    log.warning("an answer to %s %s was cut midway: %r", request.method, request.path, exc)
                elif isinstance(exc, Exception):
                    log.exception("the front door failed on %s %s", request.method, request.path)
                    with contextlib.suppress(ClientGone, h11.LocalProtocolError):
                        await request.respond(500, [(b"content-type", b"text/plain")], b"Internal Server Error")
                    failure = None
                elif not isinstance(exc, Exception):
                    raise
            finally:
                self.settle(request, failure)
            if request.gone or failure is not None or not request._ended:
                return  # cut midway (the client sees an incomplete body), or the client left
            if not request.keep_alive:
                return  # Connection: close, on either side, or an HTTP/1.0 client
            if self.h11.their_state is not h11.DONE and not self.request_ended():
                return  # the body was not read whole: the connection cannot carry another request
            self._next_cycle()

    def _next_cycle(self) -> None:
        """A new parser for the client's next request, fed what already came of it: the answers
        are written without h11 (`Request._head`), so the parser that read this request never
        saw its answer and cannot start a cycle itself."""
        data, closed = self.h11.trailing_data
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head)
        if data:
            self.h11.receive_data(data)
        if closed:
            self.h11.receive_data(b"")

    def request_ended(self) -> bool:
        """A request whose body the handler did not read (a GET's, empty): its end is taken from
        what was already received, so the connection carries the client's next request."""
        conn = self.h11
        while conn.their_state is h11.SEND_BODY:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return False  # a body the handler never read, and malformed: the connection ends
            if event is h11.NEED_DATA or type(event) is h11.Data:
                return False  # a body is still arriving, or was sent and not read
        return conn.their_state is h11.DONE

    async def _next_request(self) -> h11.Request | None:
        conn = self.h11
        self.arrived = time.perf_counter()  # a head already here (pipelined) is taken as arriving now
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                await self._more()
                self.arrived = self._read_at  # the head's last bytes (if they are these)
            elif type(event) is h11.Request:
                return event
            else:  # ConnectionClosed, or PAUSED after a client that said Connection: close
                return None

    def _check_body(self, data: bytes) -> None:
        """A chunked body's bytes checked against the coding's grammar before h11 reads them
        (h11 also takes a chunk size with trailing blanks or of 17 to 20 digits); raises
        `MalformedBody`."""
        check = self.body_check
        if check is not None and not check.done:
            try:
                check.feed(data)
            except MalformedChunk as exc:
                raise MalformedBody(f"the request's chunked body is malformed: {exc}") from None

    def body_received(self) -> bytes | None:
        """`receive_body`, but only what is already here: None when it would have to read."""
        conn = self.h11
        if self.malformed is not None:
            raise self.malformed
        if conn.they_are_waiting_for_100_continue:
            return None
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise MalformedBody(f"the request's body is malformed: {exc}") from None
        if type(event) is h11.Data:
            return bytes(event.data)
        if type(event) is h11.EndOfMessage:
            return b""
        if event is h11.NEED_DATA:
            return None
        raise ClientGone("the client closed before sending its whole body")

    async def receive_body(self) -> bytes:
        conn = self.h11
        while (piece := self.body_received()) is None:
            if conn.they_are_waiting_for_100_continue:
                await self.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            else:
                await self._more()
        return piece

    async def _refuse(self, status: int) -> None:
        """A bare error answer to a request h11 refused (malformed, or a head too large)."""
        with contextlib.suppress(ClientGone):
            await self.send_all(response_head(status, [(b"content-length", b"0"), (b"connection", b"close")]))


async def open_listeners(host: str, port: int) -> list[socket.socket]:
    """Bind `host:port` and listen (raises OSError for a taken port or a foreign address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setblocking(False)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    await trio.lowlevel.checkpoint()
    return [sock]


def bound_url(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve_http(
    listeners: list[socket.socket],
    daemon: FrontDoorDaemon,
    figures: RequestFigures,
    handler: Handler,
    *,
    connections: trio.Nursery | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve every connection accepted on `listeners` until cancelled (then the listeners are
    closed). `connections`: where the accepted connections run, when they must outlive the
    listeners (a rebind after a reload closes the old address, not the requests it took)."""

    async def connection(sock: socket.socket) -> None:
        stream = RelaySocket(sock)
        try:
            await Connection(stream, daemon, figures).serve(handler)
        except Exception:  # a fault of the server's own: this connection ends, not the front door
            log.exception("the front door dropped a connection from %s", stream.peer())
        finally:
            stream.close()

    async def accept(listener: socket.socket, connections: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                continue
            except OSError as exc:
                if not accept_errors_to_retry(exc):
                    raise
                log.warning("the front door cannot accept a connection now (%s); trying again", exc.strerror or exc)
                await trio.sleep(0.1)  # out of file descriptors or memory: the clients wait in the backlog
                continue
            connections.start_soon(connection, sock)

    try:
        async with trio.open_nursery() as own:
            for listener in listeners:
                own.start_soon(accept, listener, own if connections is None else connections)
            task_status.started()
    finally:
        for listener in listeners:
            trio.lowlevel.notify_closing(listener)
            listener.close()
