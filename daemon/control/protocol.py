"""The control protocol, sans-I/O: newline-delimited JSON in the JSON-RPC 2.0 shape.

Shared by the trio daemon, the blocking CLI client and the TUI; nothing here touches a socket
or an event loop. Bytes go in through `FrameDecoder.feed`, complete frames come out of
`FrameDecoder.next_frame`, and `decode_request` / `decode_reply` turn a frame into a message.
The `encode_*` functions produce one frame each (compact JSON plus the newline).

Every error reply carries `{code, reason, message, data}`; the JSON-RPC `code` comes from the
one table in daemon.control.error_codes, the `reason` is the stable `ReasonCode` string. See
docs/protocol.md.
"""

from __future__ import annotations

import collections
import datetime
import enum
import json
import math
import os
from typing import Any, Mapping

import attrs

from stoker.daemon.control.error_codes import APPLICATION_ERROR, PARSE_ERROR, code_for
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode, message_for

JSONRPC = "2.0"
# The one method the server answers itself: it turns the connection into an event stream.
SUBSCRIBE = "subscribe"
# One request frame is at most this many bytes, newline excluded; the daemon never buffers more.
MAX_FRAME = 1024 * 1024
# Replies can be larger (history, telemetry); the client reads them with this limit.
MAX_REPLY_FRAME = 64 * 1024 * 1024


class ProtocolError(StokerError):
    """A frame that is not a valid message: reason bad_request or request_too_large.

    `request_id` is the request's id when it could be recovered (so the error reply can still
    be matched by the client), else None. `code` is the JSON-RPC code for the reply.
    """

    def __init__(
        self,
        reason: ReasonCode | str,
        message: str | None = None,
        evidence: Mapping[str, Any] | None = None,
        *,
        request_id: int | str | None = None,
        code: int | None = None,
    ) -> None:
        super().__init__(reason, message, evidence)
        self.request_id = request_id
        self.code = code_for(self.reason) if code is None else code


class FrameTooLarge(ProtocolError):
    """A frame longer than the decoder's limit; its bytes were discarded, not buffered."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            ReasonCode.REQUEST_TOO_LARGE,
            f"A message exceeded the {limit}-byte frame limit and was discarded.",
            {"limit_bytes": limit},
        )


# --- messages ---------------------------------------------------------------------------


@attrs.frozen
class Request:
    """A call: `method` with keyword `params`; the reply carries the same `id`."""

    id: int | str
    method: str
    params: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Result:
    """A successful reply."""

    id: int | str | None
    result: Any


@attrs.frozen
class ErrorReply:
    """A failed reply: the JSON-RPC code, the stable reason string, a sentence, evidence."""

    id: int | str | None
    code: int
    reason: str
    message: str
    data: dict[str, Any] = attrs.field(factory=dict)

    def to_error(self) -> StokerError:
        """The StokerError this reply stands for (an unknown reason becomes internal_error)."""
        try:
            reason = ReasonCode(self.reason)
        except ValueError:
            return StokerError(ReasonCode.INTERNAL_ERROR, self.message, {**self.data, "remote_reason": self.reason})
        return StokerError(reason, self.message, self.data)


@attrs.frozen
class Event:
    """A notification on a subscribed connection; `params` is the published event."""

    params: dict[str, Any]


Reply = Result | ErrorReply | Event


# --- framing ----------------------------------------------------------------------------

_TOO_LARGE = object()


class FrameDecoder:
    """Splits a byte stream into newline-terminated frames, never holding more than the limit.

    `feed(data)` any chunking; `next_frame()` returns one frame (bytes without the newline),
    None when no complete frame is buffered, or raises FrameTooLarge once per oversized frame
    (whose bytes are dropped up to its newline; the frames after it decode normally).
    Blank lines are skipped.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._partial = bytearray()
        self._discarding = False
        self._ready: collections.deque[bytes | object] = collections.deque()
        self.ended = 0  # frames (oversized ones included) the last `feed` ended

    def feed(self, data: bytes) -> None:
        """Add received bytes; an empty `data` means nothing (EOF is the caller's business)."""
        view = memoryview(data)
        start = 0
        end = len(view)
        self.ended = 0
        while start <= end:
            newline = data.find(b"\n", start)
            stop = end if newline < 0 else newline
            if not self._discarding:
                room = self.max_frame + 1 - len(self._partial)
                self._partial += view[start : min(stop, start + room)]
                if len(self._partial) > self.max_frame:
                    self._partial.clear()
                    self._discarding = True
                    self._ready.append(_TOO_LARGE)
            if newline < 0:
                return
            self.ended += 1
            if self._discarding:
                self._discarding = False
            else:
                frame = bytes(self._partial)
                self._partial.clear()
                if frame.strip():
                    self._ready.append(frame)
            start = newline + 1

    def next_frame(self) -> bytes | None:
        """The next complete frame, or None; raises FrameTooLarge for an oversized one."""
        if not self._ready:
            return None
        frame = self._ready.popleft()
        if frame is _TOO_LARGE:
            raise FrameTooLarge(self.max_frame)
        return frame  # type: ignore[return-value]

    @property
    def buffered(self) -> int:
        """Bytes of the incomplete frame held now (at most max_frame)."""
        return len(self._partial)


