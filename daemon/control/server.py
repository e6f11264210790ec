"""The control socket: a trio Unix-socket server speaking daemon.control.protocol.

Security: the runtime directory is 0700 and ours, the socket is created 0600 (bound under a
umask, so there is no window where it is wider), and every connection's peer uid is checked
with SO_PEERCRED. Robustness: frames are size-limited, bad input gets an error reply, a handler
that raises gets an internal_error reply, a frame left unfinished for FRAME_TIMEOUT_S gets
bad_request and the connection closed, and none of it disturbs other connections or the daemon.
Each connection runs its requests concurrently, up to a limit, replying as each ends.

The method `subscribe` is handled here: it acknowledges, then streams the EventBus's events
as notifications until the client goes away or falls behind (see daemon.core.events).
"""

from __future__ import annotations

import logging
import math
import os
import socket as stdsocket
import stat
import struct
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import trio

from stoker.daemon.control import protocol
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.events import EventBus
from stoker.states.reasons import ReasonCode

log = logging.getLogger(__name__)

Dispatch = Callable[[str, Mapping[str, Any]], Awaitable[Any]]

MAX_IN_FLIGHT = 32  # requests per connection running at once; the reader waits beyond that
SEND_TIMEOUT_S = 10.0  # a peer that does not read its replies for this long is disconnected
# A frame begun must end within this: a client that sends half a frame and holds the connection
# is answered bad_request and dropped. A connection with no frame begun may stay idle for ever
# (the TUI holds one between requests).
FRAME_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 1.0
STALE_PROBE_TIMEOUT_S = 2.0
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the NUL
RECEIVE_SIZE = 64 * 1024
BACKLOG = 64


