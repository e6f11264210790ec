"""A real HTTP server on 127.0.0.1 that serves files with programmable faults.

It runs `http.server.ThreadingHTTPServer` in a thread, so the code under test talks to it
over real sockets exactly as it would to a CDN: ETag, Last-Modified, Range and If-Range
(206 with Content-Range, 416 past the end), keep-alive. Each path can carry a `Fault`:

    with FaultServer() as server:
        url = server.add("/bundle.zip", data, Fault(cut_after=1000))
        ...
        assert server.requests("/bundle.zip")[1].range == "bytes=1000-"

`server.log` records every request (method, path, Range, If-Range, status, bytes sent) so a
test can assert what the client asked for. Files may be bytes or a `Path` (streamed with
`sendfile`, for the throughput benchmark).
"""

from __future__ import annotations

import email.utils
import hashlib
import http.server
import re
import socket
import threading
import time
from pathlib import Path

import attrs

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_COPY_CHUNK = 256 * 1024


@attrs.frozen
class Fault:
    """What goes wrong when a path is requested; the default is nothing."""

    # Close the connection after sending this many body bytes of a response...
    cut_after: int | None = None
    # ...on this many responses (None: every response).
    cut_times: int | None = 1
    # Serve the same number of bytes with one byte flipped (a digest mismatch).
    corrupt: bool = False
    # Add this to the Content-Length header (the body stays the real one).
    length_delta: int = 0
    # Answer every request with this status and a short body (404, 500, 503...).
    status: int | None = None
    # Answer range requests with 200 and the whole body.
    ignore_range: bool = False
    # Honour Range even when If-Range names another validator.
    ignore_if_range: bool = False
    # Send a 206 whose Content-Range (and body) starts this many bytes off the request.
    range_offset_error: int = 0
    # After this many requests the file changes: `changed_data` (or the bytes reversed),
    # with a new ETag and Last-Modified.
    change_after: int | None = None
    changed_data: bytes | None = None
    # Throttle the body to this many bytes per second.
    rate: int | None = None
    # Send no ETag or Last-Modified at all; or only the Last-Modified.
    no_validator: bool = False
    no_etag: bool = False
    # Send the body chunked, without a Content-Length.
    chunked: bool = False


@attrs.frozen
class RequestRecord:
    """One request as the server saw it."""

    method: str
    path: str
    range: str | None
    if_range: str | None
    status: int
    sent: int
    seq: int  # arrival order


@attrs.define(eq=False)
class _Entry:
    data: bytes | Path
    fault: Fault
    etag: str
    mtime: float
    hits: int = 0
    cuts: int = 0


def _etag(data: bytes | Path) -> str:
    if isinstance(data, Path):
        st = data.stat()
        return f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"'
    return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