# --- decoding ---------------------------------------------------------------------------


def _recover_id(obj: Any) -> int | str | None:
    if isinstance(obj, dict):
        value = obj.get("id")
        if _valid_id(value):
            return value
    return None


def _valid_id(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)


class _DuplicateKey(Exception):
    """A JSON object that names one key twice: which value was meant cannot be known."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _not_json_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and no parameter means them.
    raise ValueError(f"{name} is not JSON")


def _lenient_id(frame: bytes) -> int | str | None:
    """The id of a frame refused for a reason other than its syntax, when it can be read."""
    try:
        return _recover_id(json.loads(frame))
    except (ValueError, RecursionError):
        return None


def _parse_json(frame: bytes, *, strict: bool = False) -> Any:
    """The frame's JSON value. Strict (requests): NaN/Infinity are not JSON, and an object
    that repeats a key is refused: json.loads would keep the last value silently, so a
    client and the daemon could disagree about what was asked."""
    try:
        if strict:
            return json.loads(frame, object_pairs_hook=_unique_keys, parse_constant=_not_json_constant)
        return json.loads(frame)
    except _DuplicateKey as dup:
        raise _bad(
            f"The request names the key {dup.key!r} twice in one object; send each key once.",
            None if dup.key == "id" else _lenient_id(frame),
            duplicate_key=dup.key,
        ) from None
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(
            ReasonCode.BAD_REQUEST, "The message is not valid JSON.", {"error": str(err)[:200]}, code=PARSE_ERROR
        ) from None


def _bad(message: str, request_id: int | str | None, **evidence: Any) -> ProtocolError:
    return ProtocolError(ReasonCode.BAD_REQUEST, message, evidence, request_id=request_id)


def decode_request(frame: bytes) -> Request:
    """A request frame -> Request; raises ProtocolError (bad_request) with the id if known."""
    obj = _parse_json(frame, strict=True)
    if not isinstance(obj, dict):
        raise _bad("A request must be a JSON object.", None, got=type(obj).__name__)
    request_id = _recover_id(obj)
    if obj.get("jsonrpc") != JSONRPC:
        raise _bad('A request must have "jsonrpc": "2.0".', request_id)
    if "id" not in obj or not _valid_id(obj["id"]):
        raise _bad('A request must have an "id" that is an integer or a string.', None)
    method = obj.get("method")
    if not isinstance(method, str) or not method:
        raise _bad('A request must have a "method" that is a non-empty string.', request_id)
    params = obj.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise _bad('"params" must be a JSON object (by-name parameters).', request_id)
    extra = set(obj) - {"jsonrpc", "id", "method", "params"}
    if extra:
        raise _bad("A request has unknown members.", request_id, unknown=sorted(extra))
    return Request(obj["id"], method, params)


def decode_reply(frame: bytes) -> Reply:
    """A frame from the daemon -> Result, ErrorReply or Event; raises ProtocolError."""
    obj = _parse_json(frame)
    if not isinstance(obj, dict) or obj.get("jsonrpc") != JSONRPC:
        raise _bad("A reply must be a JSON-RPC 2.0 object.", _recover_id(obj))
    if obj.get("method") == "event" and "id" not in obj:
        params = obj.get("params")
        if not isinstance(params, dict):
            raise _bad("An event notification must carry an object in params.", None)
        return Event(params)
    request_id = obj.get("id")
    if request_id is not None and not _valid_id(request_id):
        raise _bad('A reply "id" must be an integer, a string or null.', None)
    if "result" in obj and "error" not in obj:
        return Result(request_id, obj["result"])
    error = obj.get("error")
    if isinstance(error, dict) and "result" not in obj:
        code = error.get("code")
        data = error.get("data") or {}
        return ErrorReply(
            request_id,
            code if isinstance(code, int) and not isinstance(code, bool) else APPLICATION_ERROR,
            str(error.get("reason") or ReasonCode.INTERNAL_ERROR),
            str(error.get("message") or ""),
            data if isinstance(data, dict) else {"data": data},
        )
    raise _bad('A reply must have exactly one of "result" and "error".', _recover_id(obj))


# --- encoding ---------------------------------------------------------------------------


def _default(value: Any) -> Any:
    """JSON for the few non-JSON types handlers return; anything else is a bug (TypeError)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if attrs.has(type(value)):
        from stoker.states.convert import unstructure  # cattrs costs a CLI that sends no record its import

        return unstructure(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _lenient(value: Any) -> Any:
    try:
        return _default(value)
    except TypeError:
        return repr(value)


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities (not JSON) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _frame(obj: dict[str, Any], *, lenient: bool = False) -> bytes:
    """Compact JSON plus the newline. Strict: a value that is not JSON raises TypeError or
    ValueError. Lenient (events): unknown types become their repr, NaN becomes null."""
    default = _lenient if lenient else _default
    try:
        text = json.dumps(obj, separators=(",", ":"), default=default, allow_nan=False)
    except ValueError:
        if not lenient:
            raise
        text = json.dumps(_finite(obj), separators=(",", ":"), default=default, allow_nan=False)
    return text.encode() + b"\n"


def encode_request(request_id: int | str, method: str, params: Mapping[str, Any] | None = None) -> bytes:
    """One request frame."""
    return _frame({"jsonrpc": JSONRPC, "id": request_id, "method": method, "params": dict(params or {})})


def encode_result(request_id: int | str | None, result: Any) -> bytes:
    """One success reply frame; raises TypeError/ValueError if `result` is not JSON-able."""
    return _frame({"jsonrpc": JSONRPC, "id": request_id, "result": result})


def encode_error(
    request_id: int | str | None,
    reason: ReasonCode | str,
    message: str | None = None,
    data: Mapping[str, Any] | None = None,
    *,
    code: int | None = None,
) -> bytes:
    """One error reply frame: {code, reason, message, data}; message defaults to the reason's."""
    reason = ReasonCode(reason)
    evidence = dict(data or {})
    error: dict[str, Any] = {
        "code": code_for(reason) if code is None else code,
        "reason": str(reason),
        "message": message or message_for(reason),
        "data": evidence,
    }
    try:
        return _frame({"jsonrpc": JSONRPC, "id": request_id, "error": error})
    except (TypeError, ValueError):
        # Evidence that is not JSON-able must not turn an error reply into a crash.
        error["data"] = {key: repr(value) for key, value in evidence.items()}
        return _frame({"jsonrpc": JSONRPC, "id": request_id, "error": error})


def encode_stoker_error(request_id: int | str | None, err: StokerError) -> bytes:
    """The error reply for a StokerError (a ProtocolError keeps its own code)."""
    code = err.code if isinstance(err, ProtocolError) else None
    return encode_error(request_id, err.reason, err.message, err.evidence, code=code)


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One event notification frame; lenient, so an odd value cannot break a stream."""
    return _frame({"jsonrpc": JSONRPC, "method": "event", "params": dict(event)}, lenient=True)