def prepare_runtime_dir(path: Path) -> None:
    """Create the socket's directory 0700, or make an existing one of ours 0700; refuse others'."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StokerError(
            ReasonCode.RUNTIME_DIR_UNUSABLE,
            f"The runtime path {path} is not a directory (a symlink or a file); remove it.",
            {"path": str(path)},
        )
    if st.st_uid != os.getuid():
        raise StokerError(
            ReasonCode.RUNTIME_DIR_UNUSABLE,
            f"The runtime directory {path} belongs to uid {st.st_uid}, not to you; "
            f"refusing to put the control socket there. Remove it or set STOKER_HOME.",
            {"path": str(path), "owner_uid": st.st_uid, "uid": os.getuid()},
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        log.warning("runtime dir %s had mode %o; setting 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)


async def _clear_stale_socket(path: Path) -> None:
    """Remove a socket file nobody listens on; refuse if a daemon answers or it is no socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StokerError(
            ReasonCode.RUNTIME_DIR_UNUSABLE,
            f"{path} exists and is not a socket; refusing to replace it.",
            {"path": str(path)},
        )
    probe = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    try:
        with trio.move_on_after(STALE_PROBE_TIMEOUT_S) as scope:
            await probe.connect(os.fspath(path))
        # Connected, or a listener too busy to accept within the timeout: either way it lives.
        raise StokerError(
            ReasonCode.DAEMON_ALREADY_RUNNING, evidence={"socket": str(path), "answered": not scope.cancelled_caught}
        )
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # stale: nothing listens
    finally:
        probe.close()
    log.info("removing stale control socket %s", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _bind(path: Path) -> stdsocket.socket:
    sock = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_uid(sock: stdsocket.socket | trio.socket.SocketType) -> int | None:
    """The connected peer's uid (SO_PEERCRED on Linux, getpeereid elsewhere), or None."""
    if hasattr(stdsocket, "SO_PEERCRED"):
        raw = sock.getsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", raw)
        return uid
    return None  # pragma: no cover - non-Linux: the 0700 directory is the guard


async def serve_control(
    socket_path: os.PathLike[str] | str,
    dispatch: Dispatch,
    bus: EventBus,
    *,
    max_in_flight: int = MAX_IN_FLIGHT,
    max_frame: int = protocol.MAX_FRAME,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control socket until cancelled; `task_status.started(path)` once it listens.

    Raises StokerError(daemon_already_running) if a live server answers on `socket_path`.
    """
    path = Path(socket_path)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise StokerError(
            ReasonCode.RUNTIME_DIR_UNUSABLE,
            f"The control socket path is longer than the {MAX_SOCKET_PATH} bytes a Unix socket "
            f"allows; set STOKER_HOME (or XDG_RUNTIME_DIR) to a shorter directory.",
            {"socket": str(path)},
        )
    prepare_runtime_dir(path.parent)
    await _clear_stale_socket(path)
    raw = _bind(path)
    inode = os.stat(path).st_ino
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
    handler = _ConnectionHandler(dispatch, bus, max_in_flight, max_frame)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handler, [listener])
            log.info("control socket listening on %s", path)
            task_status.started(path)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            await listener.aclose()
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass


class _ConnectionHandler:
    def __init__(self, dispatch: Dispatch, bus: EventBus, max_in_flight: int, max_frame: int) -> None:
        self.dispatch = dispatch
        self.bus = bus
        self.max_in_flight = max_in_flight
        self.max_frame = max_frame
        self.uid = os.getuid()

    async def __call__(self, stream: trio.SocketStream) -> None:
        # Never let a connection's failure reach serve_listeners: it would stop the server.
        try:
            uid = peer_uid(stream.socket)
            if uid is not None and uid != self.uid:
                log.warning("refused a control connection from uid %s", uid)
                with trio.move_on_after(CLOSE_TIMEOUT_S):
                    await stream.send_all(
                        protocol.encode_error(
                            None,
                            ReasonCode.BAD_REQUEST,
                            "Only the user running the daemon may use its control socket.",
                            {"peer_uid": uid},
                        )
                    )
                return
            await _Connection(stream, self).run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the peer went away; nothing to report
        except Exception:
            log.exception("control connection failed")
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                await stream.aclose()


class _Connection:
    """One client connection: a reader task and a task per in-flight request."""

    def __init__(self, stream: trio.SocketStream, handler: _ConnectionHandler) -> None:
        self.stream = stream
        self.handler = handler
        self.decoder = protocol.FrameDecoder(handler.max_frame)
        self.send_lock = trio.Lock()
        self.slots = trio.Semaphore(handler.max_in_flight)
        self.subscribed = False

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self._read_requests(nursery)
            if self.subscribed:
                nursery.cancel_scope.cancel()  # the client hung up: stop streaming

    async def send(self, frame: bytes) -> None:
        """Send one frame whole; a peer that does not read for SEND_TIMEOUT_S is cut off."""
        async with self.send_lock:
            with trio.move_on_after(SEND_TIMEOUT_S) as scope:
                try:
                    await self.stream.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.nursery.cancel_scope.cancel()  # the peer went away
                    return
        if scope.cancelled_caught:
            log.warning("control client stopped reading; closing its connection")
            self.nursery.cancel_scope.cancel()

    async def _read_requests(self, nursery: trio.Nursery) -> None:
        begun: float | None = None  # when the incomplete frame held now began to arrive
        while True:
            data: bytes | None = None
            with trio.move_on_at(math.inf if begun is None else begun + FRAME_TIMEOUT_S):
                try:
                    data = await self.stream.receive_some(RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
            if data is None:
                await self._unfinished_frame()
                nursery.cancel_scope.cancel()
                return
            if not data:
                return
            self.decoder.feed(data)
            ended = self.decoder.ended
            if not self.decoder.buffered:
                begun = None
            elif begun is None or ended:  # the frame held now began in this read
                begun = trio.current_time()
            while True:
                try:
                    frame = self.decoder.next_frame()
                except protocol.FrameTooLarge as err:
                    # The rest of a stream that sent an oversized frame cannot be trusted to
                    # be in step with its replies; answer once and close.
                    await self.send(protocol.encode_stoker_error(None, err))
                    nursery.cancel_scope.cancel()
                    return
                if frame is None:
                    break
                if self.subscribed:
                    continue  # a subscribed connection only streams; requests are ignored
                try:
                    request = protocol.decode_request(frame)
                except protocol.ProtocolError as err:
                    await self.send(protocol.encode_stoker_error(err.request_id, err))
                    continue
                if request.method == protocol.SUBSCRIBE:
                    self.subscribed = True
                    receive = self.handler.bus.subscribe()
                    seq = self.handler.bus.seq
                    nursery.start_soon(self._stream_events, request, seq, receive)
                    continue
                await self.slots.acquire()
                nursery.start_soon(self._serve_request, request)

    async def _unfinished_frame(self) -> None:
        held = self.decoder.buffered
        log.warning(
            "a control client left a frame unfinished (%d bytes) for %g s; closing its connection",
            held,
            FRAME_TIMEOUT_S,
        )
        message = (
            f"The request frame was not finished (no newline) within {FRAME_TIMEOUT_S:g} s; the connection is closed."
        )
        await self.send(
            protocol.encode_error(
                None, ReasonCode.BAD_REQUEST, message, {"buffered": held, "timeout_s": FRAME_TIMEOUT_S}
            )
        )

    async def _serve_request(self, request: protocol.Request) -> None:
        try:
            try:
                result = await self.handler.dispatch(request.method, request.params)
                frame = protocol.encode_result(request.id, result)
            except StokerError as err:
                frame = protocol.encode_stoker_error(request.id, err)
            except Exception as err:
                log.exception("control method %r failed", request.method)
                frame = protocol.encode_error(
                    request.id,
                    ReasonCode.INTERNAL_ERROR,
                    _internal_message(err),
                    {"method": request.method, "exception": type(err).__name__},
                )
            # A handler that finished has its reply delivered even if the server is being
            # cancelled meanwhile: `shutdown` is exactly that case (its handler sets off the
            # cancellation of this very server), and without the shield its reply was lost about
            # half the time, by the luck of trio's scheduling. The send is bounded by its timeout.
            with trio.CancelScope(shield=True):
                await self.send(frame)
        finally:
            self.slots.release()

    async def _stream_events(
        self, request: protocol.Request, seq: int, receive: trio.MemoryReceiveChannel[dict[str, Any]]
    ) -> None:
        with receive:
            # The ack names the last seq before the subscription: the stream starts after it.
            await self.send(protocol.encode_result(request.id, {"subscribed": True, "seq": seq}))
            async for event in receive:
                await self.send(protocol.encode_event(event))
        # The stream ended (dropped or the bus closed): hang up so the client sees the end.
        self.nursery.cancel_scope.cancel()


def _internal_message(err: BaseException) -> str:
    """The internal_error sentence, naming the exception type (the traceback is in the log)."""
    return f"Stoker hit an internal error ({type(err).__name__}); the daemon log has the traceback."
