"""`RelaySocket`: a connected TCP socket for the front door's data path, driven directly with
trio's I/O waits.

trio's `SocketStream` makes every `send_all` and every `receive_some` that completes at once a
full pass through the scheduler (it must be a checkpoint), and each pass costs a trip through
epoll. The relay moves one SSE event per read and per write: on the 2-core test machine that
was ~45 % of the daemon's CPU per streamed token. Here a read or a write that can complete at
once does, and only one that would block waits (`trio.lowlevel.wait_readable` /
`wait_writable`, trio's documented way to drive a non-blocking socket); a read that follows one
which took all there was waits first (it would fail at once: the peer writes one event at a time). Cancellation is checked
before each call (`checkpoint_if_cancelled` costs nothing unless cancelled), never after one that
moved bytes: what was read must reach the caller. So that a loop that never blocks still lets
other tasks run, every `CHECKPOINT_EVERY`-th call that completed at once yields, shielded (as
trio's own sockets do after an operation that succeeded).

Errors are trio's: `trio.BrokenResourceError` for a connection reset or broken, and
`trio.ClosedResourceError` for a socket closed here (by another task).

A stream's body is pumped from socket to socket by one thread instead (daemon/core/
relay_loop.py, `RelayLoop`): where the engine generates a token every few milliseconds, a pass
of trio's scheduler with the relay's coroutines per event cost ~3x the CPU of a plain read and
write (docs/frontdoor.md, "The data path").
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Callable

import trio

CHECKPOINT_EVERY = 16
# As trio's SocketStream sets it: at most this much sent but not yet taken by the peer waits in
# the kernel, so a client that stops reading holds the relay (and the engine) back soon, and an
# answer counts as in flight until the client has most of it.
NOTSENT_LOWAT = 16 * 1024


class RelaySocket:
    """One connected TCP socket (non-blocking, TCP_NODELAY and TCP_NOTSENT_LOWAT as trio sets them)."""

    __slots__ = ("sock", "_calls", "_drained", "closed")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if hasattr(socket, "TCP_NOTSENT_LOWAT"):  # Linux, macOS
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
        self.sock = sock
        self._calls = 0
        self._drained = False  # the last read took all there was: the next one waits first
        self.closed = False

    @classmethod
    async def connect(cls, family: int, address: tuple[str, int]) -> RelaySocket:
        """Connect to an IP address (no resolver); raises OSError."""
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            try:
                sock.connect(address)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error)) from None
            else:
                await trio.lowlevel.checkpoint()
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def _pace(self) -> None:
        """A call that completed at once: every CHECKPOINT_EVERY-th yields, shielded (the bytes
        it moved are the caller's whatever happens now)."""
        self._calls += 1
        if self._calls >= CHECKPOINT_EVERY:
            self._calls = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_some(self, max_bytes: int) -> bytes:
        """What the peer sent (at most `max_bytes`); b"" once it closed its side."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._drained:  # a relay reads faster than its peer writes: skip the read that would fail
            await trio.lowlevel.wait_readable(self.sock)
            self._calls = 0  # that wait was a checkpoint
        while True:
            if self.closed:
                raise trio.ClosedResourceError("the socket was closed")
            try:
                data = self.sock.recv(max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                self._calls = 0
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            self._drained = len(data) < max_bytes
            await self._pace()
            return data

    async def send_all(self, data: bytes, on_sent: Callable[[], None] | None = None) -> None:
        """Send all of `data`, waiting only while the peer's window is full. `on_sent` is called
        as soon as the last byte is in the socket, before any other task can run (what must be
        true by the time the peer has it all)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data)
        total, sent = len(data), 0
        while sent < total:
            if self.closed:
                raise trio.ClosedResourceError("the socket was closed")
            try:
                sent += self.sock.send(view[sent:])
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                self._calls = 0
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
        if on_sent is not None:
            on_sent()
        await self._pace()

    def send_nowait(self, data: bytes) -> int:
        """As much of `data` as the socket takes now (0 when its buffer is full): no waiting and
        no checkpoint, so a caller sets up a timeout only for what must wait (`send_all`)."""
        if self.closed:
            raise trio.ClosedResourceError("the socket was closed")
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    def is_readable(self) -> bool:
        """Something to read, or EOF, is waiting (a pooled connection the peer closed)."""
        return socket_is_readable(self.sock)

    def peer(self) -> tuple[str, int] | None:
        try:
            host, port = self.sock.getpeername()[:2]
        except OSError:
            return None
        return str(host), int(port)

    def close(self) -> None:
        """Close now; a task waiting on this socket gets ClosedResourceError."""
        if not self.closed:
            self.closed = True
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


def socket_is_readable(sock: socket.socket) -> bool:
    """Whether a non-blocking socket has anything waiting (data, EOF, an error): a pooled
    connection in that state is not reused."""
    try:
        return sock.recv(1, socket.MSG_PEEK) is not None
    except BlockingIOError:
        return False
    except OSError:
        return True


def accept_errors_to_retry(exc: OSError) -> bool:
    """An accept() failure that says nothing about the listener (a client gone, a limit hit for a moment)."""
    return exc.errno in (
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.EPERM,
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOBUFS,
        errno.ENOMEM,
    )
