"""A model file's identity for KV snapshots, from reads that do not grow with the model's size.

A snapshot must only be restored into a server running the model that wrote it (the engine
checks tensor shapes, never which weights). A sha256 of the whole file says that, at the cost
of reading it: 12-13 s for a 13.5 GiB model, on the ready path of every new model file. The
model id here is a sha256 over what tells two GGUF files apart without reading their weights
in full:

- the file's size;
- its whole header: every metadata key and value (architecture, shapes, name, tokenizer)
  and every tensor's name, shape, type and offset;
- 4 KiB at the start and 4 KiB in the middle of every tensor's data (at most MAX_SAMPLES
  reads, spread evenly where a model has more tensors), and the file's last 4 KiB.

A fine-tune changes every tensor it trains, so it changes the sampled blocks of each; a
re-quantization changes types and sizes in the header; another model changes the header. What
it cannot see is an edit confined to bytes between the samples of every tensor it touches,
which no training or conversion tool makes. The cost: the header (a few MB at most, for a
large vocabulary) and a few hundred 4 KiB reads, from the page cache the engine just filled:
milliseconds, whatever the model's size. It is content-based, so a model copied or moved
keeps its snapshots. Results are cached by path, size, mtime, inode and ctime.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import attrs

from stoker.daemon.models.facts import read_layout

ID_PREFIX = "gguf-s1-"  # the scheme's version: a change of what is hashed changes the prefix
BLOCK = 4096
MAX_SAMPLES = 4096


@attrs.frozen
class ModelIdentity:
    """A model file's id and what reading it cost."""

    model_id: str
    size: int
    bytes_read: int


_CACHE: dict[tuple[str, int, int, int, int], ModelIdentity] = {}


def _sample_offsets(layout_offsets: tuple[int, ...], data_offset: int, size: int) -> list[int]:
    starts = sorted(data_offset + o for o in layout_offsets if data_offset + o < size)
    ends = starts[1:] + [size]
    points: list[int] = []
    for start, end in zip(starts, ends):
        points += [start, start + max(0, (end - start) // 2 - BLOCK // 2)]
    if len(points) > MAX_SAMPLES:
        step = len(points) / MAX_SAMPLES
        points = [points[int(i * step)] for i in range(MAX_SAMPLES)]
    points.append(max(0, size - BLOCK))
    return points


def _compute(path: Path, size: int) -> ModelIdentity:
    layout = read_layout(path)
    digest = hashlib.sha256()
    digest.update(ID_PREFIX.encode() + size.to_bytes(8, "little"))
    read = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        header = os.pread(fd, layout.data_offset, 0)
        digest.update(header)
        read += len(header)
        for offset in _sample_offsets(layout.tensor_offsets, layout.data_offset, size):
            block = os.pread(fd, BLOCK, offset)
            digest.update(offset.to_bytes(8, "little") + block)
            read += len(block)
    finally:
        os.close(fd)
    return ModelIdentity(ID_PREFIX + digest.hexdigest(), size, read)


def model_identity(path: str | Path) -> ModelIdentity:
    """The model file's id (blocking; milliseconds). Raises OSError, or ValueError for a file
    that is not a readable GGUF."""
    path = Path(path)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    found = _CACHE.get(key)
    if found is None:
        if len(_CACHE) >= 64:
            _CACHE.clear()
        found = _CACHE[key] = _compute(path, st.st_size)
    return found