class FaultServer:
    """The loopback server; a context manager that starts and stops its thread."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.log: list[RequestRecord] = []  # in the order the responses ended
        self._seq = 0
        self._httpd = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fault-server", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def add(self, path: str, data: bytes | Path, fault: Fault | None = None) -> str:
        """Serve `data` at `path` (replacing what was there) and return its URL."""
        with self._lock:
            self._entries[path] = _Entry(data, fault or Fault(), _etag(data), time.time() - 60)
        return self.url(path)

    def set_fault(self, path: str, fault: Fault | None) -> None:
        """Change the fault of a served path; the request and cut counters restart."""
        with self._lock:
            entry = self._entries[path]
            entry.fault = fault or Fault()
            entry.hits = 0
            entry.cuts = 0

    def replace(self, path: str, data: bytes) -> None:
        """Publish new content at `path`: new ETag and Last-Modified, same fault."""
        with self._lock:
            entry = self._entries[path]
            entry.data = data
            entry.etag = _etag(data)
            entry.mtime = time.time()

    def requests(self, path: str | None = None) -> list[RequestRecord]:
        """The requests answered so far in the order they arrived, optionally for one path."""
        with self._lock:
            return sorted((r for r in self.log if path is None or r.path == path), key=lambda r: r.seq)

    def requests_when(self, path: str | None, count: int, timeout: float = 10.0) -> list[RequestRecord]:
        """`requests(path)` once `count` of them are recorded: a request is recorded as its
        response ends in the server's thread, which may be after the client has read it all."""
        deadline = time.monotonic() + timeout
        while len(found := self.requests(path)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(found)} requests for {path} recorded in {timeout:g} s, not {count}")
            time.sleep(0.01)
        return found

    def __enter__(self) -> "FaultServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # Called from the handler threads.

    def _arrived(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _take(self, path: str) -> tuple[_Entry, bytes | Path, str, float, Fault, bool] | None:
        with self._lock:
            entry = self._entries.get(path)
            if entry is None:
                return None
            entry.hits += 1
            fault = entry.fault
            if fault.change_after is not None and entry.hits == fault.change_after + 1:
                assert isinstance(entry.data, bytes), "change_after needs in-memory data"
                entry.data = fault.changed_data if fault.changed_data is not None else entry.data[::-1]
                entry.etag = _etag(entry.data)
                entry.mtime = time.time()
            cut = fault.cut_after is not None and (fault.cut_times is None or entry.cuts < fault.cut_times)
            return entry, entry.data, entry.etag, entry.mtime, fault, cut

    def _record(self, record: RequestRecord, entry: _Entry | None, cut_happened: bool) -> None:
        with self._lock:
            self.log.append(record)
            if entry is not None and cut_happened:
                entry.cuts += 1


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # Clients hanging up mid-response are what the faults are for; say nothing.
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _handler_for(server: FaultServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(_FaultHandler):
        owner = server

    return Handler


class _FaultHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, *, head: bool) -> None:
        range_h = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        seq = self.owner._arrived()
        taken = self.owner._take(self.path)
        sent, cut_happened, status = 0, False, 404
        entry = None
        try:
            if taken is None:
                status = 404
                self._short(404)
                return
            entry, data, etag, mtime, fault, cut = taken
            if fault.status is not None:
                status = fault.status
                self._short(fault.status)
                return
            size = data.stat().st_size if isinstance(data, Path) else len(data)
            last_modified = email.utils.formatdate(mtime, usegmt=True)
            start, end, status = 0, size, 200
            m = _RANGE.match(range_h or "")
            if m and not fault.ignore_range:
                validator_ok = (
                    if_range is None
                    or fault.ignore_if_range
                    or if_range == etag
                    or (not if_range.startswith('"') and if_range == last_modified)
                )
                if validator_ok:
                    start = int(m.group(1))
                    end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                    if start >= size:
                        status = 416
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    status = 206
                    start = max(0, min(size - 1, start + fault.range_offset_error))
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            if not fault.no_validator:
                if not fault.no_etag:
                    self.send_header("ETag", etag)
                self.send_header("Last-Modified", last_modified)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            if fault.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(end - start + fault.length_delta))
            self.end_headers()
            if head:
                return
            limit = end - start
            if cut:
                limit = min(limit, fault.cut_after)
            sent = self._body(data, start, limit, fault)
            if fault.chunked and not cut:
                self.wfile.write(b"0\r\n\r\n")
            if cut:
                cut_happened = True
                self.close_connection = True
            elif fault.length_delta:
                # The framing is now wrong either way; never reuse this connection.
                self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self.owner._record(
                RequestRecord(self.command, self.path, range_h, if_range, status, sent, seq), entry, cut_happened
            )
            if cut_happened:
                # Logged before the cut, so a test that sees the client retry sees the cut too.
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _short(self, status: int) -> None:
        body = f"{status} {self.responses.get(status, ('',))[0]}\n".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _body(self, data: bytes | Path, start: int, count: int, fault: Fault) -> int:
        if isinstance(data, Path) and not fault.corrupt and fault.rate is None and not fault.chunked:
            with open(data, "rb") as f:
                return self.connection.sendfile(f, start, count)
        if isinstance(data, Path):
            with open(data, "rb") as f:
                f.seek(start)
                blob = f.read(count)
        else:
            blob = data[start : start + count]
        if fault.corrupt and blob:
            flip = len(blob) // 2
            blob = blob[:flip] + bytes([blob[flip] ^ 0xFF]) + blob[flip + 1 :]
        sent = 0
        step = _COPY_CHUNK if fault.rate is None else max(1, fault.rate // 20)
        began = time.monotonic()
        view = memoryview(blob)
        while sent < len(blob):
            chunk = view[sent : sent + step]
            if fault.chunked:
                self.wfile.write(b"%x\r\n" % len(chunk) + bytes(chunk) + b"\r\n")
            else:
                self.wfile.write(chunk)
            sent += len(chunk)
            if fault.rate is not None:
                ahead = sent / fault.rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
        return sent
