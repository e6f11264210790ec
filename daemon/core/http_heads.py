"""HTTP/1.1 heads as Stoker writes them on the wire, to a client (the front door's answers) and
to an engine (the requests it forwards): a start line, then each header as `name: value`, then
the blank line. Written by hand rather than by h11, whose event objects and validation cost as
much again per request (docs/frontdoor.md, "The fixed work per request"); the values are
Stoker's own, and one that would end the head early (a line break in it) is refused here."""

from __future__ import annotations


class HeadLineBreak(ValueError):
    """A value of the head carries a line break: written, it would end the head early."""


def head_bytes(start_line: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """`start_line` and `headers` as they go on the wire, the blank line included; raises
    `HeadLineBreak` if any of them carries a CR or LF of its own."""
    parts = [start_line, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    lines = len(headers) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise HeadLineBreak("a head's line cannot carry a line break")
    return head


def says_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """The headers (lower-case names) say `Connection: close`: a token of any `Connection`
    header, in any case."""
    for name, value in headers:
        if name == b"connection" and b"close" in (token.strip().lower() for token in value.split(b",")):
            return True
    return False
