"""The one resumable downloader: engine bundles and their mirrors, the engine's source tarball,
models (daemon/models/fetch.py hands it each Hub piece).

Reading: http.client into reused 1 MiB page-aligned buffers. httpx/httpcore treat every 64 KiB
read as an event and copy it twice, and huggingface_hub's `http_get` assembles 10 MiB chunks in
a BytesIO (1.4 and 3.1 s of CPU per GiB on loopback); `readinto` costs 0.15 s per GiB: the bytes
go from the socket into a buffer and stay there until daemon/core/part_sink.py has hashed and
written them (tests/bench/pull.py has the figures).

Resuming: `Range: bytes=N-` from the bytes in hand, with `If-Range` naming the validator the
first answer gave (its ETag, else its Last-Modified). A 200 to a ranged request (the file
changed, or the server ignores ranges) starts the part over from its first byte; a 206 with
another ETag (a server that ignored If-Range) too. A URL that is not pinned (a mirror's) is
resumed only with a validator; a pinned one (the Hub's, at a commit) names fixed bytes and is
resumed without.

Retrying: states/download_retry.py's table says which failures are tried again, how often in a
row without a byte gained and how long apart (trio sleeps when the daemon runs it); a try that
brought bytes starts the count again. Redirects are followed (the token is not sent to another
host). Proxies come from the environment (HTTP(S)_PROXY, ALL_PROXY, NO_PROXY): an https URL
through a CONNECT tunnel, an http one as an absolute URI to the proxy.

Files (`download`, `download_file`): into `DEST.part` beside a sidecar `DEST.part.json` (URL,
expected sha256, the validators, bytes so far), so that a daemon killed mid-stream resumes.
Only a file of the right size and sha256 is fsynced and renamed onto DEST: DEST is either absent
or complete. Failures raise `DownloadError` (daemon/core/download_records.py): the caller's
reason, a precise `kind`, and the evidence.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import mmap
import os
import queue
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urljoin, urlsplit

import attrs
import trio

from stoker.daemon.core.digests import fsync_dir
from stoker.daemon.core.download_records import (
    DownloadError,
    DownloadErrorKind,
    DownloadProgress,
    DownloadResult,
    PartSidecar,
)
from stoker.daemon.core.http import open_connection
from stoker.daemon.core.part_sink import DownloadCancelled, PartDigests, PartOverrun, PartSink, PartWriter, open_direct
from stoker.states.download_retry import RETRY_TABLE, DownloadFailure, RetryTable, retry_after
from stoker.states.reasons import ReasonCode

SLOT_BYTES = 1 << 20  # one read's buffer: a progress step, a write, a hash update
SLOTS = 32  # buffers in flight between the socket and the disk (32 MiB)
MAX_REDIRECTS = 10
TIMEOUT = 30.0  # a connection that says nothing this long is cut (and retried)
PROGRESS_INTERVAL = 0.1
# A buffer goes to the disk when full, or this long after its first byte: a slow server's
# bytes are shown and kept (a killed daemon resumes after them), a fast one's written whole.
FILL_WINDOW_S = 0.25
STOP_GRACE = 10.0  # a cancelled download's queued bytes reach the part within this
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _Retry(Exception):
    """A try failed in a way the retry table may try again; `final` is raised when it gives up."""

    def __init__(self, failure: DownloadFailure, final: DownloadError) -> None:
        super().__init__(final.message)
        self.failure, self.final = failure, final


def _fill(response: http.client.HTTPResponse, view: memoryview) -> int:
    """Read into `view` until it is full, the body ends, or FILL_WINDOW_S has passed since the
    first byte; the bytes read (0: the body ended). Each read takes what the socket has (one
    system call), so a slow server never holds a whole buffer back."""
    if response.chunked:
        return response.readinto(view)
    filled, began = 0, 0.0
    while filled < len(view):
        wanted = len(view) - filled if response.length is None else min(len(view) - filled, response.length)
        if wanted == 0:
            break
        assert response.fp is not None
        n = response.fp.readinto1(view[filled : filled + wanted])
        if not n:
            break
        if response.length is not None:
            response.length -= n
        if filled == 0:
            began = time.monotonic()
        filled += n
        if time.monotonic() - began >= FILL_WINDOW_S:
            break
    return filled


def _wait(seconds: float) -> None:
    """A retry's wait: a trio sleep in a thread the daemon's trio started (its tests run on a
    virtual clock), a plain one for a direct blocking call."""
    try:
        trio.from_thread.run(trio.sleep, seconds)
    except RuntimeError:  # not a thread trio started (RunFinishedError is one too)
        time.sleep(seconds)


@attrs.define(eq=False)
class UrlReading:
    """One URL's bytes handed to a PartWriter, from where it stands to the body's end: resumed,
    restarted and retried as the module says (blocking). `on_answer` sees each answer's head
    (`total`, the validators) before a byte of its body is handed on, and may refuse it."""

    url: str
    headers: Mapping[str, str] = attrs.field(factory=dict)
    reason: ReasonCode = ReasonCode.BUNDLE_VERIFY_FAILED
    timeout: float = TIMEOUT
    retry: RetryTable = RETRY_TABLE
    pinned: bool = False
    on_answer: Callable[[UrlReading], None] | None = None
    etag: str | None = None
    last_modified: str | None = None
    total: int | None = None  # the body's whole length, as the last answer stated it
    attempts: int = 0  # HTTP requests made
    _conn: http.client.HTTPConnection | None = None

    @property
    def validator(self) -> str | None:
        return self.etag or self.last_modified

    def error(self, kind: DownloadErrorKind, **evidence: Any) -> DownloadError:
        return DownloadError(kind, self.reason, {"url": self.url, **evidence})

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def interrupt(self) -> None:
        """Shut the connection in use (from another thread): a stalled read ends now, not at its timeout."""
        sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def run(self, writer: PartWriter) -> None:
        """Read to the body's end; DownloadError when the retry table gives up or the source refuses."""
        free: queue.Queue[mmap.mmap] = queue.Queue()
        for _ in range(SLOTS):
            free.put(mmap.mmap(-1, SLOT_BYTES))  # page-aligned: the sink may write it with O_DIRECT
        failures = 0
        while True:
            if writer.cancelled.is_set():
                raise DownloadCancelled()
            before = writer.offset
            try:
                self._read_once(writer, free)
                return
            except _Retry as failed:
                if writer.cancelled.is_set():  # the cut was the stop's own
                    raise DownloadCancelled() from None
                failures = 1 if writer.offset > before else failures + 1  # bytes gained: a new count
                wait = retry_after(failed.failure, failures, self.retry)
                if wait is None:
                    failed.final.evidence["attempts"] = self.attempts
                    failed.final.resumable = True
                    raise failed.final from None
                if failed.failure is DownloadFailure.CHANGED:
                    writer.restart()
                    self.etag = self.last_modified = None
                _wait(wait)

    def _read_once(self, writer: PartWriter, free: queue.Queue[mmap.mmap]) -> None:
        offset = writer.offset
        asked = {**self.headers, "Accept-Encoding": "identity"}
        if offset and not self.pinned:
            if self.validator is None:
                writer.restart()  # nothing proves the server still has the same file
                offset = 0
            else:
                asked["If-Range"] = self.validator
        if offset:
            asked["Range"] = f"bytes={offset}-"
        response = self._open(asked)
        try:
            etag, last_modified = response.getheader("ETag"), response.getheader("Last-Modified")
            if response.status == 206:
                shown = response.getheader("Content-Range")
                found = _CONTENT_RANGE.match(shown or "")
                if found is None or int(found.group(1)) != offset:
                    raise self.error(
                        DownloadErrorKind.RANGE_MISMATCH, status=206, requested_offset=offset, content_range=shown
                    )
                if not self.pinned and self.etag and etag and etag != self.etag:  # If-Range ignored: another file's
                    raise _Retry(DownloadFailure.CHANGED, self.error(DownloadErrorKind.CONTENT_CHANGED))
                self.total = None if found.group(3) == "*" else int(found.group(3))
            elif response.status == 200:
                if offset:
                    writer.restart()  # changed under its validator, or no Range support: from the first byte
                self.total = response.length
            else:
                raise self.error(DownloadErrorKind.HTTP_STATUS, status=response.status)
            self.etag, self.last_modified = etag, last_modified
            if self.on_answer is not None:
                self.on_answer(self)
            while True:
                buffer = free.get()
                view = memoryview(buffer)
                try:
                    n = _fill(response, view)
                except (OSError, http.client.HTTPException) as err:  # a cut (IncompleteRead), a stall
                    free.put(buffer)
                    raise self._cut(f"{type(err).__name__}: {err}") from err
                if not n:
                    free.put(buffer)
                    if response.length:  # http.client answers a cut with b"" (its comment: for compatibility)
                        raise self._cut(f"the body ended {response.length} bytes short of its length")
                    return
                writer.write_view(view[:n], functools.partial(free.put, buffer))
        finally:
            response.close()
            self.close()

    def _cut(self, cause: str) -> _Retry:
        return _Retry(DownloadFailure.CUT, self.error(DownloadErrorKind.CONNECTION, cause=cause))

    def _open(self, headers: dict[str, str]) -> http.client.HTTPResponse:
        """GET, following redirects: an answer below 300. An error status raises (a _Retry for
        408, 429 and 5xx)."""
        url, sent = self.url, dict(headers)
        for _ in range(MAX_REDIRECTS + 1):
            self.attempts += 1
            try:
                self._conn, target, extra = open_connection(url, self.timeout)
                self._conn.request("GET", target, headers={**sent, **extra})
                response = self._conn.getresponse()
            except (OSError, http.client.HTTPException) as err:
                self.close()
                raise self._cut(f"{type(err).__name__}: {err}") from err
            status, location = response.status, response.getheader("Location")
            if 300 <= status < 400 and location:
                self._conn.close()
                location = urljoin(url, location)
                if urlsplit(location).netloc != urlsplit(url).netloc:  # the token stays with its host
                    sent = {k: v for k, v in sent.items() if k.lower() != "authorization"}
                url = location
                self.attempts -= 1  # one try, however many hops
                continue
            if status < 400:
                return response
            body = b""
            with contextlib.suppress(OSError, http.client.HTTPException):
                body = response.read(64 * 1024)
            self.close()
            refused = self.error(
                DownloadErrorKind.HTTP_STATUS, status=status, body=body[:200].decode("utf-8", "replace")
            )
            if status in (408, 429) or status >= 500:  # the server may answer later: the part is kept
                raise _Retry(DownloadFailure.BUSY, refused)
            raise refused
        raise self._cut(f"more than {MAX_REDIRECTS} redirects")


