"""Archives: bundle zips written deterministically; every archive (a bundle's zip, its copy from a
file:// mirror, an engine source's tarball) checked against the sha256 and size its source
lists (`check_digest`); a zip unpacked only after every entry has been judged.

Unpacking is two passes. The first reads only the central directory and refuses the whole
archive on any entry that could write outside the staging directory or exhaust the disk:
absolute names, `..`, links, devices, encrypted entries, duplicates, paths too deep or too
long for a filesystem, absurd sizes, counts or compression ratios. Only then does the second pass write, and only regular files and
directories, each opened with O_EXCL|O_NOFOLLOW under the staging root, counting bytes as
they come instead of trusting the declared sizes.
"""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from stoker.daemon.core.confined import confined
from stoker.daemon.core.digests import sha256_file
from stoker.daemon.core.errors import StokerError
from stoker.daemon.bundles.metadata import BUNDLE_JSON
from stoker.states.reasons import ReasonCode

_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: same inputs, same bytes
_CHUNK = 1 << 20


@attrs.frozen
class ArchiveLimits:
    max_entries: int = 1024
    max_file_size: int = 4 << 30
    max_total_size: int = 8 << 30  # a multi-arch CUDA bundle with its runtime is a few GiB
    max_ratio: float = 200.0  # shared libraries deflate 3-5x; a bomb deflates 1000x
    ratio_floor: int = 1 << 20  # tiny files may compress absurdly without harm
    # A bundle's paths are a few levels deep (bin/, lib/); 2000 nested levels crashed the
    # installer (Path.mkdir(parents=True) recurses once per level) and no filesystem takes them.
    max_depth: int = 32
    max_name_bytes: int = 1024  # the whole entry path, well under PATH_MAX with the staging prefix
    max_part_bytes: int = 255  # NAME_MAX of common filesystems


def check_digest(
    path: Path,
    sha256: str,
    size: int | None,
    *,
    reason: ReasonCode = ReasonCode.BUNDLE_DIGEST_MISMATCH,
    discard: bool = False,
    **evidence: Any,
) -> dict[str, Any]:
    """The archive at `path` is the one its source lists: its sha256 and size (when stated), else
    `reason` with both figures, the file removed when `discard` (a copy Stoker made, never a
    user's own file). Its figures when it is."""
    actual_size = path.stat().st_size
    actual = sha256_file(path)
    if actual != sha256 or (size is not None and actual_size != size):
        if discard:
            path.unlink(missing_ok=True)
        raise StokerError(
            reason,
            f"{path.name} does not match the sha256 and size its source lists (corrupt, or not that file).",
            {
                **evidence,
                "file": str(path),
                "expected_sha256": sha256,
                "actual_sha256": actual,
                "expected_size": size,
                "actual_size": actual_size,
            },
        )
    return {"sha256": actual, "size": actual_size}


def _unsafe(why: str, **evidence: Any) -> StokerError:
    return StokerError(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, f"The bundle archive was refused: {why}.", evidence)


