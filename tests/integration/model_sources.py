"""Loopback stand-ins for the model sources Stoker pulls from (these machines reach neither).

`FakeHub` speaks the Hugging Face Hub's API for exactly the calls huggingface_hub makes in a
pull: model info (`GET /api/models/{repo}[/revision/{rev}]?blobs=true`), paths-info and tree,
and `HEAD/GET /{repo}/resolve/{rev}/{file}` with X-Repo-Commit, X-Linked-Etag and
X-Linked-Size, answered for LFS files (as the Hub does) by a 302 to a "CDN" on a second port
that serves the bytes with Range requests. Error answers carry the Hub's X-Error-Code headers
(RepoNotFound, EntryNotFound, GatedRepo), which is how huggingface_hub tells them apart. A
gated repository's info is public and its files need `Authorization: Bearer <token>`.
Every request is logged (method, path, Range, Authorization), so a test can prove a resumed
download asked only for the bytes it lacked. `throttle` slows the bytes; `corrupt` serves a
file with one byte changed (same size).

`FakeIndex` is a PEP 503 simple index serving wheels `make_wheel` builds (RECORD digests
included), for `pip download --index-url`.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import os
import re
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import attrs


@attrs.define
class HubRepo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    token: str | None = None  # the token that opens a gated repo


_BIG = 16 * 2**20  # blobs this large (a benchmark's mmap of a multi-GB file) are hashed once
_MEMO: dict[tuple[int, str], tuple[Any, str]] = {}  # (id, algorithm) -> (the blob, kept alive; digest)


def _digest(data: Any, algorithm: str) -> str:
    if len(data) < _BIG:
        return hashlib.new(algorithm, data).hexdigest()
    held = _MEMO.get((id(data), algorithm))
    if held is None or held[0] is not data:
        held = _MEMO[(id(data), algorithm)] = (data, hashlib.new(algorithm, data).hexdigest())
    return held[1]


def sha256(data: bytes) -> str:
    return _digest(data, "sha256")


def _sha1(data: bytes) -> str:
    return _digest(data, "sha1")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


@attrs.define(eq=False)
class FakeHub:
    repos: dict[str, HubRepo] = attrs.field(factory=dict)
    throttle: float | None = None  # bytes per second for file bodies
    corrupt: set[str] = attrs.field(factory=set)  # file names served with one byte changed
    # A hostile Hub: every URL no route knows (a file name with "..", normalised away by the
    # client) is answered as this (repository, file name)'s resolve URL.
    catch_all: tuple[str, str] | None = None
    log: list[dict[str, Any]] = attrs.field(factory=list)
    _servers: list[_Server] = attrs.field(factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def start(self) -> "FakeHub":
        for role in ("hub", "cdn"):
            server = _Server(("127.0.0.1", 0), _handler(self, role))
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def ranges(self, suffix: str = "") -> list[str | None]:
        """The Range header of every GET of file bytes (on the CDN), in order."""
        return [
            e["range"] for e in self.log if e["role"] == "cdn" and e["method"] == "GET" and e["path"].endswith(suffix)
        ]

    def blob(self, digest: str) -> tuple[str, bytes] | None:
        for repo in self.repos.values():
            for name, data in repo.files.items():
                if sha256(data) == digest:
                    return name, data
        return None


def _siblings(repo: HubRepo, blobs: bool) -> list[dict[str, Any]]:
    out = []
    for name, data in sorted(repo.files.items()):
        entry: dict[str, Any] = {"rfilename": name}
        if blobs:
            entry.update(size=len(data), blobId=_sha1(data))
            entry["lfs"] = {"size": len(data), "sha256": sha256(data), "pointerSize": 134}
        out.append(entry)
    return out


def _tree(repo: HubRepo, paths: list[str] | None) -> list[dict[str, Any]]:
    out = []
    for name, data in sorted(repo.files.items()):
        if paths is not None and name not in paths:
            continue
        out.append(
            {
                "type": "file",
                "path": name,
                "size": len(data),
                "oid": _sha1(data),
                "lfs": {"oid": sha256(data), "size": len(data), "pointerSize": 134},
            }
        )
    return out


def _handler(hub: FakeHub, role: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _record(self) -> None:
            hub.log.append(
                {
                    "role": role,
                    "method": self.command,
                    "path": urlparse(self.path).path,
                    "range": self.headers.get("Range"),
                    "authorization": self.headers.get("Authorization"),
                    "at": time.monotonic(),
                }
            )

        def _error(self, status: int, code: str, message: str = "") -> None:
            body = json.dumps({"error": message or code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if message:
                self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, value: Any) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._record()
            if role == "cdn":
                return self._blob()
            self._hub()

        do_HEAD = do_GET

        def do_POST(self) -> None:
            self._record()
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode()
            match = re.match(r"^/api/models/([^/]+/[^/]+)/paths-info/([^/]+)$", urlparse(self.path).path)
            repo = hub.repos.get(match.group(1)) if match else None
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            form = parse_qs(raw)
            paths = form.get("paths") or (json.loads(raw).get("paths") if raw.startswith("{") else [])
            self._json(_tree(repo, list(paths)))

        def _hub(self) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            blobs = "blobs" in parse_qs(url.query)
            match = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
            if match:
                repo = hub.repos.get(match.group(1))
                if repo is None:  # the Hub answers 401 for a repository it will not show
                    return self._error(401, "RepoNotFound", "Repository not found")
                info = {
                    "_id": "0" * 24,
                    "id": match.group(1),
                    "modelId": match.group(1),
                    "sha": repo.commit,
                    "private": False,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "tags": ["gguf"],
                    "siblings": _siblings(repo, blobs),
                    "lastModified": "2025-01-01T00:00:00.000Z",
                }
                return self._json(info)
            match = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
            if match:
                repo = hub.repos.get(match.group(1))
                if repo is None:
                    return self._error(401, "RepoNotFound", "Repository not found")
                return self._json(_tree(repo, None))
            match = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if match:
                return self._resolve(match.group(1), match.group(2), match.group(3))
            if hub.catch_all is not None:
                return self._resolve(hub.catch_all[0], "main", hub.catch_all[1])
            self._error(404, "NotFound", "no such route")

        def _resolve(self, repo_id: str, revision: str, filename: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            if revision not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self._error(
                    401, "GatedRepo", "Access to model is restricted. You must have access to it and be authenticated."
                )
            data = repo.files.get(filename)
            if data is None:
                return self._error(404, "EntryNotFound", "Entry not found")
            digest = sha256(data)
            self.send_response(302)
            self.send_header("Location", f"{hub.cdn}/lfs/{digest}")
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("X-Linked-Etag", f'"{digest}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", f'"{_sha1(data)}"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _blob(self) -> None:
            match = re.match(r"^/lfs/([0-9a-f]{64})$", urlparse(self.path).path)
            found = hub.blob(match.group(1)) if match else None
            if found is None:
                return self._error(404, "EntryNotFound")
            name, data = found
            if name in hub.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:] if len(data) < 64 else data[:-33] + b"X" + data[-32:]
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if wanted:
                start = int(re.match(r"bytes=(\d+)-", wanted).group(1))
                status = 206
            body = memoryview(data)[start:]  # bytes, or a benchmark's mmap of a big file: never copied whole
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{sha256(data)}"')
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            step = 64 * 1024 if hub.throttle else 2**20
            try:
                for at in range(0, len(body), step):
                    self.wfile.write(body[at : at + step])
                    if hub.throttle:
                        time.sleep(step / hub.throttle)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


# --- a PEP 503 simple index ------------------------------------------------------------------


def _record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    directory: Path,
    name: str,
    version: str,
    files: dict[str, bytes],
    *,
    requires: tuple[str, ...] = (),
    record_override: dict[str, bytes] | None = None,
) -> Path:
    """A py3-none-any wheel carrying `files` (paths inside the wheel), with a true RECORD
    (or, for the members in `record_override`, the digest of other bytes: a lying RECORD)."""
    dist = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = dict(files)
    entries[f"{dist}.dist-info/METADATA"] = meta.encode()
    entries[f"{dist}.dist-info/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: stoker-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = io.StringIO()
    for member, data in entries.items():
        shown = (record_override or {}).get(member, data)
        record.write(f"{member},{_record_digest(shown)},{len(shown)}\n")
    record.write(f"{dist}.dist-info/RECORD,,\n")
    entries[f"{dist}.dist-info/RECORD"] = record.getvalue().encode()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for member, data in entries.items():
            archive.writestr(member, data)
    return path


@attrs.define(eq=False)
class FakeIndex:
    wheels: list[Path] = attrs.field(factory=list)
    log: list[str] = attrs.field(factory=list)
    file_delay_s: float = 0.0  # each wheel is sent this late: a pull that lasts long enough to watch
    _server: _Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/simple/"

    def start(self) -> "FakeIndex":
        index = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = unquote(urlparse(self.path).path)
                index.log.append(path)
                match = re.match(r"^/simple/([^/]+)/?$", path)
                if match:
                    project = re.sub(r"[-_.]+", "-", match.group(1)).lower()
                    links = [
                        f'<a href="/files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                        f"{html.escape(w.name)}</a>"
                        for w in index.wheels
                        if re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() == project
                    ]
                    if not links:
                        return self._send(404, b"not found", "text/plain")
                    body = ("<!DOCTYPE html><html><body>" + "<br>".join(links) + "</body></html>").encode()
                    return self._send(200, body, "text/html")
                match = re.match(r"^/files/(.+)$", path)
                wheel = next((w for w in index.wheels if match and w.name == match.group(1)), None)
                if wheel is None:
                    return self._send(404, b"not found", "text/plain")
                time.sleep(index.file_delay_s)
                self._send(200, wheel.read_bytes(), "application/octet-stream")

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


HF_REPO = "stoker-test/tiny-GGUF"  # the repository the pull tests' fake hubs serve


def pip_env(index: FakeIndex) -> dict[str, str]:
    """Environment settings under which pip asks `index` only: none of this machine's pip
    settings (a config file, extra indexes, find-links) may answer instead. A caller copying
    os.environ must also drop PIP_FIND_LINKS and PIP_EXTRA_INDEX_URL."""
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index.url}
