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

import enum
import functools
import hashlib
import json
import os
import re
import ssl
import urllib.request
from pathlib import Path
from typing import Any, Callable

import attrs
import certifi
import httpcore
import httpx
import trio

from daemon.errors import StokerError
from states.reasons import ReasonCode

# Bytes handed to the writer thread at once: big enough that thread hand-offs are rare,
# small enough that a cancelled download loses little.
BATCH_BYTES = 1024 * 1024
# The most one socket read may return (see download_client).
READ_BYTES = 1024 * 1024
PROGRESS_INTERVAL = 0.1
MAX_RESTARTS = 3
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class DownloadErrorKind(enum.StrEnum):
    HTTP_STATUS = "http_status"  # 4xx/5xx (or an unexpected status)
    TOO_LARGE = "too_large"  # announced or streamed size over max_bytes
    SIZE_MISMATCH = "size_mismatch"  # size differs from expected_size
    DIGEST_MISMATCH = "digest_mismatch"  # sha256 differs from expected_sha256
    RANGE_MISMATCH = "range_mismatch"  # 206 at the wrong offset, or a malformed Content-Range
    CONTENT_CHANGED = "content_changed"  # the file kept changing under us (ETag) restart after restart
    CONNECTION = "connection"  # the connection failed more times than the retries allow
    WRITE_FAILED = "write_failed"  # the part could not be written (disk full, permissions)


_MESSAGES = {
    DownloadErrorKind.HTTP_STATUS: "the server answered HTTP {status}; check the bundle URL in the manifest",
    DownloadErrorKind.TOO_LARGE: "the file is larger than the {max_bytes}-byte cap; the manifest or server is wrong",
    DownloadErrorKind.SIZE_MISMATCH: "the file is {actual_size} bytes, the manifest says {expected_size}",
    DownloadErrorKind.DIGEST_MISMATCH: "the file's sha256 does not match the manifest (corrupt or tampered with)",
    DownloadErrorKind.RANGE_MISMATCH: "the server resumed at the wrong offset; the partial file was discarded",
    DownloadErrorKind.CONTENT_CHANGED: "the file on the server kept changing while it was downloaded",
    DownloadErrorKind.CONNECTION: "the connection failed {attempts} times; the partial file is kept, retry to resume",
    DownloadErrorKind.WRITE_FAILED: "writing {part} failed ({error}); free disk space and retry",
}


class DownloadError(StokerError):
    """A failed download: the caller's reason code plus a precise `kind` and evidence."""

    def __init__(self, kind: DownloadErrorKind, reason: ReasonCode | str, evidence: dict[str, Any]) -> None:
        self.kind = DownloadErrorKind(kind)
        evidence = {"kind": str(self.kind), **evidence}
        detail = _MESSAGES[self.kind].format_map(_Blank(evidence))
        super().__init__(reason, f"Downloading {evidence.get('url', 'the bundle')} failed: {detail}.", evidence)


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return "?"


@attrs.frozen
class DownloadProgress:
    """A progress event: bytes so far, total if known, smoothed rate (bytes/s), eta (s)."""

    bytes_done: int
    total: int | None
    rate: float
    eta: float | None


@attrs.frozen
class DownloadResult:
    """A completed download."""

    path: Path
    sha256: str
    size: int
    resumed_from: int  # bytes reused from a part left by an earlier run
    attempts: int  # HTTP requests made
    elapsed: float


