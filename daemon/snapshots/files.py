"""A snapshot file's checks, cheap at restore and complete after the save, and its place in
memory (page cache or disk).

The engine writes a slot file; Stoker renames it into the snapshots dir (0700, the file 0600:
only this user, or root, can change it) and catalogues it with the file's size, mtime, inode
and a digest of its size, head and tail (`sample_digest`). A restore checks those: a file that
was truncated, replaced, rewritten, or torn by a crash before its data reached the disk fails
them (the head holds the engine's header and the conversation's token ids, the tail the last
layer's cells). Reading all of it again is what made Stoker's restore lose to re-prefilling on
a GPU (64-81 % of its time, measured on an H200). The full sha256 is computed after the save, in the
background, and is what vouches for a file whose inode or mtime changed (the snapshots dir
copied or restored from a backup). docs/snapshots.md, "What a restore checks".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import attrs

from stoker.daemon.core.digests import sha256_file
from stoker.store.snapshots import SnapshotRecord

SAMPLE = 64 << 10  # bytes of the head and of the tail that the sample digest covers


@attrs.frozen
class FileFacts:
    """What stat says of a file: enough to tell that it is the one catalogued."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> "FileFacts":
        st = path.stat()
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


def sample_digest(path: Path, size: int) -> str:
    """sha256 of the size, the first and the last SAMPLE bytes (blocking; microseconds)."""
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    fd = os.open(path, os.O_RDONLY)
    try:
        digest.update(os.pread(fd, SAMPLE, 0))
        digest.update(os.pread(fd, SAMPLE, max(0, size - SAMPLE)))
    finally:
        os.close(fd)
    return digest.hexdigest()


def free_bytes(path: Path) -> int | None:
    """Free bytes for this user on the filesystem holding `path`; None if it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@attrs.frozen
class FileCheck:
    """A restore's verdict on a file: ok, how it was checked, and the evidence if not ok."""

    ok: bool
    checked: str  # "stat+sample" | "full_sha256"
    evidence: dict[str, Any] = attrs.field(factory=dict)
    revouched: FileFacts | None = None  # a moved file the full digest vouched for: its new facts


def check_file(path: Path, rec: SnapshotRecord) -> FileCheck:
    """Is `path` still the file catalogued as `rec`? (blocking). Same size, inode and mtime as
    catalogued: the sample digest decides. Another inode or mtime: the full sha256 recorded
    after the save decides, or the file is refused if none was recorded. Rows from before
    these checks were recorded: the full sha256, as they always were."""
    evidence: dict[str, Any] = {"snapshot_id": rec.id, "file": rec.filename, "expected_size": rec.file_size}
    try:
        facts = FileFacts.of(path)
    except OSError as exc:
        return FileCheck(False, "stat", {**evidence, "found_size": None, "error": exc.strerror})
    evidence["found_size"] = facts.size
    if facts.size != rec.file_size:
        return FileCheck(False, "stat", evidence)
    same_place = rec.file_sample_sha256 is not None and (facts.mtime_ns, facts.inode) == (
        rec.file_mtime_ns,
        rec.file_inode,
    )
    if same_place:
        matches = sample_digest(path, facts.size) == rec.file_sample_sha256
        return FileCheck(matches, "stat+sample", {} if matches else {**evidence, "sample_digest_matches": False})
    if rec.file_sha256 is None:
        why = "the file's inode or mtime changed since the save and no full digest was recorded to vouch for it"
        return FileCheck(False, "stat", {**evidence, "why": why})
    matches = sha256_file(path) == rec.file_sha256
    if not matches:
        return FileCheck(False, "full_sha256", {**evidence, "digest_matches": False})
    return FileCheck(True, "full_sha256", revouched=facts if rec.file_sample_sha256 is not None else None)


def seal(path: Path) -> None:
    """fsync the file: its data is on the disk (blocking)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def boot_id() -> str | None:
    """This boot's id (Linux); None elsewhere."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name, use_errno=True) if name else False
        if _LIBC:
            _LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
            _LIBC.mmap.restype = ctypes.c_void_p
            _LIBC.mmap.argtypes = (
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            )
            _LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return _LIBC


RESIDENCY_WINDOWS = 256  # a big file's residency is sampled in this many windows ...
RESIDENCY_WINDOW_PAGES = 64  # ... of this many pages (mincore costs ~50 ns a page: 0.2 s for 16 GiB whole)


def resident_fraction(path: Path) -> float | None:
    """The fraction of the file's pages in the page cache (mincore(2) over evenly spread
    windows for a big file; blocking, nothing read: about a millisecond); None where the
    platform cannot say."""
    libc = _libc()
    if not libc or not hasattr(libc, "mincore"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            page = mmap.PAGESIZE
            pages = (size + page - 1) // page
            if pages <= RESIDENCY_WINDOWS * RESIDENCY_WINDOW_PAGES:
                windows = [(0, pages)]
            else:
                stride = pages // RESIDENCY_WINDOWS
                windows = [(i * stride, RESIDENCY_WINDOW_PAGES) for i in range(RESIDENCY_WINDOWS)]
            seen = resident = 0
            vec = ctypes.create_string_buffer(max(n for _, n in windows))
            for first, n in windows:
                length = min(n * page, size - first * page)
                if libc.mincore(addr + first * page, length, vec) != 0:
                    return None
                counted = (length + page - 1) // page
                seen += counted
                resident += counted - vec.raw[:counted].count(0)
            return resident / seen
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
