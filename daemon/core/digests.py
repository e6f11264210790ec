"""Files on disk: their sha256 (streamed in 1 MiB blocks) and making a rename durable."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

BLOCK = 1 << 20


def sha256_file(path: Path | str) -> str:
    """The hex sha256 of a file's contents, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path | str) -> None:
    """fsync a directory, so that a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
