"""daemon.core.download over real HTTP against the loopback fault server."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import threading
import urllib.parse
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import pytest
import trio

from stoker.daemon.core import part_sink
from stoker.daemon.core.download import download
from stoker.daemon.core.http import open_connection
from stoker.daemon.core.download_records import DownloadError, DownloadErrorKind, DownloadProgress
from stoker.states.download_retry import RETRY_TABLE, RetryRule
from stoker.states.reasons import ReasonCode
from tests.httpfault import Fault, FaultServer

SIZE = 3 * 1024 * 1024 + 12345  # several batches and an odd tail
DATA = os.urandom(SIZE)
DIGEST = hashlib.sha256(DATA).hexdigest()
NEW_DATA = os.urandom(SIZE)
NEW_DIGEST = hashlib.sha256(NEW_DATA).hexdigest()
CAP = 64 * 1024 * 1024


def tries(n: int) -> dict:
    """The retry table with `n` tries for every failure it retries, 10 ms apart."""
    return {failure: RetryRule(min(n, rule.tries), (0.01,)) for failure, rule in RETRY_TABLE.items()}


def part_of(dest: Path) -> Path:
    return dest.with_suffix(dest.suffix + ".part")


def sidecar_of(dest: Path) -> Path:
    return dest.with_suffix(dest.suffix + ".part.json")


async def fetch(url: str, dest: Path, **kw):
    kw.setdefault("expected_sha256", DIGEST)
    kw.setdefault("expected_size", SIZE)
    kw.setdefault("max_bytes", CAP)
    kw.setdefault("retry", tries(5))
    return await download(url, dest, **kw)


async def fails(kind: DownloadErrorKind, url: str, dest: Path, **kw) -> DownloadError:
    with pytest.raises(DownloadError) as info:
        await fetch(url, dest, **kw)
    assert info.value.kind is kind, info.value.to_dict()
    assert info.value.evidence["kind"] == kind
    assert info.value.evidence["url"] == url
    json.dumps(info.value.to_dict())  # evidence goes to SQLite and --json as is
    assert not dest.exists()
    return info.value


def assert_clean(dest: Path) -> None:
    """Neither a destination nor anything to resume is left behind."""
    assert not dest.exists()
    assert not part_of(dest).exists()
    assert not sidecar_of(dest).exists()


def assert_complete(dest: Path, data: bytes = DATA) -> None:
    assert dest.read_bytes() == data
    assert not part_of(dest).exists()
    assert not sidecar_of(dest).exists()


async def test_plain_download_with_progress(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA)
    events: list[DownloadProgress] = []
    with trio.fail_after(20):
        result = await fetch(url, tmp_path / "b.zip", progress=events.append)
    assert_complete(tmp_path / "b.zip")
    assert result.sha256 == DIGEST and result.size == SIZE and result.resumed_from == 0
    assert result.attempts == 1
    assert [r.range for r in fault_server.requests()] == [None]
    assert events[-1].bytes_done == SIZE and events[-1].total == SIZE and events[-1].eta == 0.0
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(events, events[1:]))


async def test_progress_is_throttled(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/slow.zip", DATA[:600_000], Fault(rate=1_000_000))
    events: list[DownloadProgress] = []
    with trio.fail_after(20):
        await fetch(
            url,
            tmp_path / "slow.zip",
            expected_sha256=hashlib.sha256(DATA[:600_000]).hexdigest(),
            expected_size=600_000,
            progress=events.append,
        )
    # About 0.6 s at 1 MB/s: at most ~10 events a second plus the first and the last.
    assert 2 <= len(events) <= 10
    assert events[-1].bytes_done == 600_000
    assert any(e.rate > 0 and e.eta is not None for e in events[1:])


async def test_cut_once_resumes_with_range_and_if_range(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=1_000_000))
    with trio.fail_after(20):
        result = await fetch(url, tmp_path / "b.zip")
    assert_complete(tmp_path / "b.zip")
    first, second = fault_server.requests()
    assert (first.range, first.sent) == (None, 1_000_000)
    assert second.range == "bytes=1000000-" and second.status == 206
    assert second.if_range is not None and second.if_range.startswith('"')
    assert result.attempts == 2


async def test_last_modified_is_the_validator_without_an_etag(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=500_000, no_etag=True))
    with trio.fail_after(20):
        await fetch(url, tmp_path / "b.zip")
    assert_complete(tmp_path / "b.zip")
    second = fault_server.requests_when(None, 2)[1]
    assert second.range == "bytes=500000-" and second.if_range.endswith("GMT")


async def test_cut_every_time_is_continued_each_time(fault_server: FaultServer, tmp_path: Path) -> None:
    # Every try brings bytes, so the count of failures in a row starts again each time.
    dest = tmp_path / "b.zip"
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=700_000, cut_times=None))
    with trio.fail_after(20):
        await fetch(url, dest, retry=tries(1))
    assert_complete(dest)
    assert [r.range for r in fault_server.requests()][:3] == [None, "bytes=700000-", "bytes=1400000-"]


async def test_cut_past_the_tries_fails_then_resumes_later(fault_server: FaultServer, tmp_path: Path) -> None:
    dest = tmp_path / "b.zip"
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=700_000, cut_times=None))
    with trio.fail_after(20):
        err = await fails(
            DownloadErrorKind.CONNECTION,
            url,
            dest,
            retry=tries(0),
            failure_reason=ReasonCode.CUDA_BUNDLE_INSTALL_FAILED,
        )
    assert err.reason is ReasonCode.CUDA_BUNDLE_INSTALL_FAILED
    # The part is kept for later.
    assert [r.range for r in fault_server.requests()] == [None]
    assert part_of(dest).stat().st_size == 700_000
    assert json.loads(sidecar_of(dest).read_text())["bytes"] == 700_000
    fault_server.set_fault("/b.zip", None)
    with trio.fail_after(20):
        result = await fetch(url, dest)
    assert_complete(dest)
    assert result.resumed_from == 700_000
    assert fault_server.requests()[-1].range == "bytes=700000-"


async def test_wrong_content_is_a_digest_mismatch(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(corrupt=True))
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.DIGEST_MISMATCH, url, tmp_path / "b.zip")
    assert err.evidence["expected_sha256"] == DIGEST
    assert err.evidence["actual_sha256"] != DIGEST
    assert_clean(tmp_path / "b.zip")


@pytest.mark.parametrize("delta", [10, -10])
async def test_wrong_content_length_is_a_size_mismatch(fault_server: FaultServer, tmp_path: Path, delta: int) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(length_delta=delta))
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.SIZE_MISMATCH, url, tmp_path / "b.zip")
    assert err.evidence["actual_size"] == SIZE + delta
    assert_clean(tmp_path / "b.zip")


async def test_short_content_length_without_expected_size_is_a_digest_mismatch(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(length_delta=-10))
    with trio.fail_after(20):
        await fails(DownloadErrorKind.DIGEST_MISMATCH, url, tmp_path / "b.zip", expected_size=None)
    assert_clean(tmp_path / "b.zip")


async def test_long_content_length_without_expected_size_fails_clearly(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    # The body ends early on every attempt; the resume asks past the end (416).
    url = fault_server.add("/b.zip", DATA, Fault(length_delta=10))
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.HTTP_STATUS, url, tmp_path / "b.zip", expected_size=None)
    assert err.evidence["status"] == 416
    assert_clean(tmp_path / "b.zip")


@pytest.mark.parametrize("status", [404, 500, 503])
async def test_http_error_status(fault_server: FaultServer, tmp_path: Path, status: int) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(status=status))
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.HTTP_STATUS, url, tmp_path / "b.zip")
    assert err.evidence["status"] == status
    assert str(status) in err.message
    assert_clean(tmp_path / "b.zip")


async def test_missing_path_is_404(fault_server: FaultServer, tmp_path: Path) -> None:
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.HTTP_STATUS, fault_server.url("/nope.zip"), tmp_path / "b.zip")
    assert err.evidence["status"] == 404


async def test_server_ignoring_range_restarts_cleanly_from_zero(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=1_000_000, ignore_range=True))
    with trio.fail_after(20):
        await fetch(url, tmp_path / "b.zip")
    assert_complete(tmp_path / "b.zip")  # no duplicated first megabyte
    assert [(r.range, r.status) for r in fault_server.requests()] == [(None, 200), ("bytes=1000000-", 200)]


async def test_206_at_the_wrong_offset_is_an_error(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=1_000_000, range_offset_error=-7))
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.RANGE_MISMATCH, url, tmp_path / "b.zip")
    assert err.evidence["requested_offset"] == 1_000_000
    assert err.evidence["content_range"].startswith("bytes 999993-")
    assert_clean(tmp_path / "b.zip")


async def test_changed_etag_gets_the_new_file_from_zero(fault_server: FaultServer, tmp_path: Path) -> None:
    # The publisher replaced the file between attempts: If-Range no longer matches, the
    # server answers 200 with the new file, and the download starts over.
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=1_000_000, change_after=1, changed_data=NEW_DATA))
    with trio.fail_after(20):
        await fetch(url, tmp_path / "b.zip", expected_sha256=NEW_DIGEST)
    assert_complete(tmp_path / "b.zip", NEW_DATA)
    first, second = fault_server.requests()
    assert second.range == "bytes=1000000-" and second.if_range == first_etag(DATA)
    assert second.status == 200


async def test_changed_etag_with_the_old_digest_fails(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=1_000_000, change_after=1, changed_data=NEW_DATA))
    with trio.fail_after(20):
        await fails(DownloadErrorKind.DIGEST_MISMATCH, url, tmp_path / "b.zip")
    assert_clean(tmp_path / "b.zip")


async def test_changed_etag_on_a_206_restarts_from_zero(fault_server: FaultServer, tmp_path: Path) -> None:
    # A broken server honours Range despite If-Range: the 206 carries the new ETag, and
    # splicing it onto the old part would corrupt the file.
    url = fault_server.add(
        "/b.zip", DATA, Fault(cut_after=1_000_000, change_after=1, changed_data=NEW_DATA, ignore_if_range=True)
    )
    with trio.fail_after(20):
        await fetch(url, tmp_path / "b.zip", expected_sha256=NEW_DIGEST)
    assert_complete(tmp_path / "b.zip", NEW_DATA)
    assert [(r.range, r.status) for r in fault_server.requests()] == [(None, 200), ("bytes=1000000-", 206), (None, 200)]


async def test_no_validator_means_no_resume(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(cut_after=1_000_000, no_validator=True))
    with trio.fail_after(20):
        await fetch(url, tmp_path / "b.zip")
    assert_complete(tmp_path / "b.zip")
    assert [r.range for r in fault_server.requests()] == [None, None]


async def test_announced_size_over_the_cap(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA)
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.TOO_LARGE, url, tmp_path / "b.zip", expected_size=None, max_bytes=SIZE - 1)
    assert err.evidence["announced"] == SIZE
    assert_clean(tmp_path / "b.zip")


async def test_streamed_size_over_the_cap(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(chunked=True))
    with trio.fail_after(20):
        await fails(DownloadErrorKind.TOO_LARGE, url, tmp_path / "b.zip", expected_size=None, max_bytes=1_000_000)
    assert_clean(tmp_path / "b.zip")


async def test_streamed_size_over_the_expected_size(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(chunked=True))
    with trio.fail_after(20):
        await fails(DownloadErrorKind.SIZE_MISMATCH, url, tmp_path / "b.zip", expected_size=SIZE - 1)
    assert_clean(tmp_path / "b.zip")


async def test_chunked_download_without_expected_size(fault_server: FaultServer, tmp_path: Path) -> None:
    url = fault_server.add("/b.zip", DATA, Fault(chunked=True))
    with trio.fail_after(20):
        result = await fetch(url, tmp_path / "b.zip", expected_size=None)
    assert_complete(tmp_path / "b.zip")
    assert result.size == SIZE


async def test_resume_across_a_daemon_restart(fault_server: FaultServer, tmp_path: Path) -> None:
    dest = tmp_path / "b.zip"
    url = fault_server.add("/b.zip", DATA, Fault(rate=2_000_000))
    with trio.fail_after(20):
        with trio.move_on_after(0.6) as scope:
            await fetch(url, dest)
    assert scope.cancelled_caught
    assert not dest.exists()
    kept = part_of(dest).stat().st_size
    assert 0 < kept < SIZE
    side = json.loads(sidecar_of(dest).read_text())
    assert side["url"] == url and side["sha256"] == DIGEST and side["etag"] and side["bytes"] == kept
    # A new "daemon" (a fresh call, a fresh client) resumes from the part.
    fault_server.set_fault("/b.zip", None)
    with trio.fail_after(20):
        result = await fetch(url, dest)
    assert_complete(dest)
    last = fault_server.requests()[-1]
    assert last.range == f"bytes={kept}-" and last.if_range == side["etag"] and last.status == 206
    assert result.resumed_from == kept


async def test_part_for_another_file_is_discarded(fault_server: FaultServer, tmp_path: Path) -> None:
    dest = tmp_path / "b.zip"
    part_of(dest).write_bytes(b"x" * 5000)
    sidecar_of(dest).write_text(
        json.dumps({"url": "http://elsewhere/b.zip", "sha256": DIGEST, "etag": '"e"', "bytes": 5000})
    )
    url = fault_server.add("/b.zip", DATA)
    with trio.fail_after(20):
        result = await fetch(url, dest)
    assert_complete(dest)
    assert result.resumed_from == 0
    assert [r.range for r in fault_server.requests()] == [None]


async def test_complete_part_is_verified_without_a_request(fault_server: FaultServer, tmp_path: Path) -> None:
    # Killed after the last byte but before the rename.
    dest = tmp_path / "b.zip"
    url = fault_server.add("/b.zip", DATA)
    part_of(dest).write_bytes(DATA)
    sidecar_of(dest).write_text(json.dumps({"url": url, "sha256": DIGEST, "etag": first_etag(DATA), "bytes": SIZE}))
    with trio.fail_after(20):
        result = await fetch(url, dest)
    assert_complete(dest)
    assert result.attempts == 0 and fault_server.requests() == []


async def test_unwritable_destination_is_a_write_failure(fault_server: FaultServer, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    url = fault_server.add("/b.zip", DATA)
    with trio.fail_after(20):
        err = await fails(DownloadErrorKind.WRITE_FAILED, url, tmp_path / "file" / "b.zip")
    assert "file/b.zip.part" in err.evidence["part"]
    assert fault_server.requests() == []


async def test_connection_refused_is_a_connection_error(tmp_path: Path) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with trio.fail_after(20):
        await fails(DownloadErrorKind.CONNECTION, f"http://127.0.0.1:{port}/b.zip", tmp_path / "b.zip", retry=tries(1))


class ForwardProxy(http.server.ThreadingHTTPServer):
    """An HTTP proxy on loopback for plain http URLs (absolute URIs): it records what it was asked."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.seen.append(self.path)
                target = urllib.parse.urlsplit(self.path)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("range", "if-range")}
                conn.request("GET", target.path, headers=headers)
                answer = conn.getresponse()
                body = answer.read()
                self.send_response(answer.status)
                for key in ("ETag", "Last-Modified", "Content-Range"):
                    if answer.getheader(key):
                        self.send_header(key, answer.getheader(key))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)


