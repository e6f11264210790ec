"""One file's bytes from a URL at the socket's speed: http.client reading into reused buffers.

huggingface_hub's downloader (`file_download.http_get`, on httpx2) costs about 1.4 s of CPU per
GiB on loopback before a byte is hashed or written: h11 and httpcore treat every 64 KiB read as
an event and copy it twice, and http_get's 10 MiB chunks are assembled in a BytesIO (3.1 s per
GiB with them). http.client's `readinto` costs 0.15 s per GiB: the bytes go from the socket into
a buffer and stay there until they are written and hashed, then the buffer is read into again
(tests/bench/pull.py has the figures). So the body of a pull's file is read here; the Hub's API
and the token and user agent (`build_hf_headers`) stay huggingface_hub's, and an error status is
`Refused` (hub.py says what it means).

What it does that http_get did: redirects followed (the Hub's 302 to its CDN; the token is not
sent to another host), `Range: bytes=N-` to continue, a cut or stalled connection retried from
where it stopped (states/download_retry.py's table: how many tries in a row without a byte, and
the waits between them, which are trio sleeps when the daemon runs it), a server that
ignores the Range answered by dropping the bytes the part already has. A body that ends where
its Content-Length says, before the stated size, is not retried: the pull machine refuses its
size. With a proxy in the environment, hub.py uses http_get instead (slower, and right).
"""

from __future__ import annotations

import functools
import http.client
import mmap
import queue
import re
import time
from typing import Callable
from urllib.parse import urljoin, urlsplit

import trio
from huggingface_hub import constants

from daemon.core.http import tls_context
from states.download_retry import RETRY_TABLE, DownloadFailure, RetryTable, retry_after

SLOT_BYTES = 1 << 20  # one read's buffer: a progress step, a write, a hash update
SLOTS = 32  # buffers in flight between the socket and the disk (32 MiB)
MAX_REDIRECTS = 10
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")

# (a filled part of a buffer, the call that hands the buffer back once it is written)
Consume = Callable[[memoryview, Callable[[], None]], None]


class Refused(Exception):
    """The server answered an error status that trying again will not change (a 4xx)."""

    def __init__(self, status: int, url: str, body: bytes) -> None:
        super().__init__(f"HTTP {status} from {url}: {body[:200].decode('utf-8', 'replace')}")
        self.status = status


class Transient(ConnectionError):
    """The connection failed or stalled, or the server was busy: retry from where the bytes stopped."""

    def __init__(self, message: str, failure: DownloadFailure = DownloadFailure.CUT) -> None:
        super().__init__(message)
        self.failure = failure


def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout, context=tls_context())
    if parts.scheme == "http":
        return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    raise ValueError(f"not an http(s) URL: {url}")


def _open(
    url: str, headers: dict[str, str], timeout: float
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, str]:
    """GET `url`, following redirects: the connection, its answer (status < 300) and the final
    URL. An error status raises Refused (Transient for 408, 429, 5xx)."""
    sent = dict(headers)
    for _ in range(MAX_REDIRECTS + 1):
        conn = _connect(url, timeout)
        parts = urlsplit(url)
        try:
            conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), headers=sent)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            raise Transient(f"{type(err).__name__}: {err}") from err
        location = response.getheader("Location")
        if 300 <= response.status < 400 and location:
            conn.close()
            location = urljoin(url, location)
            if urlsplit(location).netloc != parts.netloc:  # the token stays with the host it was meant for
                sent = {k: v for k, v in sent.items() if k.lower() != "authorization"}
            url = location
            continue
        if response.status >= 400:
            try:
                body = response.read(64 * 1024)
            except (OSError, http.client.HTTPException):
                body = b""
            conn.close()
            if response.status in (408, 429) or response.status >= 500:
                raise Transient(f"HTTP {response.status} from {url}", DownloadFailure.BUSY)
            raise Refused(response.status, url, body)
        return conn, response, url
    raise Transient(f"more than {MAX_REDIRECTS} redirects from {url}")


def read_url(
    url: str,
    headers: dict[str, str],
    *,
    offset: int,
    size: int,
    consume: Consume,
    timeout: float | None = None,
    retry: RetryTable = RETRY_TABLE,
) -> int:
    """Read `url`'s bytes from `offset` to the end of its body (retrying cuts while short of
    `size`) and hand them to `consume` in order, in reused buffers; the position reached. More
    bytes than `size` are handed on too: the consumer refuses them (blocking)."""
    timeout = timeout or float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    free: queue.Queue[mmap.mmap] = queue.Queue()
    for _ in range(SLOTS):
        free.put(mmap.mmap(-1, SLOT_BYTES))  # page-aligned: the part's writer may write it with O_DIRECT
    cursor = _Cursor(offset)
    failures = 0
    while cursor.position < size:
        before = cursor.position
        try:
            _read_once(url, headers, cursor, consume, free, timeout)
            break  # the body ended where the server said it would
        except Transient as failed:
            failures = 1 if cursor.position > before else failures + 1  # bytes gained: a new count
            wait = retry_after(failed.failure, failures, retry)
            if wait is None:
                raise
            _wait(wait)
    return cursor.position


def _wait(seconds: float) -> None:
    """A retry's wait: a trio sleep in a thread the daemon's trio started (its tests run on a
    virtual clock), a plain one for a direct blocking call."""
    try:
        trio.from_thread.run(trio.sleep, seconds)
    except RuntimeError:  # not a thread trio started (RunFinishedError is one too)
        time.sleep(seconds)


class _Cursor:
    def __init__(self, position: int) -> None:
        self.position = position


def _read_once(
    url: str, headers: dict[str, str], cursor: _Cursor, consume: Consume, free: queue.Queue[mmap.mmap], timeout: float
) -> None:
    """One request from `cursor.position` to the end of its body, moving the cursor as the bytes
    are handed on. Transient when it fails first."""
    asked = dict(headers)
    if cursor.position:
        asked["Range"] = f"bytes={cursor.position}-"
    conn, response, final = _open(url, asked, timeout)
    try:
        skip = 0
        if cursor.position and response.status == 200:
            skip = cursor.position  # the Range was ignored: the bytes the part has come first again
        elif response.status == 206:
            found = _CONTENT_RANGE.match(response.getheader("Content-Range") or "")
            if found is None or int(found.group(1)) != cursor.position:
                shown = found.group(0) if found else response.getheader("Content-Range")
                raise Transient(f"{final} answered the range from {cursor.position} with {shown!r}")
        while True:
            buffer = free.get()
            view = memoryview(buffer)
            try:
                n = response.readinto(view[: min(skip, SLOT_BYTES)] if skip else view)
            except (OSError, http.client.HTTPException) as err:  # a cut (IncompleteRead), a stall
                free.put(buffer)
                raise Transient(f"{type(err).__name__}: {err}") from err
            if not n:
                free.put(buffer)
                if response.length:  # http.client answers a cut with b"" (its comment: for compatibility)
                    raise Transient(f"the body from {final} ended {response.length} bytes short of its length")
                return
            if skip:
                skip -= n
                free.put(buffer)
                continue
            consume(view[:n], functools.partial(free.put, buffer))
            cursor.position += n
    finally:
        response.close()
        conn.close()
