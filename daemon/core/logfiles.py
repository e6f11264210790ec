"""Log files that cannot fill a disk: size-capped, a few generations kept, readable by their owner.

Two writers, two ways to rotate:
- the daemon's own log (`logs/daemon.log`) goes through `DaemonLogHandler`, the standard
  library's size-based rotation, with files created 0600 and a refused write (a full disk)
  reported once on stderr instead of a traceback per line;
- llama-server writes its log itself, through a file descriptor it holds (so that it survives a
  daemon killed with -9), so its log cannot be renamed under it. `open_server_log` rotates the
  generations before a launch when the file is over the cap, and `trim_server_log` caps a live
  one: copy to `.1`, truncate, and write back the launch's opening lines (the launch header and
  the load lines that readers such as the KV layout parser look for), as logrotate's
  copytruncate does. Lines the server writes during the copy may be lost; nothing else is.

Generations: `name`, `name.1` (the newest rotated), ... `name.<keep>`; older ones are removed.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import shutil
import sys
import time
from pathlib import Path
from typing import BinaryIO

import attrs

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

DEFAULT_MAX_BYTES = 10 * 2**20
DEFAULT_KEEP = 3
# What of a live server log is written back after a trim: its launch's opening lines, where
# the engine states the model, devices and KV layout (about 16 KB at -lv 4), at most this much.
LAUNCH_PREAMBLE_BYTES = 1 << 20
FILE_MODE = 0o600
# The line a trim writes after the launch's opening lines: readers that follow the log
# (daemon/core/logtail.py) know from it where the lines written after the trim begin.
TRIM_NOTE_PREFIX = "==== stoker: log trimmed at "


@attrs.frozen
class LogRotation:
    """How big a log may grow, and how many rotated generations are kept beside it."""

    max_bytes: int = DEFAULT_MAX_BYTES
    keep: int = DEFAULT_KEEP


def _generation(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def _shift(path: Path, keep: int) -> None:
    """Make room for a new `path.1`: `path.1` -> `path.2` ...; the one beyond `keep` goes."""
    _generation(path, keep).unlink(missing_ok=True)
    for n in range(keep - 1, 0, -1):
        older = _generation(path, n)
        if older.exists():
            os.replace(older, _generation(path, n + 1))


def rotate(path: Path, keep: int) -> None:
    """Shift `path` -> `path.1` -> ... -> `path.<keep>`; the oldest beyond `keep` is removed."""
    if keep <= 0:
        path.unlink(missing_ok=True)
        return
    _shift(path, keep)
    if path.exists():
        os.replace(path, _generation(path, 1))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def open_private_append(path: Path) -> BinaryIO:
    """Open `path` for appending, created 0600 (an existing looser one tightened)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def open_server_log(path: Path, rotation: LogRotation) -> BinaryIO:
    """The server log, opened for appending after rotating it if it is over the cap."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if _size(path) >= rotation.max_bytes:
        rotate(path, rotation.keep)
    return open_private_append(path)


def trim_server_log(path: Path, rotation: LogRotation, launch_offset: int) -> int | None:
    """Cap a live server log: copy it to `.1`, empty it, and write back its launch's opening lines
    (from `launch_offset`). Returns the file's new size (where a reader goes on from), or None
    when it was under the cap or could not be trimmed (a full disk: it stays as it is)."""
    size = _size(path)
    if size < rotation.max_bytes:
        return None
    try:
        with open(path, "rb") as fh:
            fh.seek(min(launch_offset, size))
            preamble = fh.read(min(LAUNCH_PREAMBLE_BYTES, rotation.max_bytes // 4))
        if rotation.keep > 0:
            _shift(path, rotation.keep)
            newest = _generation(path, 1)
            shutil.copyfile(path, newest)
            os.chmod(newest, FILE_MODE)
        cut = preamble.rfind(b"\n") + 1  # whole lines only
        with open_private_append(path) as out:
            out.truncate(0)
            note = f"{TRIM_NOTE_PREFIX}{time.strftime('%Y-%m-%dT%H:%M:%S%z')}; earlier lines in {path.name}.1\n"
            out.write(preamble[:cut] + note.encode())
            return out.tell()
    except OSError:
        return None


def files_unwritable(what: str, path: Path, exc: OSError) -> StokerError:
    """server_files_unwritable: which file, and why, in the words of the error (never "reinstall
    the bundle": the engine is fine, the disk refuses its files)."""
    why = exc.strerror or str(exc)
    return StokerError(
        ReasonCode.SERVER_FILES_UNWRITABLE,
        f"The {what} {path} cannot be written ({why}); free space on that disk or fix its permissions, "
        f"then `stoker up`.",
        {"path": str(path), "error": f"{type(exc).__name__}: {why}", "errno": exc.errno},
    )


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, FILE_MODE)


class DaemonLogHandler(logging.handlers.RotatingFileHandler):
    """The daemon's log file: rotated by size, created 0600, quiet when the disk refuses it."""

    def __init__(self, path: Path, rotation: LogRotation) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.exists() and path.stat().st_mode & 0o077:
            os.chmod(path, FILE_MODE)
        self._failing = False  # the last write was refused (and said so once)
        self._refused = False
        # The record last formatted and its text: the rotation check formats each record, and
        # the write formats it again (the standard handler's two calls, one time stamp each).
        self._formatted: tuple[logging.LogRecord, str] | None = None
        super().__init__(path, maxBytes=rotation.max_bytes, backupCount=rotation.keep, encoding="utf-8", delay=True)

    def _open(self):  # type: ignore[no-untyped-def]  # overrides the standard library's untyped method
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors, opener=_private_opener)

    def format(self, record: logging.LogRecord) -> str:
        formatted = self._formatted
        if formatted is not None and formatted[0] is record:
            return formatted[1]
        text = super().format(record)
        self._formatted = (record, text)
        return text

    def emit(self, record: logging.LogRecord) -> None:
        self._refused = False
        try:
            super().emit(record)
        finally:
            self._formatted = None
        if not self._refused:
            self._failing = False

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            pass  # what a full disk refused is lost; closing must not fail the daemon's exit

    def handleError(self, record: logging.LogRecord) -> None:
        # A full disk would print a traceback for every line: say it once, until a write works.
        self._refused = True
        if not self._failing:
            self._failing = True
            print(f"stoker: cannot write the daemon log {self.baseFilename}: {sys.exc_info()[1]}", file=sys.stderr)