async def test_a_proxy_in_the_environment_carries_the_download(
    fault_server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = ForwardProxy()
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        url = fault_server.add("/b.zip", DATA)
        with trio.fail_after(20):
            await fetch(url, tmp_path / "b.zip")
        assert_complete(tmp_path / "b.zip")
        assert proxy.seen == [url]
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # exempted: straight to the server
        with trio.fail_after(20):
            await fetch(url, tmp_path / "c.zip")
        assert proxy.seen == [url] and len(fault_server.requests()) == 2
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_an_https_url_behind_a_proxy_goes_through_a_connect_tunnel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://user:pw@proxy.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    conn, target, extra = open_connection("https://cdn.example/f.gguf?x=1", 5.0)
    assert (conn.host, conn.port) == ("proxy.example", 3128)
    assert (conn._tunnel_host, conn._tunnel_port) == ("cdn.example", 443)  # type: ignore[attr-defined]
    assert conn._tunnel_headers["Proxy-Authorization"].startswith("Basic ")  # type: ignore[attr-defined]
    assert (target, extra) == ("/f.gguf?x=1", {})


@hypothesis.settings(
    max_examples=20, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(cuts=st.lists(st.integers(min_value=0, max_value=SIZE - 1), min_size=1, max_size=3))
async def test_cut_anywhere_gives_identical_bytes(fault_server: FaultServer, tmp_path: Path, cuts: list[int]) -> None:
    # Each cut applies to the next response, at that many bytes into it.
    path = f"/h{len(fault_server.requests())}.zip"
    url = fault_server.add(path, DATA, Fault(cut_after=cuts[0]))
    dest = tmp_path / path.strip("/")
    with trio.fail_after(30):
        rest = list(cuts[1:])
        while True:
            try:
                await fetch(url, dest, retry=tries(0))
                break
            except DownloadError as err:
                assert err.kind is DownloadErrorKind.CONNECTION
                fault_server.set_fault(path, Fault(cut_after=rest.pop(0)) if rest else None)
    assert_complete(dest)
    dest.unlink()


def first_etag(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


async def test_a_large_download_cut_past_a_writeback_window_resumes_intact(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    """40 MiB, cut 21 MiB and a bit in: the resumed part starts at an odd offset (written
    buffered, its writeback windows queued in order), and the file is still byte-identical."""
    data = os.urandom(40 * 2**20)
    calls: list[tuple[int, int]] = []
    real = part_sink.start_writeback

    def spy(fd: int, offset: int, nbytes: int) -> None:
        calls.append((offset, nbytes))
        real(fd, offset, nbytes)

    part_sink.start_writeback = spy  # type: ignore[assignment]
    try:
        url = fault_server.add("/big.zip", data, Fault(cut_after=21 * 2**20 + 12345))
        with trio.fail_after(60):
            result = await fetch(
                url,
                tmp_path / "big.zip",
                expected_sha256=hashlib.sha256(data).hexdigest(),
                expected_size=len(data),
                max_bytes=2 * len(data),
            )
    finally:
        part_sink.start_writeback = real  # type: ignore[assignment]
    assert_complete(tmp_path / "big.zip", data)
    assert result.attempts == 2
    # every whole window queued once, in order, none past the data
    starts = [offset for offset, _ in calls]  # (none where every aligned block went with O_DIRECT)
    assert starts == sorted(starts)
    assert all(offset + n <= len(data) for offset, n in calls)
