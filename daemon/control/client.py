"""The blocking control client: the CLI calls the daemon with it, the TUI from a worker thread.

`ControlClient.call` keeps one connection open and serialises calls on it with a lock, so one
client can be shared by threads. `subscribe` opens a connection of its own for the event
stream; its `close()` may be called from another thread to end the iteration.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from pathlib import Path
from typing import Any, Iterator, TypeVar, overload

from stoker.daemon.control import protocol
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode

R = TypeVar("R")

DEFAULT_TIMEOUT_S = 30.0
RECEIVE_SIZE = 64 * 1024


def typed_reply(method: str, result: Any, record: type[R]) -> R:
    """`result` as a `record`: fields this client does not know are ignored; one it needs and
    did not get is daemon_version_skew, naming the method and what is missing."""
    from stoker.daemon.core.codecache import extend
    from stoker.states.convert import MissingFields, structure  # cattrs: only for a call that asks for a record

    extend()  # the structure functions cattrs generates from the CLI's cache, where it has one

    try:
        return structure(result, record)
    except MissingFields as err:
        raise StokerError(
            ReasonCode.DAEMON_VERSION_SKEW,
            f"The daemon's answer to {method!r} lacks what this command needs ({'; '.join(err.problems)}): "
            "the daemon runs another version of Stoker. Restart it (`stoker shutdown`, then start it again).",
            {"method": method, "record": record.__name__, "problems": err.problems},
        ) from err


def _not_running(path: Path, err: BaseException | None = None) -> StokerError:
    evidence: dict[str, Any] = {"socket": str(path)}
    if err is not None:
        evidence["error"] = f"{type(err).__name__}: {err}"
    return StokerError(ReasonCode.DAEMON_NOT_RUNNING, evidence=evidence)


def _connect(path: Path, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as err:
        sock.close()
        raise _not_running(path, err) from None
    except PermissionError as err:
        sock.close()
        raise StokerError(
            ReasonCode.DAEMON_NOT_RUNNING,
            f"Permission denied on the control socket {path}: it belongs to another user.",
            {"socket": str(path), "error": str(err)},
        ) from None
    except socket.timeout:
        sock.close()
        raise _not_running(path) from None
    except BaseException:
        sock.close()
        raise
    return sock


class _FrameReader:
    """Reads whole frames from a blocking socket."""

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self.sock = sock
        self.path = path
        self.decoder = protocol.FrameDecoder(protocol.MAX_REPLY_FRAME)

    def read(self) -> protocol.Reply | None:
        """The next message, or None at end of stream."""
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return protocol.decode_reply(frame)
            data = self.sock.recv(RECEIVE_SIZE)
            if not data:
                return None
            self.decoder.feed(data)


class ControlClient:
    """A blocking JSON-RPC client of the daemon's control socket; thread-safe."""

    def __init__(
        self, socket_path: os.PathLike[str] | str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else StokerPaths.from_env().socket_path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._reader: _FrameReader | None = None

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        with self._lock:
            self._disconnect()

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._reader = None

    @overload
    def call(self, method: str, /, *, returns: type[R], **params: Any) -> R: ...
    @overload
    def call(self, method: str, /, *, returns: None = None, **params: Any) -> Any: ...
    def call(self, method: str, /, *, returns: type[R] | None = None, **params: Any) -> R | Any:
        """Call `method` with `params`; the result (as the record `returns` when given), or
        StokerError with the daemon's reason."""
        with self._lock:
            request_id = next(self._ids)
            frame = protocol.encode_request(request_id, method, params)
            if len(frame) > protocol.MAX_FRAME + 1:
                raise StokerError(ReasonCode.REQUEST_TOO_LARGE, evidence={"bytes": len(frame)})
            self._send(frame)
            result = self._await_reply(request_id, method)
        return result if returns is None else typed_reply(method, result, returns)

    def _send(self, frame: bytes) -> None:
        # A connection kept from an earlier call may have been closed by a restarted daemon;
        # a send that failed delivered nothing, so trying once more on a new connection is safe.
        if self._sock is not None:
            try:
                self._sock.sendall(frame)
                return
            except (BrokenPipeError, ConnectionResetError):
                self._disconnect()
        self._sock = _connect(self.socket_path, self.timeout)
        self._reader = _FrameReader(self._sock, self.socket_path)
        try:
            self._sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError, socket.timeout) as err:
            self._disconnect()
            raise _not_running(self.socket_path, err) from None

    def _await_reply(self, request_id: int, method: str) -> Any:
        assert self._reader is not None
        try:
            while True:
                message = self._reader.read()
                if message is None:
                    self._disconnect()
                    raise StokerError(
                        ReasonCode.DAEMON_NOT_RUNNING,
                        "The daemon closed the connection before replying (it stopped or restarted).",
                        {"socket": str(self.socket_path), "method": method},
                    )
                if isinstance(message, protocol.Event) or message.id not in (request_id, None):
                    continue  # not ours (a late reply to a call that timed out)
                if isinstance(message, protocol.ErrorReply):
                    if message.id is None and message.reason == ReasonCode.REQUEST_TOO_LARGE:
                        self._disconnect()  # the daemon hangs up after an oversized frame
                    raise message.to_error()
                return message.result
        except socket.timeout:
            self._disconnect()
            raise StokerError(
                ReasonCode.INTERNAL_ERROR,
                f"The daemon did not answer {method!r} within {self.timeout} s.",
                {"socket": str(self.socket_path), "method": method, "timeout_s": self.timeout},
            ) from None
        except ConnectionResetError as err:
            self._disconnect()
            raise _not_running(self.socket_path, err) from None
        except protocol.ProtocolError:
            self._disconnect()
            raise

    def subscribe(self) -> "EventStream":
        """A new connection streaming the daemon's events; iterate it, close it when done."""
        sock = _connect(self.socket_path, self.timeout)
        try:
            sock.sendall(protocol.encode_request(0, protocol.SUBSCRIBE, {}))
            reader = _FrameReader(sock, self.socket_path)
            ack = reader.read()
            if ack is None:
                raise _not_running(self.socket_path)
            if isinstance(ack, protocol.ErrorReply):
                raise ack.to_error()
            if not isinstance(ack, protocol.Result):
                raise StokerError(ReasonCode.INTERNAL_ERROR, "The daemon did not acknowledge the subscription.")
            sock.settimeout(None)  # events may be minutes apart
        except socket.timeout:
            sock.close()
            raise _not_running(self.socket_path) from None
        except BaseException:
            sock.close()
            raise
        return EventStream(sock, reader, ack.result)


class EventStream:
    """An iterator of event dicts; ends when the daemon ends the stream or `close()` is called.

    If the subscriber fell behind, the last event is `{"topic": "dropped", ...}`.
    """

    def __init__(self, sock: socket.socket, reader: _FrameReader, ack: Any) -> None:
        self._sock = sock
        self._reader = reader
        self.ack = ack
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        while not self._closed.is_set():
            try:
                message = self._reader.read()
            except (OSError, protocol.ProtocolError):
                message = None
            if message is None:
                self.close()
                break
            if isinstance(message, protocol.Event):
                return message.params
        raise StopIteration

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the stream; safe from another thread (it wakes a blocked read)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
