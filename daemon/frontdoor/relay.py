"""The engine's answer to the client, as it arrives: its first whole event before anything, then
each piece, pumped from socket to socket by the relay loop where both sides allow it; a stream
the engine cut ends with an error event."""

from __future__ import annotations

import json
import logging
from typing import AsyncGenerator, Awaitable, Callable

import httpx

from stoker.daemon.core.relay_loop import SinkGone
from stoker.daemon.engine.wire import EngineAnswer
from stoker.daemon.frontdoor.http11 import ClientGone, Request
from stoker.daemon.frontdoor.rename import ModelRename

log = logging.getLogger("stoker.frontdoor")

# The engine's headers a relayed answer keeps (its framing is the front door's own).
KEPT_HEADERS = (b"content-type", b"cache-control")  # as the wire reads them: lower case


def stream_cut_event(exc: Exception) -> bytes:
    """The SSE event a stream the engine cut midway ends with."""
    error = {"message": f"the engine's stream was cut midway ({exc})", "type": "server_error"}
    return b"data: " + json.dumps({"error": {**error, "param": None, "code": "engine_stream_cut"}}).encode() + b"\n\n"


async def first_bytes(response: EngineAnswer, sse: bool) -> tuple[bytes, AsyncGenerator[bytes, None]]:
    """The answer's first bytes (a stream's first whole event, or all it sent before it ended)
    and the iterator of the rest: nothing reaches the client before them."""
    chunks = response.aiter_raw()
    first = await anext(chunks, b"")
    while sse and first and b"\n\n" not in first and (more := await anext(chunks, b"")):
        first += more
    return first, chunks


async def relay(
    request: Request,
    response: EngineAnswer,
    sse: bool,
    first: bytes,
    chunks: AsyncGenerator[bytes, None],
    rename: ModelRename | None = None,
) -> None:
    """The engine's answer to the client as it arrives: its status and content type, `first`
    (already read), then each piece the rest of `chunks` brings, one write each; a cut SSE
    stream ends with an error event, any other cut body aborts the client's connection (raised:
    a truncated JSON body never looks complete). A stream's rest is pumped from socket to
    socket by the relay loop (`pump`) where both sides allow it."""
    kept = [(k, v) for k, v in response.raw_headers if k in KEPT_HEADERS]
    await request.start(response.status_code, kept, first if rename is None else rename.piece(first))
    send = request.send
    last = b""  # the body's last piece, which leaves with its end
    try:
        if sse and response.pumpable() and request.pumpable():
            await chunks.aclose()  # the answer's decoding goes on in `pump`, where it stopped
            if rename is None:
                last = await pump(request, response)
            else:
                last = rename.piece(await pump(request, response, rename.piece)) + rename.rest()
        elif rename is not None:  # the client sent another name than the engine reports
            async for chunk in chunks:
                await send(rename.piece(chunk))
            last = rename.rest()
        else:
            async for chunk in chunks:
                await send(chunk)
    except httpx.TransportError as exc:
        if not sse:
            raise
        log.warning("the engine's stream was cut midway: %s", exc)
        last = stream_cut_event(exc)
    await request.end(last)


async def pump(request: Request, response: EngineAnswer, shape: Callable[[bytes], bytes] | None = None) -> bytes:
    """The rest of a stream, relayed by the engine wire's relay loop (daemon/core/relay_loop.py):
    each read from the engine, after `shape` (the answer's `model` renamed, or the events
    translated into another API's lines; b"": nothing yet), written to the client at once from
    that loop's thread. A token's event is then one read and one write there, not a pass of
    trio's scheduler and the relay's coroutines, nor a thread's wake-up of its own
    (docs/frontdoor.md, "The data path"). A client that leaves (`watching`) interrupts it: the
    engine's connection is shut. Returns the answer's last piece, not shaped, for
    `Request.end` to write with the body's end; a write the client's socket refuses raises
    ClientGone."""
    sock, frame = request.sink()
    try:
        return await response.pump_to(frame if shape is None else lambda data: frame(shape(data)), sock)
    except SinkGone as exc:
        raise ClientGone(str(exc)) from exc


# What gives the engine's answer to the client: `relay` as it is, or translated into another
# API's shape (Ollama's NDJSON: daemon/frontdoor/ollama.py), with the same arguments.
Relay = Callable[[Request, EngineAnswer, bool, bytes, AsyncGenerator[bytes, None]], Awaitable[None]]
