"""A download's part written with O_DIRECT where it can be (daemon/core/part_sink.py `PartSink`):
whole aligned blocks from page-aligned buffers go through the O_DIRECT descriptor, anything
else (an unaligned chunk, a resumed part's odd offset, a filesystem that refuses) is written
buffered, and the part holds the same bytes either way."""

from __future__ import annotations

import mmap
import os

import pytest

from stoker.daemon.core import part_sink
from stoker.daemon.core.part_sink import DIRECT_ALIGN, PartDigests, PartSink, open_direct


def chunk(seed: int, size: int = 1 << 20) -> mmap.mmap:
    block = mmap.mmap(-1, size)
    block.write(bytes([seed % 251]) * size)
    return block


def write_all(part, chunks, *, start=0, direct=True, monkeypatch=None):
    seen: list[int] = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        seen.append(fd)
        return real(fd, data, offset)

    monkeypatch.setattr(part_sink.os, "pwrite", pwrite)
    with open(part, "r+b" if part.exists() else "w+b", buffering=0) as fh, open_direct(part) as direct_fd:
        fh.truncate(start)
        digests = PartDigests()
        digests.next_piece(0)
        sink = PartSink(fh, digests, start, direct_fd=direct_fd if direct else None)
        for data in chunks:
            sink.put(data)
        sink.drain()
        sink.close()
        return sink, fh.fileno(), direct_fd, seen


def test_aligned_blocks_go_direct_and_the_unaligned_tail_buffered(tmp_path, monkeypatch):
    part = tmp_path / "model.part"
    blocks = [chunk(i) for i in range(4)] + [b"tail-not-aligned"]
    sink, buffered_fd, direct_fd, seen = write_all(part, blocks, monkeypatch=monkeypatch)
    if direct_fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert seen == [direct_fd] * 4 + [buffered_fd]
    expected = b"".join(bytes(b) for b in blocks)
    assert part.read_bytes() == expected and sink.written == len(expected)


def test_a_resumed_part_at_an_odd_offset_is_written_buffered_and_whole(tmp_path, monkeypatch):
    part = tmp_path / "model.part"
    part.write_bytes(b"x" * 1000)  # what an earlier pull left: not a multiple of DIRECT_ALIGN
    blocks = [chunk(i) for i in range(3)]
    sink, buffered_fd, direct_fd, seen = write_all(part, blocks, start=1000, monkeypatch=monkeypatch)
    assert 1000 % DIRECT_ALIGN and seen == [buffered_fd] * 3
    assert part.read_bytes() == b"x" * 1000 + b"".join(bytes(b) for b in blocks)


def test_without_o_direct_every_block_is_buffered_with_the_same_bytes(tmp_path, monkeypatch):
    part = tmp_path / "model.part"
    blocks = [chunk(i) for i in range(3)]
    sink, buffered_fd, _, seen = write_all(part, blocks, direct=False, monkeypatch=monkeypatch)
    assert seen == [buffered_fd] * 3
    assert part.read_bytes() == b"".join(bytes(b) for b in blocks)