def _check_name(name: str, limits: ArchiveLimits) -> PurePosixPath:
    if not name or "\x00" in name or "\\" in name:
        raise _unsafe("an entry name is empty or has a NUL or backslash", entry=name)
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise _unsafe("an entry has an absolute path", entry=name)
    parts = name.rstrip("/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise _unsafe("an entry path escapes the bundle or is not normalised", entry=name[:200])
    longest = max(len(p.encode()) for p in parts)
    if len(parts) > limits.max_depth or len(name.encode()) > limits.max_name_bytes or longest > limits.max_part_bytes:
        raise _unsafe(
            "an entry path is too deep or too long",
            entry=name[:200],
            depth=len(parts),
            name_bytes=len(name.encode()),
            longest_part_bytes=longest,
        )
    return PurePosixPath(*parts)


def _kind(info: zipfile.ZipInfo) -> str:
    mode = info.external_attr >> 16
    fmt = stat.S_IFMT(mode)
    if info.is_dir() and fmt in (0, stat.S_IFDIR):
        return "dir"
    if fmt in (0, stat.S_IFREG):
        return "file"
    return {
        stat.S_IFLNK: "symlink",
        stat.S_IFCHR: "char device",
        stat.S_IFBLK: "block device",
        stat.S_IFIFO: "fifo",
        stat.S_IFSOCK: "socket",
        stat.S_IFDIR: "dir",
    }.get(fmt, "special file")


def scan(zf: zipfile.ZipFile, limits: ArchiveLimits) -> list[tuple[zipfile.ZipInfo, PurePosixPath, str]]:
    """Judge every entry from the central directory; raise before anything is written."""
    infos = zf.infolist()
    if len(infos) > limits.max_entries:
        raise _unsafe("too many entries", entries=len(infos), limit=limits.max_entries)
    seen: set[str] = set()
    total = 0
    judged = []
    for info in infos:
        path = _check_name(info.filename, limits)
        kind = _kind(info)
        if kind not in ("file", "dir"):
            raise _unsafe(f"an entry is a {kind}", entry=info.filename, kind=kind)
        if info.flag_bits & 0x1:
            raise _unsafe("an entry is encrypted", entry=info.filename)
        folded = path.as_posix().lower()  # case-insensitive filesystems would merge these
        if folded in seen:
            raise _unsafe("an entry is listed twice", entry=info.filename)
        seen.add(folded)
        if kind == "file":
            if info.file_size > limits.max_file_size:
                raise _unsafe("an entry is absurdly large", entry=info.filename, size=info.file_size)
            total += info.file_size
            if total > limits.max_total_size:
                raise _unsafe("the archive expands to an absurd size", total=total)
            ratio = info.file_size / max(info.compress_size, 1)
            if info.file_size > limits.ratio_floor and ratio > limits.max_ratio:
                raise _unsafe(
                    "an entry has an absurd compression ratio (zip bomb)", entry=info.filename, ratio=round(ratio, 1)
                )
        judged.append((info, path, kind))
    # A file may not also be a directory prefix of another entry (it would be clobbered).
    files = {p.as_posix() for _, p, k in judged if k == "file"}
    for _, path, _ in judged:
        for parent in path.parents:
            if parent.as_posix() in files:
                raise _unsafe("an entry is nested under a file", entry=path.as_posix())
    return judged


def _write_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path, limits: ArchiveLimits) -> None:
    mode = (info.external_attr >> 16) & 0o777
    # Executable stays executable; nothing becomes setuid or world-writable.
    mode = 0o755 if mode & 0o111 else 0o644
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(dest, flags, mode)
    written = 0
    try:
        with os.fdopen(fd, "wb") as out, zf.open(info) as src:
            while True:
                chunk = src.read(_CHUNK)
                if not chunk:
                    break
                written += len(chunk)
                if written > info.file_size or written > limits.max_file_size:
                    raise _unsafe("an entry expands past its declared size", entry=info.filename)
                out.write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        # Corrupt content (a flipped byte) fails the zip's CRC or deflate: the digest gate.
        raise StokerError(
            ReasonCode.BUNDLE_DIGEST_MISMATCH, evidence={"entry": info.filename, "error": str(err)}
        ) from None
    os.chmod(dest, mode)


def unpack_bundle(zip_path: Path, staging: Path, limits: ArchiveLimits = ArchiveLimits()) -> Path:
    """Unpack a bundle zip into the empty directory `staging`; refuse an unsafe archive whole."""
    staging = Path(staging)
    staging.mkdir(parents=True, exist_ok=True)
    if any(staging.iterdir()):
        raise ValueError(f"staging directory {staging} is not empty")
    try:
        zf = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as err:
        raise _unsafe("it is not a readable zip archive", file=str(zip_path), error=str(err)) from None
    with zf:
        judged = scan(zf, limits)
        root = staging.resolve()
        for info, path, kind in judged:
            # Belt and braces after the name checks above: resolved, the entry stays in staging.
            dest = confined(root, path.as_posix(), reason=ReasonCode.BUNDLE_UNSAFE_ARCHIVE, what="The bundle archive")
            if kind == "dir":
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            _write_entry(zf, info, dest, limits)
    return staging


def pack_bundle(src_dir: Path, zip_path: Path) -> Path:
    """Zip a bundle directory deterministically: sorted entries, fixed dates, modes kept."""
    src_dir = Path(src_dir)
    files = sorted(p for p in src_dir.rglob("*") if p.is_file() and not p.is_symlink())
    # bundle.json first, so a reader that streams can decide early.
    files.sort(key=lambda p: (p.relative_to(src_dir).as_posix() != BUNDLE_JSON, p.relative_to(src_dir).as_posix()))
    tmp = zip_path.with_name(zip_path.name + ".part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for path in files:
            info = zipfile.ZipInfo(path.relative_to(src_dir).as_posix(), date_time=_EPOCH)
            mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.create_system = 3  # unix, so the mode bits are honoured
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(path, "rb") as src, zf.open(info, "w") as dst:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
    os.replace(tmp, zip_path)
    return zip_path
