"""HTTP/1.1's chunked transfer coding (RFC 9112, 7.1), read one way on both sides of the front
door: a client's chunked request body (daemon/frontdoor/http11.py) and an engine's streamed
answer (daemon/engine/wire.py).

A chunk size is hexadecimal digits and nothing else (`chunk-size = 1*HEXDIG`), at most
`MAX_SIZE_DIGITS` of them; Python's `int(x, 16)` would also take `+5`, `0x5`, `5_0`, ` 5` and
non-ASCII digits, and h11's reader trailing blanks and 20-digit sizes. Chunk extensions
(`;name=value`, with optional blanks around `;` and `=`) are checked and ignored.
"""

from __future__ import annotations

import re

# 16 hexadecimal digits count 2^64 - 1 bytes: more digits than that describe no real body.
MAX_SIZE_DIGITS = 16
# A chunk-size line (with its extensions) or a trailer line, CRLF excluded.
MAX_LINE = 4096

_HEXDIGITS = b"0123456789abcdefABCDEF"
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_EXTENSION = rb"[ \t]*;[ \t]*" + _TOKEN + rb"(?:[ \t]*=[ \t]*(?:" + _TOKEN + rb"|" + _QUOTED + rb"))?"
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,%d})(?:%s)*" % (MAX_SIZE_DIGITS, _EXTENSION))


class MalformedChunk(ValueError):
    """The bytes break the chunked coding's grammar; the message says where."""


def chunk_size(line: bytes) -> int:
    """The size a chunk-size line (CRLF excluded) announces; raises `MalformedChunk` for
    anything but 1 to `MAX_SIZE_DIGITS` hexadecimal digits and well-formed extensions."""
    if 0 < len(line) <= MAX_SIZE_DIGITS and not line.strip(_HEXDIGITS):  # digits alone: a token's chunk
        return int(line, 16)
    match = _CHUNK_LINE.fullmatch(line)
    if match is None:
        raise MalformedChunk(
            f"a chunk size must be 1 to {MAX_SIZE_DIGITS} hexadecimal digits, optionally followed by "
            f"';' extensions, not {line[:40]!r}"
        )
    return int(match[1], 16)


class Dechunker:
    """The chunked coding taken off a body as its bytes arrive: what one read brought, its
    chunks' data joined. h11 parses the same at ~25 µs per chunk (a state machine pass and an
    event per chunk): an SSE stream is a chunk per token, so the relay does this part itself.
    Bytes past the body's end (a pipelined request) are left unread."""

    _SIZE, _DATA, _CRLF, _TRAILER = range(4)

    def __init__(self) -> None:
        self._buffer = b""
        self._state = self._SIZE
        self._left = 0  # data bytes left in the current chunk
        self.done = False  # the last chunk and the trailers were read

    def feed(self, data: bytes) -> bytes:
        """The chunk data in `data` (and what earlier reads left unfinished); raises
        `MalformedChunk` on a malformed coding."""
        buf = self._buffer + data if self._buffer else data
        pos, end, out = 0, len(buf), []
        state, left = self._state, self._left
        while pos < end and not self.done:
            if state == self._DATA:
                take = min(left, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                left -= take
                if left:
                    break
                state = self._CRLF
            elif state == self._CRLF:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise MalformedChunk("a chunk's data does not end in CRLF where its size said")
                pos += 2
                state = self._SIZE
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > MAX_LINE:
                        raise MalformedChunk(f"a chunk-size or trailer line longer than {MAX_LINE} bytes")
                    break
                line, pos = buf[pos:eol], eol + 2
                if state == self._TRAILER:
                    self.done = not line  # trailer fields until an empty line
                    continue
                left = chunk_size(line)
                state = self._DATA if left else self._TRAILER
        self._buffer, self._state, self._left = buf[pos:], state, left
        return out[0] if len(out) == 1 else b"".join(out)
