"""Resumable, verified HTTP downloads of engine bundles (httpx on trio).

A download streams into `DEST.part` beside a small sidecar `DEST.part.json` (URL, expected
sha256, the server's ETag / Last-Modified, bytes so far), so that a daemon killed mid-stream
resumes with `Range: bytes=N-` + `If-Range` instead of starting over. The sha256 is computed
while streaming (a resumed part is re-hashed first, so the digest always covers the whole
file); only a file of the right size and digest is fsynced and renamed onto DEST, so DEST is
either absent or complete.

Failures raise `DownloadError`: a `StokerError` whose reason is the caller's (the install
machine passes its backend's `*_bundle_install_failed`) and whose `kind` says precisely what
went wrong (`DownloadErrorKind`), with the evidence (URL, status, bytes, digests).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Callable

import attrs
import httpx
import trio

from daemon.core.digests import fsync_dir, sha256_of, start_writeback
from daemon.core.http import download_client
from daemon.install.download_records import (
    DownloadError,
    DownloadErrorKind,
    DownloadProgress,
    DownloadResult,
    PartSidecar,
)
from states.download_retry import RETRY_TABLE, DownloadFailure, RetryTable, retry_after
from states.reasons import ReasonCode

# Bytes handed to the writer thread at once: big enough that thread hand-offs are rare,
# small enough that a cancelled download loses little.
BATCH_BYTES = 1024 * 1024
WRITEBACK_BYTES = 16 * 1024 * 1024  # start the disk writing every 16 MiB, not all at the fsync


PROGRESS_INTERVAL = 0.1
MAX_RESTARTS = 3
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _Retry(Exception):
    """A try failed in a way RETRY_TABLE may try again; resume from what was written. `final`
    is what the download raises when the table gives up."""

    def __init__(self, failure: DownloadFailure, final: DownloadError) -> None:
        super().__init__(final.message)
        self.failure, self.final = failure, final


class _Restart(Exception):
    """The part cannot be continued (content changed); start again from zero."""


async def download(
    url: str,
    dest: Path,
    *,
    expected_sha256: str,
    expected_size: int | None,
    max_bytes: int,
    progress: Callable[[DownloadProgress], None] | None = None,
    client: httpx.AsyncClient | None = None,
    failure_reason: ReasonCode | str = ReasonCode.BUNDLE_VERIFY_FAILED,
    retry: RetryTable = RETRY_TABLE,
) -> DownloadResult:
    """Download `url` to `dest`, resuming a part left earlier; verify size and sha256."""
    transfer = _Transfer(
        url=url,
        dest=Path(dest),
        expected_sha256=expected_sha256.lower(),
        expected_size=expected_size,
        max_bytes=max_bytes,
        progress=progress,
        reason=ReasonCode(failure_reason),
    )
    if client is not None:
        return await transfer.run(client, retry)
    async with download_client() as own:
        return await transfer.run(own, retry)


@attrs.define(eq=False)
class _Transfer:
    url: str
    dest: Path
    expected_sha256: str
    expected_size: int | None
    max_bytes: int
    progress: Callable[[DownloadProgress], None] | None
    reason: ReasonCode
    fd: int = -1
    hasher: Any = attrs.field(factory=hashlib.sha256)
    written: int = 0
    received: int = 0
    total: int | None = None
    etag: str | None = None
    last_modified: str | None = None
    attempts: int = 0
    restarts: int = 0
    resumed_from: int = 0
    started: float = 0.0
    last_report: float = -1.0
    last_report_bytes: int = 0
    rate: float = 0.0
    write_failure: OSError | None = None

    @property
    def part(self) -> Path:
        return self.dest.with_suffix(self.dest.suffix + ".part")

    @property
    def sidecar(self) -> Path:
        return self.dest.with_suffix(self.dest.suffix + ".part.json")

    def error(self, kind: DownloadErrorKind, *, discard: bool, **evidence: Any) -> DownloadError:
        err = DownloadError(kind, self.reason, {"url": self.url, "bytes": self.written, **evidence})
        if discard:
            self.discard()
        return err

    # The whole download.

    async def run(self, client: httpx.AsyncClient, retry: RetryTable) -> DownloadResult:
        try:
            return await self.run_attempts(client, retry)
        except OSError as exc:  # the local side: mkdir, open, fsync, rename
            raise self.error(
                DownloadErrorKind.WRITE_FAILED, discard=False, part=str(self.part), error=str(exc)
            ) from exc

    async def run_attempts(self, client: httpx.AsyncClient, retry: RetryTable) -> DownloadResult:
        self.started = trio.current_time()
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            await self.open_part()
            failures = 0
            while True:
                if self.expected_size is not None and self.written == self.expected_size:
                    break  # a complete part from an earlier run: only the checks are left
                before = self.written
                try:
                    await self.attempt(client)
                    break
                except _Retry as failed:
                    failures = 1 if self.written > before else failures + 1  # bytes gained: a new count
                    wait = retry_after(failed.failure, failures, retry)
                    if wait is None:
                        self.save_sidecar()
                        failed.final.evidence["attempts"] = self.attempts
                        raise failed.final from None
                    await trio.sleep(wait)
                except _Restart:
                    self.restarts += 1
                    if self.restarts > MAX_RESTARTS:
                        raise self.error(DownloadErrorKind.CONTENT_CHANGED, discard=True) from None
                    self.truncate()
            return await self.finish()
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
                if self.written == 0:
                    self.discard()  # an empty part is nothing to resume

    async def open_part(self) -> None:
        """Open the part, keeping it only if it belongs to this URL and digest and can be resumed."""
        side = PartSidecar.load(self.sidecar)
        size = self.part.stat().st_size if self.part.exists() else 0
        usable = (
            side is not None
            and side.url == self.url
            and side.sha256.lower() == self.expected_sha256
            and side.validator is not None
            and size <= self.max_bytes
            and (self.expected_size is None or size <= self.expected_size)
        )
        if not usable:
            self.discard()
            size = 0
        else:
            assert side is not None
            self.etag, self.last_modified = side.etag, side.last_modified
        self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT, 0o644)
        if size:
            self.hasher = await trio.to_thread.run_sync(lambda: sha256_of(self.part, end=size))
        os.ftruncate(self.fd, size)
        os.lseek(self.fd, size, os.SEEK_SET)
        self.written = self.received = self.resumed_from = size
        self.last_report_bytes = size

    def truncate(self) -> None:
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.hasher = hashlib.sha256()
        self.written = self.received = 0
        self.etag = self.last_modified = None

    def discard(self) -> None:
        """Remove the part and its sidecar; nothing of this transfer is resumable any more."""
        for path in (self.part, self.sidecar):
            path.unlink(missing_ok=True)
        self.written = self.received = 0

    def save_sidecar(self) -> None:
        PartSidecar(self.url, self.expected_sha256, self.etag, self.last_modified, self.written).save(self.sidecar)

    # One HTTP request.

    async def attempt(self, client: httpx.AsyncClient) -> None:
        headers = {"Accept-Encoding": "identity"}
        validator = self.etag or self.last_modified
        offset = self.written
        if offset and validator is None:
            self.truncate()  # nothing to prove the server still has the same file
            offset = 0
        if offset:
            headers["Range"] = f"bytes={offset}-"
            headers["If-Range"] = validator  # type: ignore[assignment]
        self.attempts += 1
        try:
            async with client.stream("GET", self.url, headers=headers, follow_redirects=True) as response:
                self.accept(response, offset)
                await self.stream_body(response)
        except httpx.TransportError as exc:
            cause = f"{type(exc).__name__}: {exc}"
            final = self.error(DownloadErrorKind.CONNECTION, discard=False, attempts=self.attempts, cause=cause)
            raise _Retry(DownloadFailure.CUT, final) from exc
        finally:
            if self.written and self.part.exists():  # (a discarded part stays discarded)
                self.save_sidecar()
            else:
                self.sidecar.unlink(missing_ok=True)

    def accept(self, response: httpx.Response, offset: int) -> None:
        """Check the status and framing of a response before a byte of it is written."""
        status = response.status_code
        etag = response.headers.get("etag")
        last_modified = response.headers.get("last-modified")
        if status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
            if match is None or int(match.group(1)) != offset:
                raise self.error(
                    DownloadErrorKind.RANGE_MISMATCH,
                    discard=True,
                    status=status,
                    requested_offset=offset,
                    content_range=response.headers.get("content-range"),
                )
            if offset and self.etag and etag and etag != self.etag:
                # The server ignored If-Range and sent a piece of another file.
                raise _Restart()
            self.total = None if match.group(3) == "*" else int(match.group(3))
        elif status == 200:
            if offset:
                self.truncate()  # validator changed, or no range support: start clean
            length = response.headers.get("content-length")
            self.total = int(length) if length and length.isdigit() else None
        elif status in (408, 429) or status >= 500:  # the server may answer later: the part is kept
            raise _Retry(DownloadFailure.BUSY, self.error(DownloadErrorKind.HTTP_STATUS, discard=False, status=status))
        else:  # this URL will not give us this file: drop the part
            raise self.error(DownloadErrorKind.HTTP_STATUS, discard=True, status=status)
        if self.total is not None and self.total > self.max_bytes:
            raise self.error(
                DownloadErrorKind.TOO_LARGE, discard=True, status=status, max_bytes=self.max_bytes, announced=self.total
            )
        if self.total is not None and self.expected_size is not None and self.total != self.expected_size:
            raise self.error(
                DownloadErrorKind.SIZE_MISMATCH,
                discard=True,
                status=status,
                expected_size=self.expected_size,
                actual_size=self.total,
            )
        self.etag, self.last_modified = etag, last_modified
        self.save_sidecar()

    async def stream_body(self, response: httpx.Response) -> None:
        """Receive into batches; a writer task hashes and writes them in a thread meanwhile.

        Raised inside the nursery, an error would arrive wrapped in an ExceptionGroup, so
        failures are kept aside, the nursery is cancelled, and they are raised after it.
        """
        cap = self.max_bytes if self.expected_size is None else min(self.max_bytes, self.expected_size)
        cut: httpx.TransportError | None = None
        failure: Exception | None = None
        batch: list[bytes] = []
        send, receive = trio.open_memory_channel[list[bytes]](4)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.write_batches, receive, nursery.cancel_scope)
                pending = 0
                try:
                    async for chunk in response.aiter_raw():
                        if self.received + len(chunk) > cap:
                            over = self.expected_size is not None and cap == self.expected_size
                            failure = self.error(
                                DownloadErrorKind.SIZE_MISMATCH if over else DownloadErrorKind.TOO_LARGE,
                                discard=True,
                                expected_size=self.expected_size,
                                max_bytes=self.max_bytes,
                                actual_size=f">{self.received + len(chunk) - 1}",
                            )
                            nursery.cancel_scope.cancel()
                            break
                        self.received += len(chunk)
                        batch.append(chunk)
                        pending += len(chunk)
                        if pending >= BATCH_BYTES:
                            await send.send(batch)
                            batch, pending = [], 0
                        if self.progress is not None:
                            self.report(final=False)
                except httpx.TransportError as exc:
                    cut = exc  # keep what arrived: the writer drains before we retry
                if failure is None and batch:
                    await send.send(batch)
                    batch = []
                send.close()
        finally:
            # A cut, a cancellation (daemon stopping) or a write error: every byte that
            # arrived and is still queued goes to the part, so a resume loses nothing.
            if failure is None and self.write_failure is None:
                leftovers = []
                while True:
                    try:
                        leftovers.append(receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                leftovers.append(batch)
                if any(leftovers):
                    # Bounded: batches go in order, so stopping early still leaves a prefix.
                    with trio.CancelScope(shield=True, deadline=trio.current_time() + 10):
                        for queued in leftovers:
                            if queued:
                                await trio.to_thread.run_sync(self.write_batch, queued)
        if self.write_failure is not None:
            raise self.error(
                DownloadErrorKind.WRITE_FAILED, discard=False, part=str(self.part), error=str(self.write_failure)
            )
        if failure is not None:
            raise failure
        self.received = self.written
        if cut is not None:
            raise cut

    async def write_batches(self, receive: trio.MemoryReceiveChannel[list[bytes]], scope: trio.CancelScope) -> None:
        async for batch in receive:
            try:
                await trio.to_thread.run_sync(self.write_batch, batch)
            except OSError as exc:
                self.write_failure = exc
                scope.cancel()
                return

    def write_batch(self, batch: list[bytes]) -> None:
        # Runs in a worker thread; sha256 and write release the GIL for large buffers.
        update = self.hasher.update
        for chunk in batch:
            update(chunk)
        size = sum(map(len, batch))
        if len(batch) > 256:  # writev takes at most IOV_MAX (1024 on Linux) buffers
            batch = [b"".join(batch)]
        done = os.writev(self.fd, batch)  # no join: one copy less per byte
        if done < size:  # a short write (rare): finish the rest plainly
            rest = memoryview(b"".join(batch))[done:]
            while rest:
                rest = rest[os.write(self.fd, rest) :]
        before, self.written = self.written, self.written + size
        if self.written // WRITEBACK_BYTES != before // WRITEBACK_BYTES:
            start = (before // WRITEBACK_BYTES) * WRITEBACK_BYTES  # whole 16 MiB windows, once each
            start_writeback(self.fd, start, self.written - start)

    # The end.

    async def finish(self) -> DownloadResult:
        actual = self.hasher.hexdigest()
        if self.expected_size is not None and self.written != self.expected_size:
            raise self.error(
                DownloadErrorKind.SIZE_MISMATCH,
                discard=True,
                expected_size=self.expected_size,
                actual_size=self.written,
            )
        if actual != self.expected_sha256:
            raise self.error(
                DownloadErrorKind.DIGEST_MISMATCH,
                discard=True,
                expected_sha256=self.expected_sha256,
                actual_sha256=actual,
                size=self.written,
            )
        fd, self.fd = self.fd, -1
        await trio.to_thread.run_sync(_commit, fd, self.part, self.dest)
        self.sidecar.unlink(missing_ok=True)
        if self.progress is not None:
            self.report(final=True)
        return DownloadResult(
            path=self.dest,
            sha256=actual,
            size=self.written,
            resumed_from=self.resumed_from,
            attempts=self.attempts,
            elapsed=trio.current_time() - self.started,
        )

    def report(self, *, final: bool) -> None:
        now = trio.current_time()
        elapsed = now - self.last_report
        if not final and elapsed < PROGRESS_INTERVAL and self.last_report >= 0:
            return
        if self.last_report >= 0 and elapsed > 0:
            instant = (self.received - self.last_report_bytes) / elapsed
            self.rate = instant if self.rate == 0 else 0.7 * self.rate + 0.3 * instant
        self.last_report, self.last_report_bytes = now, self.received
        total = self.total if self.total is not None else self.expected_size
        eta = None
        if total is not None and self.rate > 0:
            eta = max(0.0, (total - self.received) / self.rate)
        assert self.progress is not None
        self.progress(DownloadProgress(self.received, total, self.rate, 0.0 if final else eta))


def _commit(fd: int, part: Path, dest: Path) -> None:
    """fsync the part, close it, rename it onto dest, fsync the directory."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, dest)
    fsync_dir(dest.parent)
