"""HTTP/1.1 to an engine, lean: the front door's forward path (`EngineClient.forward`).

Stoker's own request writer and answer reader over a `RelaySocket`
(daemon/core/relay_socket.py: a non-blocking socket driven with trio's I/O waits), without
httpx's layers or h11's: the request's head and body leave in one `send_all` (its head one
`bytes.join` of values Stoker built), the answer's head is read by `AnswerHead` (its status
line, its headers, then how its body is framed: chunked, `Content-Length`, or to the
connection's close), and its body is handed on as it is received (what one read brought, its
chunks joined). The peer is an engine Stoker launched (loopback, a per-launch key) or a remote
endpoint the config names; either way its answer is read strictly: a head that is not HTTP/1.x,
a header line that is not `name: value`, a head past `MAX_HEAD` bytes, an unknown transfer
coding, a bad `Content-Length` or an answer cut midway raise `httpx.RemoteProtocolError`, which
the front door answers with its reason codes (`engine_unreachable` before the first byte, the
`engine_stream_cut` event midway), and every read is bounded by the read timeout. Measured
against h11 on the 2-core test machine: docs/frontdoor.md, "The fixed work per request";
against httpx (a streamed answer of 7 events on a new connection each time): 1.7 -> 0.7 ms of
CPU per request, 16 -> 10 µs per event (docs/frontdoor.md, "Design").

A streamed answer's rest can be relayed by the wire's `RelayLoop` (`EngineAnswer.pump_to`: one
thread that reads every pumped stream's engine socket and writes its client's, daemon/core/
relay_loop.py): the front door's relay does so once the first event is out.

Connections: a streamed request goes with `Connection: close` (llama-server closes after every
streamed answer though its headers say keep-alive); other answers leave theirs in a small
keep-alive pool per engine address, dropped after `KEEPALIVE_S` idle or when the engine closed it
(the socket reads as readable: EOF), like httpcore's pool. Once a streamed answer to a loopback
engine has ended whole, a spare connection to that engine is opened (`spare`: a non-blocking
connect, nothing waited for) and pooled, so that the next request, streamed or not, finds one
ready: the connect (and the engine's accept) leave the time to its first token. The engine
closes an unused connection after 5 s like a kept-alive one, so the same `KEEPALIVE_S` drops it.
An idle connection holds llama-server's exit ~0.1 s: a planned stop first closes them
(`forget`). Failures raise httpx's exceptions (`ConnectError`, `ConnectTimeout`, `ReadError`,
`ReadTimeout`, `WriteError`, `WriteTimeout`, `RemoteProtocolError`, all
`httpx.TransportError`), the vocabulary the rest of the daemon already speaks for an engine that
is not there.

The engines Stoker runs are on loopback, in plain HTTP. A remote model's endpoint
(daemon/config/remote.py) may be https://: its connections are TLS (`TlsSocket`, trio's
SSLStream with the same four calls as `RelaySocket`), verified against certifi's CA bundle.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import ssl
import time
from functools import cached_property, partial
from typing import AsyncGenerator, Callable
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from stoker.daemon.core.chunked import Dechunker, MalformedChunk
from stoker.daemon.core.http import tls_context
from stoker.daemon.core.http_heads import HeadLineBreak, head_bytes, says_close
from stoker.daemon.core.relay_loop import Pump, RelayLoop, SourceBroken, SourceClosed, SourceSilent
from stoker.daemon.core.relay_socket import RelaySocket, socket_is_readable

# One read: an SSE event is ~250 bytes, a non-streamed answer a few KiB; a read takes what is there.
READ_BYTES = 64 * 1024
# Idle keep-alive connections are dropped after this long: under the engine's own keep-alive
# timeout (cpp-httplib's 5 s), so a connection it is about to close is not picked.
KEEPALIVE_S = 4.0
# Idle connections kept per engine address (the rest are closed once their answer is over).
POOL_SIZE = 16
# The largest answer head (status line and headers) read from an engine; past it the answer is refused.
MAX_HEAD = 64 * 1024


@attrs.frozen
class WireTimeouts:
    """Seconds: to connect, between two reads of an answer, to send a request."""

    connect: float = 5.0
    read: float = 900.0
    write: float = 60.0


@attrs.frozen
class _Address:
    host: str
    port: int
    host_header: bytes
    family: int | None  # an IP literal's socket family; None: a name
    tls: bool = False  # https: a TLS connection, the host's certificate verified


class TlsSocket:
    """A TLS connection to a remote endpoint, with the calls the wire makes of a `RelaySocket`."""

    def __init__(self, raw: socket.socket, tcp: trio.SocketStream, tls: trio.SSLStream[trio.SocketStream]) -> None:
        self._raw = raw  # the stdlib socket under trio's: peeked at, never read
        self._tcp = tcp
        self._tls = tls

    @classmethod
    async def connect(cls, host: str, port: int, context: ssl.SSLContext) -> TlsSocket:
        """Connect and shake hands; raises OSError (a refused connection, a certificate refused)."""
        family, _, _, _, sockaddr = (await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
        raw = socket.socket(family, socket.SOCK_STREAM)
        sock = trio.socket.from_stdlib_socket(raw)
        try:
            await sock.connect(sockaddr)
            tcp = trio.SocketStream(sock)
            tls = trio.SSLStream(tcp, context, server_hostname=host, https_compatible=True)
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            sock.close()
            raise OSError(f"TLS handshake failed: {exc.__cause__ or exc}") from exc
        except BaseException:
            sock.close()
            raise
        return cls(raw, tcp, tls)

    async def send_all(self, data: bytes) -> None:
        await self._tls.send_all(data)

    async def receive_some(self, max_bytes: int) -> bytes:
        return bytes(await self._tls.receive_some(max_bytes))

    def is_readable(self) -> bool:
        """Anything waiting on the socket (EOF, a close_notify, a late TLS record): not reused."""
        return socket_is_readable(self._raw)

    def close(self) -> None:
        self._tcp.socket.close()


@attrs.define(eq=False)
class _Connection:
    stream: RelaySocket | TlsSocket
    buffer: bytes = b""  # read past the answer's head: the start of its body
    idle_since: float = 0.0

    def reusable(self, now: float) -> bool:
        """Still the engine's, and not about to be closed by it (`KEEPALIVE_S`)."""
        return now - self.idle_since < KEEPALIVE_S and not self.stream.is_readable()