@attrs.frozen
class PartSidecar:
    """What `DEST.part.json` records so that a restarted daemon can resume."""

    url: str
    sha256: str
    etag: str | None
    last_modified: str | None
    bytes: int

    @property
    def validator(self) -> str | None:
        return self.etag or self.last_modified

    @classmethod
    def load(cls, path: Path) -> PartSidecar | None:
        """Read a sidecar; None when absent or unreadable."""
        try:
            raw = json.loads(path.read_text())
            return cls(
                url=str(raw["url"]),
                sha256=str(raw["sha256"]),
                etag=raw.get("etag"),
                last_modified=raw.get("last_modified"),
                bytes=int(raw.get("bytes", 0)),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, path: Path) -> None:
        """Write atomically (tmp + rename): a torn sidecar must never be read back."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(attrs.asdict(self)))
        os.replace(tmp, path)


class _Retry(Exception):
    """The connection failed mid-transfer; resume from what was written."""


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
    retries: int = 5,
    backoff: float = 0.5,
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
        return await transfer.run(client, retries=retries, backoff=backoff)
    async with download_client() as own:
        return await transfer.run(own, retries=retries, backoff=backoff)


def download_client() -> httpx.AsyncClient:
    """An httpx client for bundle downloads: 1 MiB socket reads, proxies from the environment.

    httpcore reads the socket 64 KiB at a time, and each read is a trip through the event loop
    and h11: on loopback that alone halves the throughput (about 190 against 420 MB/s on the
    2-core development machine). httpcore's public network-backend hook lets one client read
    wider without touching anyone else's. Behind a proxy (HTTP(S)_PROXY/ALL_PROXY) the stock
    transport is used, since a custom transport turns httpx's environment proxies off.
    """
    timeout = httpx.Timeout(30.0, connect=10.0)
    env = {k.lower() for k, v in urllib.request.getproxies().items() if v and k.lower() != "no"}
    transport = _wide_read_transport() if not env else None
    return httpx.AsyncClient(timeout=timeout, verify=_tls_context(), transport=transport)


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

    async def run(self, client: httpx.AsyncClient, *, retries: int, backoff: float) -> DownloadResult:
        try:
            return await self.run_attempts(client, retries=retries, backoff=backoff)
        except OSError as exc:  # the local side: mkdir, open, fsync, rename
            raise self.error(DownloadErrorKind.WRITE_FAILED, discard=False, part=str(self.part), error=str(exc)) from exc

    async def run_attempts(self, client: httpx.AsyncClient, *, retries: int, backoff: float) -> DownloadResult:
        self.started = trio.current_time()
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            await self.open_part()
            failures = 0
            while True:
                if self.expected_size is not None and self.written == self.expected_size:
                    break  # a complete part from an earlier run: only the checks are left
                try:
                    await self.attempt(client)
                    break
                except _Retry as cut:
                    failures += 1
                    if failures > retries:
                        self.save_sidecar()
                        raise self.error(
                            DownloadErrorKind.CONNECTION, discard=False, attempts=failures, cause=str(cut)
                        ) from None
                    await trio.sleep(min(backoff * 2 ** (failures - 1), 30.0))
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
            self.hasher = await trio.to_thread.run_sync(_hash_prefix, self.part, size)
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
            async with client.stream(
                "GET", self.url, headers=headers, follow_redirects=True
            ) as response:
                self.accept(response, offset)
                await self.stream_body(response)
        except httpx.TransportError as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
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
        else:
            # 4xx means this URL will not give us this file: drop the part. 5xx may pass.
            raise self.error(
                DownloadErrorKind.HTTP_STATUS, discard=400 <= status < 500, status=status
            )
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
        self.written += size

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


class _WideReadStream(httpcore.AsyncNetworkStream):
    """A network stream that reads up to READ_BYTES whatever httpcore asks for."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max(max_bytes, READ_BYTES), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        return _WideReadStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _WideReadBackend(httpcore.AsyncNetworkBackend):
    """httpcore's trio (or anyio) backend, with wide reads."""

    def _inner(self) -> httpcore.AsyncNetworkBackend:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:  # not on trio (asyncio through anyio)
            return httpcore.AnyIOBackend()
        return httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner().connect_tcp(host, port, timeout, local_address, socket_options)
        return _WideReadStream(stream)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        return _WideReadStream(await self._inner().connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner().sleep(seconds)


def _wide_read_transport() -> httpx.AsyncHTTPTransport | None:
    """httpx's own transport over a wide-read connection pool; None if httpx changed shape."""
    transport = httpx.AsyncHTTPTransport(verify=_tls_context())
    if not isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool):
        return None  # a future httpx: fall back to the stock transport (slower, still right)
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=_tls_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_WideReadBackend(),
    )
    return transport


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process: loading the CA bundle costs ~0.1 s each time."""
    return ssl.create_default_context(cafile=certifi.where())


def _hash_prefix(path: Path, size: int) -> Any:
    """sha256 of the first `size` bytes of a file, streamed."""
    hasher = hashlib.sha256()
    buf = bytearray(BATCH_BYTES)
    view = memoryview(buf)
    left = size
    with open(path, "rb", buffering=0) as f:
        while left:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                break
            hasher.update(view[:n])
            left -= n
    return hasher


def _commit(fd: int, part: Path, dest: Path) -> None:
    """fsync the part, close it, rename it onto dest, fsync the directory."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, dest)
    dir_fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