def fetch_bytes(url: str, *, max_bytes: int, reason: ReasonCode, timeout: float = TIMEOUT) -> bytes:
    """A small file's bytes (a manifest), at most `max_bytes`, in one try (blocking)."""
    reading = UrlReading(url, reason=reason, timeout=timeout)
    try:
        response = reading._open({"Accept-Encoding": "identity"})
    except _Retry as failed:
        raise failed.final from None
    try:
        if response.status != 200:
            raise reading.error(DownloadErrorKind.HTTP_STATUS, status=response.status)
        return response.read(max_bytes)
    except (OSError, http.client.HTTPException) as err:
        raise reading.error(DownloadErrorKind.CONNECTION, cause=f"{type(err).__name__}: {err}") from err
    finally:
        response.close()
        reading.close()


@attrs.define(eq=False)
class _FileDownload:
    url: str
    dest: Path
    expected_sha256: str
    expected_size: int | None
    max_bytes: int
    progress: Callable[[DownloadProgress], Any] | None
    reason: ReasonCode
    retry: RetryTable
    cancelled: threading.Event = attrs.field(factory=threading.Event)
    stopped: threading.Event = attrs.field(factory=threading.Event)
    reading: UrlReading | None = None
    written: int = 0
    last_report: float = -1.0
    last_report_bytes: int = 0
    rate: float = 0.0

    @property
    def part(self) -> Path:
        return self.dest.with_suffix(self.dest.suffix + ".part")

    @property
    def sidecar(self) -> Path:
        return self.dest.with_suffix(self.dest.suffix + ".part.json")

    def error(self, kind: DownloadErrorKind, **evidence: Any) -> DownloadError:
        """An error that leaves nothing to resume: the part is removed."""
        self.discard()
        return DownloadError(kind, self.reason, {"url": self.url, "bytes": self.written, **evidence})

    def discard(self) -> None:
        for path in (self.part, self.sidecar):
            path.unlink(missing_ok=True)

    def stop(self) -> None:
        """Ask the download to stop (from another thread); the bytes so far are kept."""
        self.cancelled.set()
        if self.reading is not None:
            self.reading.interrupt()

    def run(self) -> DownloadResult:
        try:
            return self._run()
        except OSError as exc:  # the local side: mkdir, open, write, fsync, rename
            raise DownloadError(
                DownloadErrorKind.WRITE_FAILED,
                self.reason,
                {"url": self.url, "bytes": self.written, "part": str(self.part), "error": str(exc)},
            ) from exc
        finally:
            self.stopped.set()

    def _resumable(self) -> PartSidecar | None:
        """The sidecar of a part this download may continue; anything else is removed."""
        side = PartSidecar.load(self.sidecar)
        size = self.part.stat().st_size if self.part.exists() else 0
        if (
            side is not None
            and side.url == self.url
            and side.sha256.lower() == self.expected_sha256
            and side.validator is not None
            and size <= min(self.max_bytes, self.expected_size or self.max_bytes)
        ):
            return attrs.evolve(side, bytes=size)
        self.discard()
        return None

    def _run(self) -> DownloadResult:
        started = time.monotonic()
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        side = self._resumable()
        have = side.bytes if side is not None else 0
        cap = self.max_bytes if self.expected_size is None else min(self.max_bytes, self.expected_size)
        self.reading = UrlReading(self.url, reason=self.reason, retry=self.retry, on_answer=self._answered)
        if side is not None:
            self.reading.etag, self.reading.last_modified = side.etag, side.last_modified
        with open(self.part, "r+b" if have else "w+b", buffering=0) as fh, open_direct(self.part) as direct_fd:
            digests = PartDigests()
            digests.next_piece(0)
            digests.add_part(fh, 0, have)
            sink = PartSink(fh, digests, have, direct_fd=direct_fd)
            self.written = self.last_report_bytes = have
            try:
                if self.expected_size is None or have < self.expected_size:
                    self.reading.run(PartWriter(sink, 0, cap, self._report, self.cancelled))
                sink.drain()
            except PartOverrun as over:
                over_expected = self.expected_size is not None and cap == self.expected_size
                kind = DownloadErrorKind.SIZE_MISMATCH if over_expected else DownloadErrorKind.TOO_LARGE
                raise self.error(
                    kind,
                    expected_size=self.expected_size,
                    max_bytes=self.max_bytes,
                    actual_size=f">{over.at + over.chunk - 1}",
                ) from None
            except DownloadError as err:
                if not err.resumable:
                    self.discard()
                raise
            finally:
                sink.close()
                self.written = sink.written
                if self.written and self.part.exists():  # (a discarded part stays discarded)
                    self._save_sidecar()
                else:
                    self.discard()  # an empty part is nothing to resume
            sink.raise_error()
            actual = digests.whole.hexdigest()
            if self.expected_size is not None and self.written != self.expected_size:
                raise self.error(
                    DownloadErrorKind.SIZE_MISMATCH, expected_size=self.expected_size, actual_size=self.written
                )
            if actual != self.expected_sha256:
                raise self.error(
                    DownloadErrorKind.DIGEST_MISMATCH,
                    expected_sha256=self.expected_sha256,
                    actual_sha256=actual,
                    size=self.written,
                )
            os.fsync(fh.fileno())
        os.replace(self.part, self.dest)
        fsync_dir(self.dest.parent)
        self.sidecar.unlink(missing_ok=True)
        self._report(self.written, final=True)
        return DownloadResult(
            path=self.dest,
            sha256=actual,
            size=self.written,
            resumed_from=have,
            attempts=self.reading.attempts,
            elapsed=time.monotonic() - started,
        )

    def _answered(self, reading: UrlReading) -> None:
        """An answer's announced size, checked before a byte of it is written; its validators kept."""
        total = reading.total
        if total is not None and total > self.max_bytes:
            raise self.error(DownloadErrorKind.TOO_LARGE, max_bytes=self.max_bytes, announced=total)
        if total is not None and self.expected_size is not None and total != self.expected_size:
            raise self.error(DownloadErrorKind.SIZE_MISMATCH, expected_size=self.expected_size, actual_size=total)
        self._save_sidecar()

    def _save_sidecar(self) -> None:
        etag, last_modified = (self.reading.etag, self.reading.last_modified) if self.reading else (None, None)
        PartSidecar(self.url, self.expected_sha256, etag, last_modified, self.written).save(self.sidecar)

    def _report(self, done: int, *, final: bool = False) -> None:
        self.written = done
        if self.progress is None:
            return
        now = time.monotonic()
        elapsed = now - self.last_report
        if not final and elapsed < PROGRESS_INTERVAL and self.last_report >= 0:
            return
        if self.last_report >= 0 and elapsed > 0:
            instant = (done - self.last_report_bytes) / elapsed
            self.rate = instant if self.rate == 0 else 0.7 * self.rate + 0.3 * instant
        self.last_report, self.last_report_bytes = now, done
        total = self.reading.total if self.reading and self.reading.total is not None else self.expected_size
        eta = None if total is None or self.rate <= 0 else max(0.0, (total - done) / self.rate)
        self.progress(DownloadProgress(done, total, self.rate, 0.0 if final else eta))