_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
# A status line (its reason phrase may be empty) and a header field line, as RFC 9112 writes
# them: no control characters in a value, no blank before the colon, no obsolete line folding.
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: [\t -~\x80-\xff]*)?")
_FIELD_LINE = re.compile(rb"(" + _TOKEN + rb"):[ \t]*((?:[!-~\x80-\xff](?:[\t -~\x80-\xff]*[!-~\x80-\xff])?)?)[ \t]*")
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_DIGITS = re.compile(rb"[0-9]{1,18}")
CHUNKED = -1  # `AnswerHead.length` of a chunked body
TO_CLOSE = -2  # of a body that ends when the engine closes the connection


@attrs.frozen
class AnswerHead:
    """An answer's status line and headers, read from the bytes, and how its body is framed."""

    status: int
    headers: list[tuple[bytes, bytes]]  # names in lower case, values as the engine wrote them
    length: int  # the body's bytes (`Content-Length`; 0: none), `CHUNKED` or `TO_CLOSE`
    keep_alive: bool  # the engine keeps the connection once the answer is whole

    @classmethod
    def parse(cls, head: bytes, method: str) -> AnswerHead:
        """The head (its last line break excluded); raises `httpx.RemoteProtocolError` for
        anything that is not an HTTP/1.x answer head."""
        lines = head.split(b"\n")
        status_line = lines[0].removesuffix(b"\r")
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise httpx.RemoteProtocolError(
                f"the engine's answer does not begin with a status line: {status_line[:80]!r}"
            )
        headers = []
        length: int | None = None
        chunked = False
        for line in lines[1:]:
            field = _FIELD_LINE.fullmatch(line.removesuffix(b"\r"))
            if field is None:
                raise httpx.RemoteProtocolError(f"the engine's answer has a malformed header line: {line[:80]!r}")
            name, value = field[1].lower(), field[2]
            headers.append((name, value))
            if name == b"content-length":
                if _DIGITS.fullmatch(value) is None or (length is not None and length != int(value)):
                    raise httpx.RemoteProtocolError(f"the engine's answer has a bad Content-Length: {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                if value.lower() != b"chunked" or chunked:
                    raise httpx.RemoteProtocolError(f"the engine's answer has an unsupported coding: {value[:40]!r}")
                chunked = True
        status = int(match[2])
        if method == "HEAD" or status in (204, 304) or status < 200:
            framing = 0
        elif chunked:  # Transfer-Encoding wins over a Content-Length (RFC 9112, 6.3)
            framing = CHUNKED
        else:
            framing = TO_CLOSE if length is None else length
        keep = match[1] == b"1" and not says_close(headers) and framing != TO_CLOSE
        return cls(status, headers, framing, keep)


class EngineAnswer:
    """An engine's answer: status and headers read, the body read by the caller as it arrives
    (`aiter_raw`, as httpx names it). `aclose` gives the connection back or closes it."""

    def __init__(
        self, wire: EngineWire, address: _Address, conn: _Connection, head: AnswerHead, keep: bool, sent_at: float
    ) -> None:
        self._wire = wire
        self.sent_at = sent_at  # `time.perf_counter()` as the request was handed to the engine's socket
        self._address = address
        self._conn: _Connection | None = conn
        self.status_code = head.status
        # As the engine wrote them (names in lower case): the relay keeps a few as they are, and
        # `headers` decodes them all only for a caller that asks.
        self.raw_headers = head.headers
        self._length = head.length  # what is left of a Content-Length body, or its framing
        self._chunked = head.length == CHUNKED
        # The connection goes back to the pool once the answer is whole: both sides keep it.
        self._keep = keep and head.keep_alive and not self._chunked
        self._whole = head.length == 0
        if self._whole and conn.buffer:  # bytes past an empty body: the connection is not reused
            self._keep = False
        self._chunks: Dechunker | None = None  # a chunked body's decoding, once `aiter_raw` began it
        self._interrupted = False

    @cached_property
    def headers(self) -> dict[str, str]:
        """The answer's headers, decoded (a repeated one: its last value)."""
        return {name.decode("latin-1"): value.decode("latin-1") for name, value in self.raw_headers}

    async def aiter_raw(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives: what each read brought, de-chunked (never buffered further)."""
        conn = self._conn
        if conn is None or self._whole:
            return
        data, conn.buffer = conn.buffer, b""
        if self._chunked:  # the relay's own decoding; the connection is closed after it, never pooled
            chunks = self._chunks = Dechunker()
            while True:
                if piece := _decoded(chunks, data):
                    yield piece
                if chunks.done:
                    return
                if not (data := await self._wire.receive(conn)):
                    raise httpx.RemoteProtocolError("the engine's answer was cut: its connection closed midway")
        while True:
            if data:
                left = self._length
                if left == TO_CLOSE:
                    yield data
                else:
                    if len(data) >= left:
                        self._whole = True
                        self._keep = self._keep and len(data) == left  # bytes past the body: not reused
                        yield data[:left] if len(data) > left else data
                        return
                    self._length = left - len(data)
                    yield data
            data = await self._wire.receive(conn)
            if not data:
                if self._length == TO_CLOSE:
                    self._whole = True
                    return
                raise httpx.RemoteProtocolError("the engine's answer was cut: its connection closed midway")

    def pumpable(self) -> bool:
        """The rest of the body can be relayed by `pump_to`: a chunked answer (`aiter_raw` began
        decoding it) on a plain socket (a TLS one is read in trio's thread)."""
        conn = self._conn
        return (
            conn is not None
            and self._chunks is not None
            and not self._chunks.done  # all of it came with the first event: nothing to pump
            and isinstance(conn.stream, RelaySocket)
        )

    async def pump_to(self, shape: Callable[[bytes], bytes], sink: socket.socket) -> bytes:
        """The rest of a `pumpable` answer, where `aiter_raw` left it, relayed by the wire's
        `RelayLoop`: each read's data, de-chunked, goes through `shape` (b"": nothing) to the
        non-blocking `sink` as it arrives, but the read that ends the answer: that last piece is
        returned (b"" when interrupted), for the caller to write with the body's end from trio's
        thread, where the answer is counted as its last byte leaves (a client that stops reading
        at a stream's `[DONE]` finds it counted). A token's event is then one read and one write
        in the loop's thread, and no pass of trio's scheduler (docs/frontdoor.md, "The data
        path"). Raises what `aiter_raw` raises (`ReadTimeout` after `timeouts.read` of
        silence), `SinkGone` when the sink's peer left, and what `shape` raises; the caller
        cancelled interrupts it (`interrupt`)."""
        conn, chunks = self._conn, self._chunks
        assert conn is not None and chunks is not None and isinstance(conn.stream, RelaySocket)
        timeout = self._wire.timeouts.read
        pump = Pump(conn.stream.sock, sink, partial(_decoded, chunks), partial(_over, chunks), shape, timeout)
        try:
            return await self._wire.relay.pump(pump, self.interrupt)
        except SourceSilent:
            raise httpx.ReadTimeout(f"the engine said nothing for {timeout:g} s") from None
        except SourceBroken as exc:
            raise httpx.ReadError(f"the engine's connection broke: {exc}") from exc
        except SourceClosed:
            raise httpx.RemoteProtocolError("the engine's answer was cut: its connection closed midway") from None

    def interrupt(self) -> None:
        """From trio's thread: a `pump` under way returns soon (its blocked read wakes), and
        the engine's connection is shut (the engine stops generating)."""
        self._interrupted = True
        conn = self._conn
        if conn is not None and isinstance(conn.stream, RelaySocket):
            with contextlib.suppress(OSError):
                conn.stream.sock.shutdown(socket.SHUT_RDWR)

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    async def aclose(self) -> None:
        """Pool the connection if the answer was read whole and the engine keeps it; else close it.
        Never cancelled, and no checkpoint: it only pools or closes a socket (a caller in a
        cancelled scope needs no shield), and a pass of trio's scheduler here was one more per
        request; the caller's next wait yields."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._whole and self._keep:
            self._wire.put(self._address, conn)
            return
        conn.stream.close()
        if self._chunks is not None and self._chunks.done:  # a whole stream: the engine is well
            self._wire.spare(self._address)


@attrs.define(eq=False)
class EngineWire:
    """Connections to loopback engines, their pool and their timeouts: one per front door."""

    timeouts: WireTimeouts = attrs.field(factory=WireTimeouts)
    tls: ssl.SSLContext | None = None  # https endpoints' context (None: certifi's CA bundle, made on first use)
    _idle: dict[_Address, list[_Connection]] = attrs.field(factory=dict)
    relay: RelayLoop = attrs.field(factory=RelayLoop)  # relays the answers pumped (`EngineAnswer.pump_to`)
    _addresses: dict[str, _Address] = attrs.field(factory=dict)

    def address(self, base_url: str) -> _Address:
        """Where an engine's base URL points, parsed once."""
        known = self._addresses.get(base_url)
        if known is None:
            parts = urlsplit(base_url)
            tls = parts.scheme == "https"
            host, port = parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80)
            known = self._addresses[base_url] = _Address(
                host, port, parts.netloc.encode("ascii"), _ip_family(host), tls
            )
        return known

    async def send(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        *,
        keep: bool,
    ) -> EngineAnswer:
        """Send one request and read the answer's status and headers; `keep`: the connection may
        be kept alive for the next request (else `Connection: close`)."""
        address = self.address(base_url)
        conn = self._pooled(address)
        if conn is None:
            conn = await self._connect(address)
        head = [(b"host", address.host_header), *headers]
        if body is not None:
            head.append((b"content-length", b"%d" % len(body)))
        if not keep:
            head.append((b"connection", b"close"))
        try:
            data = request_bytes(method, target, head, body)
            await trio.lowlevel.checkpoint_if_cancelled()
            sent_at = time.perf_counter()
            stream = conn.stream
            if isinstance(stream, RelaySocket):  # a request the socket takes at once needs no timeout
                data = data[stream.send_nowait(data) :]
            if data:
                with trio.move_on_after(self.timeouts.write) as scope:
                    await stream.send_all(data)
                if scope.cancelled_caught:
                    raise httpx.WriteTimeout(f"the engine took no request for {self.timeouts.write:g} s")
            while True:
                answer = await self._read_head(conn, method)
                if answer.status >= 200:
                    return EngineAnswer(self, address, conn, answer, keep, sent_at)
                if answer.status == 101:  # no upgrade was asked for: nothing HTTP would follow
                    raise httpx.RemoteProtocolError("the engine switched protocols unasked")
        except trio.BrokenResourceError as exc:
            await self.close(conn)
            raise httpx.WriteError(f"the engine's connection broke: {exc.__cause__ or exc}") from exc
        except BaseException:
            await self.close(conn)
            raise

    async def _read_head(self, conn: _Connection, method: str) -> AnswerHead:
        """The next answer head on `conn` (what follows it stays in `conn.buffer`)."""
        data = conn.buffer
        searched = 0
        while True:
            end = _HEAD_END.search(data, searched)
            if end is not None:
                conn.buffer = data[end.end() :]
                return AnswerHead.parse(data[: end.start()], method)
            if len(data) > MAX_HEAD:
                raise httpx.RemoteProtocolError(f"the engine's answer head is over {MAX_HEAD} bytes")
            searched = max(0, len(data) - 3)
            more = await self.receive(conn)
            if not more:
                raise httpx.RemoteProtocolError(
                    "the engine closed the connection without answering"
                    + (f" (after {len(data)} bytes of its head)" if data else "")
                )
            data += more

    async def receive(self, conn: _Connection) -> bytes:
        """One read (b"" at EOF), within the read timeout."""
        with trio.move_on_after(self.timeouts.read) as scope:
            try:
                return await conn.stream.receive_some(READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise httpx.ReadError(f"the engine's connection broke: {exc}") from exc
        assert scope.cancelled_caught
        raise httpx.ReadTimeout(f"the engine said nothing for {self.timeouts.read:g} s")

    async def _connect(self, address: _Address) -> _Connection:
        host, port = address.host, address.port
        with trio.move_on_after(self.timeouts.connect) as scope:
            try:
                stream: RelaySocket | TlsSocket
                if address.tls:
                    self.tls = self.tls or tls_context()
                    stream = await TlsSocket.connect(host, port, self.tls)
                elif address.family is not None:  # an IP literal: no resolver, no happy-eyeballs nursery
                    stream = await RelaySocket.connect(address.family, (host, port))
                else:
                    family, _, _, _, sockaddr = (await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
                    stream = await RelaySocket.connect(family, (str(sockaddr[0]), int(sockaddr[1])))
            except OSError as exc:
                raise httpx.ConnectError(f"cannot connect to the engine at {host}:{port}: {exc}") from exc
            return _Connection(stream)
        assert scope.cancelled_caught
        raise httpx.ConnectTimeout(f"the engine at {host}:{port} did not accept within {self.timeouts.connect:g} s")

    def _pooled(self, address: _Address) -> _Connection | None:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable(now):
                return conn
            conn.stream.close()  # the engine closed it, or is about to
        return None

    def spare(self, address: _Address) -> None:
        """Open a connection to a loopback engine for its next request and pool it, unless one
        is pooled already: a non-blocking connect, not waited for (the request's first write
        waits, if the handshake is not over by then, which on loopback it is)."""
        if address.tls or address.family is None or self._idle.get(address):
            return
        sock = socket.socket(address.family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect((address.host, address.port))
        except BlockingIOError:
            pass
        except OSError:  # refused: the engine is gone; the next request connects (and learns it)
            sock.close()
            return
        self.put(address, _Connection(RelaySocket(sock)))

    def forget(self, base_url: str) -> None:
        """Close the idle connections to the engine at `base_url` (it is about to be stopped: an
        idle connection would hold its exit)."""
        for conn in self._idle.pop(self.address(base_url), ()):
            conn.stream.close()

    def put(self, address: _Address, conn: _Connection) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) >= POOL_SIZE:
            conn.stream.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def close(self, conn: _Connection) -> None:
        conn.stream.close()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def __aenter__(self) -> EngineWire:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close every idle connection (the front door is going away)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.stream.close()
        self._idle.clear()
        self.relay.close()


def _over(chunks: Dechunker) -> bool:
    """Whether the answer's last chunk has come (read anew: a `feed` may have just ended it)."""
    return chunks.done


def _decoded(chunks: Dechunker, data: bytes) -> bytes:
    """`chunks.feed(data)`, a malformed coding raised as the engine's protocol error."""
    try:
        return chunks.feed(data)
    except MalformedChunk as exc:
        raise httpx.RemoteProtocolError(f"the engine's answer is malformed: {exc}") from None


def request_bytes(method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes | None) -> bytes:
    """A request as it goes on the wire: its line, `headers` (lower-case names, values Stoker
    built), then `body`. Raises `httpx.LocalProtocolError` for a line break or a blank where
    none may be (a header value or a target that would end the head early)."""
    refused = f"a request to the engine cannot carry a line break or a blank: {target[:80]!r}"
    if " " in target or not target:
        raise httpx.LocalProtocolError(refused)
    try:
        head = head_bytes(b"%s %s HTTP/1.1" % (method.encode("ascii"), target.encode("latin-1")), headers)
    except HeadLineBreak:
        raise httpx.LocalProtocolError(refused) from None
    return head + body if body else head


def _ip_family(host: str) -> int | None:
    """The socket family of an IP literal; None for a name (resolved at each connect)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if ip.version == 6 else socket.AF_INET
