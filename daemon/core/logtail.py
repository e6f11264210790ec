"""Reading Stoker's logs as a person does: the last lines, then the lines as they are written.

`last_lines` reaches back into the rotated generations (`name.1`, `name.2`, ...) when the
current file holds fewer lines than asked, so the lines just before a rotation are not lost.
`LogFollower` is `tail -F` for the two ways our logs rotate (daemon/core/logfiles.py):

- the daemon's log is renamed to `.1` and a new file created at the path: the follower reads
  what was left in the old file, then the new one from its start;
- the server's log is trimmed in place (copied to `.1`, emptied, the launch's opening lines
  written back before a `TRIM_NOTE_PREFIX` line): the follower sees the file shrink and goes on
  from the note, without printing again the opening lines it showed before.

A log that does not exist yet (or is removed) is waited for, and followed from its first line
when it appears. Nothing here writes or locks: the daemon may be running or not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import attrs

from stoker.daemon.core.logfiles import TRIM_NOTE_PREFIX

_BLOCK = 64 * 1024
_TRIM_NOTE = TRIM_NOTE_PREFIX.encode()
MAX_GENERATIONS = 100  # `[logs] keep` is at most 100


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _tail_of(path: Path, n: int) -> list[bytes]:
    """The last `n` lines of one file, read backwards by blocks; a missing file has none."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return []
    with fh:
        pos = fh.seek(0, os.SEEK_END)
        data = b""
        while pos > 0 and data.count(b"\n") <= n:
            step = min(_BLOCK, pos)
            pos -= step
            fh.seek(pos)
            data = fh.read(step) + data
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file ends with a newline: no line after it
    return lines[-n:]


def _after_trim(lines: list[bytes]) -> tuple[list[bytes], bool]:
    """Lines from a trim's note on (the opening lines written back before it are copies of lines
    in the generation before), and whether a note was found."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(_TRIM_NOTE):
            return lines[i:], True
    return lines, False


def generation(path: Path, n: int) -> Path:
    """The log's `n`th rotated generation (`name.n`); 0 is the log itself."""
    return path if n == 0 else path.with_name(f"{path.name}.{n}")


def last_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of the log at `path`, continued into `path.1`, `path.2`... when the
    current file holds fewer (just after a rotation or a trim). A missing log gives []."""
    gathered: list[bytes] = []
    for older in range(MAX_GENERATIONS + 1):
        if len(gathered) >= n:
            break
        current = generation(path, older)
        if older > 0 and not current.exists():
            break
        lines, _ = _after_trim(_tail_of(current, n - len(gathered)))
        gathered = lines + gathered
    return [_decode(line) for line in gathered[-n:]] if n > 0 else []


@attrs.frozen
class FollowedLine:
    """A line of the log, or a notice about the file itself (rotated, trimmed, appeared)."""

    text: str
    notice: bool = False


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


@attrs.define(eq=False)
class LogFollower:
    """`tail -F` on one log: `poll()` returns what was written since the last poll."""

    path: Path
    _fh: BinaryIO | None = None
    _identity: tuple[int, int] | None = None
    _pos: int = 0
    _partial: bytes = b""
    _after_truncation: bool = False  # the next bytes read start a trimmed file
    _missing_said: bool = False

    @classmethod
    def from_end(cls, path: Path) -> LogFollower:
        """Follow `path` from its current end (what `last_lines` printed is not repeated)."""
        follower = cls(path)
        if follower._open():
            assert follower._fh is not None
            follower._pos = follower._fh.seek(0, os.SEEK_END)
        return follower

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _open(self) -> bool:
        try:
            fh = open(self.path, "rb")
        except FileNotFoundError:
            return False
        self._fh = fh
        self._identity = _identity(os.fstat(fh.fileno()))
        self._pos = 0
        self._partial = b""
        return True

    def _read(self, *, final: bool = False) -> list[FollowedLine]:
        """What the open file gained since the last read, as whole lines (`final`: the file is
        left for good, so an unfinished last line is given as it is)."""
        assert self._fh is not None
        self._fh.seek(self._pos)
        data = self._fh.read()
        self._pos += len(data)
        if not data and not final:
            return []
        if self._after_truncation and data:
            self._after_truncation = False
            note = data.find(_TRIM_NOTE)
            if note >= 0 and (note == 0 or data[note - 1 : note] == b"\n"):
                data = data[note:]
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [FollowedLine(_decode(line)) for line in lines]

    def poll(self) -> list[FollowedLine]:
        """New lines since the last poll, with a notice when the file was rotated, trimmed,
        removed or (re)created."""
        out: list[FollowedLine] = []
        if self._fh is None:
            if not self._open():
                if not self._missing_said:
                    self._missing_said = True
                    out.append(FollowedLine(f"{self.path} does not exist yet; waiting for it", notice=True))
                return out
            if self._missing_said:
                out.append(FollowedLine(f"{self.path} appeared; following it", notice=True))
            self._missing_said = False
        out += self._read()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return out  # renamed away mid-rotation, or removed: the new file is picked up when it appears
        if _identity(st) != self._identity:
            out += self._read(final=True)  # what was written to the old file before it was replaced
            self.close()
            if self._open():
                out.append(FollowedLine(f"{self.path} was rotated; following the new file", notice=True))
                out += self._read()
        elif st.st_size < self._pos:
            self._pos = 0
            self._partial = b""
            self._after_truncation = True
            out.append(
                FollowedLine(
                    f"{self.path} was trimmed or truncated; following what is written from now on", notice=True
                )
            )
            out += self._read()
        return out
