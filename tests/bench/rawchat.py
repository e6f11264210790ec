"""A lean client for streamed chat completions: raw asyncio sockets, HTTP/1.1 keep-alive, the
chunked body and its SSE events parsed from the bytes. No SDK and no httpx, so that a benchmark
measures the server and not the client; the same code talks to the engine and the front door.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import AsyncIterator
from urllib.parse import urlsplit

import attrs


async def chunked_body(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of a chunked HTTP/1.1 body as they arrive (the chunk framing taken off)."""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return
        yield (await reader.readexactly(size + 2))[:-2]


@attrs.define
class Stream:
    """One streamed answer as the client saw it."""

    ok: bool = False
    status: int = 0
    ttft: float | None = None  # seconds from the request's first byte sent to the first token
    last: float | None = None  # seconds from the request's first byte sent to the last token
    elapsed: float = 0.0  # to the end of the body
    tokens: int = 0
    error: str = ""


class Conn:
    """One keep-alive HTTP/1.1 connection sending streamed chat completions, parsed from the raw
    bytes (chunked transfer, SSE events): the same code for both paths."""

    def __init__(self, url: str, key: str | None) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.route = "/v1/chat/completions"  # what `chat` posts to
        self.key = key
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.peek = socket.socket()

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peek = socket.fromfd(sock.fileno(), sock.family, sock.type)  # asyncio's wrapper has no recv

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.peek.close()
        self.reader = self.writer = None

    def stale(self) -> bool:
        """The server closed this connection after its last answer (llama-server does after
        every streamed one): seen the way an HTTP client's pool sees it, a non-blocking peek."""
        if self.writer is None or self.reader is None or self.reader.at_eof():
            return True
        try:
            return self.peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    async def chat(self, body: bytes) -> Stream:
        """One request; a connection the server closed is opened anew within the timed request,
        as a client's pool does (the connect is part of what that path costs)."""
        started = time.perf_counter()
        if self.stale():
            self.close()
            await self.open()
        assert self.reader is not None and self.writer is not None
        head = (
            f"POST {self.prefix}{self.route} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + (f"Authorization: Bearer {self.key}\r\n" if self.key else "")
            + "\r\n"
        ).encode()
        out = Stream()
        try:
            self.writer.write(head + body)
            try:
                await self._read(out, started)
            except asyncio.IncompleteReadError as exc:
                if exc.partial or out.status:
                    raise
                # Closed between the peek and the request: once more on a new connection.
                self.close()
                await self.open()
                assert self.writer is not None
                self.writer.write(head + body)
                await self._read(out, started)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            out.ok, out.error = False, f"{type(exc).__name__}: {exc}"
            self.close()
        out.elapsed = time.perf_counter() - started
        return out

    async def _read(self, out: Stream, started: float) -> None:
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        out.status = int(head[9:12])
        headers = head.lower()
        pending = bytearray()
        done = False
        predicted: int | None = None
        counted = 0
        if b"transfer-encoding: chunked" in headers:
            async for piece in chunked_body(self.reader):
                pending += piece
                # SSE events end with a blank line; a chunk may hold several, or part of one.
                while (end := pending.find(b"\n\n")) >= 0:
                    event = bytes(pending[:end])
                    del pending[: end + 2]
                    if event.startswith(b"data: [DONE]"):
                        done = True
                    elif b'"error"' in event[:16] or b'"code":"engine_stream_cut"' in event:
                        out.error = event.decode(errors="replace")[:200]
                    elif b'"content":"' in event and b'"content":""' not in event:
                        counted += 1
                        out.last = time.perf_counter() - started
                        if out.ttft is None:
                            out.ttft = out.last
                    if b'"timings"' in event:  # llama-server's last event: what it generated
                        predicted = json.loads(event[6:])["timings"]["predicted_n"]
        else:
            length = int(headers.split(b"content-length:")[1].split(b"\r\n")[0])
            out.error = (await self.reader.readexactly(length)).decode(errors="replace")[:200]
        if b"connection: close" in headers:
            self.close()
        out.tokens = predicted if predicted is not None else counted
        out.ok = out.status == 200 and done and not out.error


def chat_body(prompt: str, tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
