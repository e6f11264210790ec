"""What a download reports: progress, the result, the resume sidecar, and precise errors."""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path
from typing import Any

import attrs

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode


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

    resumable = False  # the retry table gave up on a cut or a busy server: the part is kept for later

    def __init__(self, kind: DownloadErrorKind, reason: ReasonCode | str, evidence: dict[str, Any]) -> None:
        self.kind = DownloadErrorKind(kind)
        evidence = {"kind": str(self.kind), **evidence}
        detail = _MESSAGES[self.kind].format_map(_Blank(evidence))
        super().__init__(reason, f"Downloading {evidence.get('url', 'the bundle')} failed: {detail}.", evidence)

    @property
    def cause(self) -> str:
        """Bytes other than the manifest's (a size or a sha256 that differs) are the bundle's
        digest failing; everything else (status, connection, disk) is the download's."""
        digest = self.kind in (DownloadErrorKind.DIGEST_MISMATCH, DownloadErrorKind.SIZE_MISMATCH)
        return str(ReasonCode.BUNDLE_DIGEST_MISMATCH) if digest else "download_failed"


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