def download_file(
    url: str,
    dest: Path,
    *,
    expected_sha256: str,
    expected_size: int | None,
    max_bytes: int,
    failure_reason: ReasonCode | str,
    progress: Callable[[DownloadProgress], Any] | None = None,
    retry: RetryTable = RETRY_TABLE,
) -> DownloadResult:
    """Download `url` to `dest`, resuming a part left earlier; verify size and sha256 (blocking)."""
    return _job(url, dest, expected_sha256, expected_size, max_bytes, failure_reason, progress, retry).run()


async def download(
    url: str,
    dest: Path,
    *,
    expected_sha256: str,
    expected_size: int | None,
    max_bytes: int,
    progress: Callable[[DownloadProgress], Any] | None = None,
    failure_reason: ReasonCode | str = ReasonCode.BUNDLE_VERIFY_FAILED,
    retry: RetryTable = RETRY_TABLE,
) -> DownloadResult:
    """`download_file` in a worker thread, `progress` called in trio's; cancelled, it stops at
    the next chunk and returns once the bytes so far are in the part and its sidecar."""

    def report(figures: DownloadProgress) -> None:
        if progress is not None:
            trio.from_thread.run_sync(progress, figures)

    job = _job(url, dest, expected_sha256, expected_size, max_bytes, failure_reason, report, retry)
    try:
        return await trio.to_thread.run_sync(job.run, abandon_on_cancel=True)
    except trio.Cancelled:
        job.stop()
        with trio.CancelScope(shield=True, deadline=trio.current_time() + STOP_GRACE):
            await trio.to_thread.run_sync(job.stopped.wait, abandon_on_cancel=True)
        raise


def _job(
    url: str,
    dest: Path,
    sha256: str,
    size: int | None,
    max_bytes: int,
    reason: ReasonCode | str,
    progress: Callable[[DownloadProgress], Any] | None,
    retry: RetryTable,
) -> _FileDownload:
    return _FileDownload(url, Path(dest), sha256.lower(), size, max_bytes, progress, ReasonCode(reason), retry)
