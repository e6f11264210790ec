"""A pull's bytes under faults: a Hub file's body is read by daemon/core/download.py (http.client
into reused buffers) and hashed and written by daemon/core/part_sink.py's threads. Whatever
the server does, the part ends up holding exactly a prefix of the file and the digests cover
exactly its bytes: a cut connection is continued with a Range from where the bytes stopped, a
server that ignores the Range has the part start over, a chunked body
is read whole, more bytes than the source stated are refused, an error status is a reason, a
cancelled pull keeps its prefix and the next one finishes it, a full disk mid-download is
pull_disk_full with the part a prefix.

The server is the loopback fault server (tests/httpfault.py, real sockets); `fetch_pieces` is
the pull service's own call (docs/reliability.md, "Model pull transfers").
"""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import pytest

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core import download
from stoker.daemon.core.part_sink import DownloadCancelled
from stoker.daemon.models import fetch
from stoker.daemon.models.hub import HubOptions
from stoker.states.download_retry import RETRY_TABLE, DownloadFailure
from stoker.states.pull.table import Piece
from stoker.states.reasons import ReasonCode
from tests.faults.test_pulls import _mount_small_disk
from tests.httpfault import Fault, FaultServer

DATA = random.Random(14).randbytes(6 * 2**20 + 12345)  # several of the reader's 1 MiB buffers, and a bit
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def server():
    with FaultServer() as srv:
        yield srv


WAITS: list[float] = []


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    """The retry table's waits are recorded, not slept (a direct blocking call sleeps for real)."""
    WAITS.clear()
    monkeypatch.setattr(download, "_wait", WAITS.append)


def pull(url: str, part: Path, *, size: int = len(DATA), resume: bool = False, **kw) -> fetch.FetchResult:
    progress: list[int] = []
    result = fetch.fetch_pieces(
        (Piece(url=url, size=size, sha256=SHA),),
        part,
        resume=resume,
        hub_options=HubOptions(),
        progress=lambda done, total: progress.append(done),
        cancelled=kw.get("cancelled") or threading.Event(),
    )
    assert progress == sorted(progress) and progress[-1] == result.size
    return result


def test_a_cut_connection_is_continued_where_the_bytes_stopped(server, tmp_path):
    url = server.add("/m.gguf", DATA, Fault(cut_after=1_500_000, cut_times=2))
    result = pull(url, tmp_path / "m.part")
    assert (result.size, result.sha256, result.piece_sha256) == (len(DATA), SHA, (SHA,))
    assert (tmp_path / "m.part").read_bytes() == DATA
    ranges = [r.range for r in server.requests("/m.gguf")]
    assert ranges == [None, "bytes=1500000-", "bytes=3000000-"], ranges  # nothing fetched twice


def test_a_server_that_ignores_the_range_has_the_part_start_over_not_doubled(server, tmp_path):
    part = tmp_path / "m.part"
    part.write_bytes(DATA[:2_000_000])  # a pull stopped there
    url = server.add("/m.gguf", DATA, Fault(ignore_range=True))
    result = pull(url, part, resume=True)
    assert (result.size, result.sha256, result.resumed_from) == (len(DATA), SHA, 2_000_000)
    assert part.read_bytes() == DATA
    assert [(r.range, r.status) for r in server.requests("/m.gguf")] == [("bytes=2000000-", 200)]


def test_a_chunked_body_without_a_length_is_read_whole(server, tmp_path):
    url = server.add("/m.gguf", DATA, Fault(chunked=True))
    result = pull(url, tmp_path / "m.part")
    assert (result.size, result.sha256) == (len(DATA), SHA)


def test_more_bytes_than_the_source_stated_are_refused(server, tmp_path):
    url = server.add("/m.gguf", DATA)
    with pytest.raises(StokerError) as err:
        pull(url, tmp_path / "m.part", size=len(DATA) - 100)
    assert err.value.reason is ReasonCode.PULL_CHECKSUM_MISMATCH
    assert DATA.startswith((tmp_path / "m.part").read_bytes())  # what was kept is a prefix


@pytest.mark.parametrize(
    "status, reason",
    [(403, ReasonCode.PULL_UNAUTHORIZED), (404, ReasonCode.PULL_FAILED), (503, ReasonCode.PULL_SOURCE_UNREACHABLE)],
)
def test_an_error_status_is_a_reason(server, tmp_path, status, reason):
    url = server.add("/m.gguf", DATA, Fault(status=status))
    with pytest.raises(StokerError) as err:
        pull(url, tmp_path / "m.part")
    assert err.value.reason is reason
    if status == 503:  # retried as the table says, then given up
        rule = RETRY_TABLE[DownloadFailure.BUSY]
        assert len(server.requests("/m.gguf")) == rule.tries + 1
        assert WAITS == list(rule.waits)


def test_a_cancelled_pull_keeps_a_prefix_and_the_next_one_finishes_it(server, tmp_path):
    part = tmp_path / "m.part"
    url = server.add("/m.gguf", DATA, Fault(rate=4 * 2**20))  # ~1.5 s in all
    cancelled = threading.Event()
    threading.Timer(0.5, cancelled.set).start()
    with pytest.raises(DownloadCancelled):
        pull(url, part, cancelled=cancelled)
    kept = part.stat().st_size
    assert 0 < kept < len(DATA) and DATA.startswith(part.read_bytes())
    server.set_fault("/m.gguf", None)
    result = pull(url, part, resume=True)
    assert (result.size, result.sha256, result.resumed_from) == (len(DATA), SHA, kept)
    assert server.requests("/m.gguf")[-1].range == f"bytes={kept}-"


def test_a_disk_that_fills_mid_download_is_pull_disk_full_and_the_part_a_prefix(server, tmp_path, monkeypatch):
    where = tmp_path / "small"
    _mount_small_disk(where, "3m")
    try:
        monkeypatch.setattr(fetch, "check_room", lambda directory, needed: None)  # let it start
        url = server.add("/m.gguf", DATA)
        with pytest.raises(StokerError) as err:
            pull(url, where / "m.part")
        assert err.value.reason is ReasonCode.PULL_DISK_FULL
        kept = (where / "m.part").read_bytes()
        assert 0 < len(kept) <= 3 * 2**20 and DATA.startswith(kept)
    finally:
        import subprocess

        subprocess.run(["umount", str(where)], check=False)
