"""HTTP/1.1's chunked coding as the front door reads it (daemon/core/chunked.py), on both sides:
a chunk size is hexadecimal digits only (RFC 9112's `1*HEXDIG`, at most 16), never what Python's
`int(x, 16)` would also take."""

from __future__ import annotations

import pytest

from stoker.daemon.core.chunked import Dechunker, MalformedChunk, chunk_size

# Each malformed the way a lenient parser lets through: a sign, a prefix, an underscore, blanks,
# nothing, digits that are not ASCII (Arabic-Indic five, fullwidth five), 20 digits.
MALFORMED_SIZES = [
    b"+5",
    b"-5",
    b"-0",
    b"0x5",
    b"5_0",
    b" 5",
    b"5 ",
    b"5\t",
    b"",
    "\u0665".encode(),
    "\uff15".encode(),
    b"1" * 20,
    b"0" * 17,
    b"5;",
    b"5;=1",
    b"5 garbage",
]
VALID_SIZES = [
    (b"a", 10),
    (b"A", 10),
    (b"0", 0),
    (b"5;ext=1", 5),
    (b"5 ; ext = 1", 5),
    (b'5;a="x;y";b', 5),
    (b"f" * 16, 2**64 - 1),
]


@pytest.mark.parametrize("line", MALFORMED_SIZES, ids=repr)
def test_a_size_that_is_not_hexadecimal_digits_is_refused(line):
    with pytest.raises(MalformedChunk, match="hexadecimal digits"):
        chunk_size(line)
    with pytest.raises(MalformedChunk):
        Dechunker().feed(line + b"\r\nhello\r\n0\r\n\r\n")


@pytest.mark.parametrize(("line", "size"), VALID_SIZES, ids=repr)
def test_hexadecimal_sizes_with_or_without_extensions_pass(line, size):
    assert chunk_size(line) == size


def test_chunked_bodies_decode_however_the_reads_split_them():
    events = [b'data: {"a": %d}\n\n' % i for i in range(12)]
    coded = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nX-Trailer: t\r\n\r\n"
    for size in (1, 2, 3, 7, 64, len(coded)):
        chunks, body = Dechunker(), b""
        for at in range(0, len(coded), size):
            assert not chunks.done
            body += chunks.feed(coded[at : at + size])
        assert chunks.done and body == b"".join(events), size
    with pytest.raises(MalformedChunk):
        Dechunker().feed(b"zz\r\nxx\r\n")
    with pytest.raises(MalformedChunk):
        Dechunker().feed(b"2\r\nxxyy")  # data longer than its size said
    with pytest.raises(MalformedChunk):
        Dechunker().feed(b"5;" + b"x" * 5000)  # a size line that never ends
