"""Remote models: `[models.NAME] endpoint` served by an external OpenAI-compatible
engine through the front door, with real parts.

The endpoint is a real llama-server (the cached CPU bundle, the tiny model) started by the test on
loopback, outside the daemon, standing in for a vLLM cluster (the same OpenAI API), with an API key
of its own. The official `openai` SDK talks to the daemon's front door: chat, a stream,
completions and embeddings are answered by the endpoint (its `--alias` in the answers), listed in
/v1/models, shown in status and /metrics as remote with acceleration unknown. (Its failures, the
endpoint killed and back, a wrong or unset upstream key, a stream cut midway:
tests/faults/test_remote_endpoint.py.) A loopback stub that records what it is sent shows the key from the
daemon's environment going upstream (and the client's front door key not), `model` rewritten,
a stream relayed as it arrives; and the key never appears in status, the daemon's log, history or
the state database.
"""

from __future__ import annotations

import http.server
import json
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.daemon_harness import free_port, tiny_config, write_config
from tests.integration.test_frontdoor import sdk

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")

UPSTREAM_NAME = "upstream-tiny"  # the endpoint's --alias: the name it serves the model under


class Endpoint:
    """A llama-server on loopback, started and killed by the test (never by the daemon)."""

    def __init__(self, server: Path, model: Path, key: str, port: int, workdir: Path) -> None:
        self.argv = [
            str(server),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            key,
            "--alias",
            UPSTREAM_NAME,
            "-c",
            "256",
            "--embeddings",
            "--pooling",
            "mean",
        ]
        self.port, self.key, self.workdir = port, key, workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        log = open(self.workdir / "endpoint.log", "ab")
        self.proc = subprocess.Popen(self.argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (self.workdir / "endpoint.log").read_text()
            time.sleep(0.1)
        raise AssertionError("the endpoint never became healthy")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def endpoint(installed_cpu_bundle, tiny_model, tmp_path):
    work = tmp_path / "endpoint"
    work.mkdir()
    copy = work / "upstream.gguf"
    copy.write_bytes(Path(tiny_model).read_bytes())
    ep = Endpoint(installed_cpu_bundle.server, copy, "sk-endpoint-" + secrets.token_hex(8), free_port(), work)
    ep.start()
    yield ep
    ep.kill()


def remote_config(model: Path, port: int, sections: str) -> str:
    return tiny_config(model) + sections + f"[frontdoor]\nport = {port}\n"


def remotes_of(st: dict) -> dict[str, dict]:
    return {r["name"]: r for r in st.get("remotes") or []}


def test_a_remote_model_answers_streams_is_listed_and_shown_as_remote(daemon, model, endpoint):
    port = free_port()
    daemon.env["BIG_KEY"] = endpoint.key
    sections = (
        f'[models.big]\nendpoint = "{endpoint.url}"\napi_key_env = "BIG_KEY"\nremote_model = "{UPSTREAM_NAME}"\n'
        "check_interval_s = 1\n"
    )
    write_config(daemon.paths, remote_config(model, port, sections))
    daemon.start()
    client = sdk(f"http://127.0.0.1:{port}/v1")

    chat = client.chat.completions.create(
        model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert chat.model == UPSTREAM_NAME and chat.choices[0].message.content  # the endpoint answered it
    chunks = list(
        client.chat.completions.create(
            model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
        )
    )
    assert len(chunks) >= 3 and {c.model for c in chunks} == {UPSTREAM_NAME}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content  # greedy: the same tokens, streamed
    done = client.completions.create(model="big", prompt="The", max_tokens=4, temperature=0)
    assert done.model == UPSTREAM_NAME and done.usage.completion_tokens == 4
    vectors = client.embeddings.create(model="big", input="The")
    assert len(vectors.data[0].embedding) == 128  # the tiny model's width

    page = {m.id: m.model_extra["stoker"] for m in client.models.list().data}
    assert page["big"]["remote"] and page["big"]["endpoint"] == endpoint.url
    assert page["big"]["backend"] == "remote" and page["big"]["accelerated"] == "unknown"

    st = daemon.wait_for(lambda s: (remotes_of(s).get("big") or {}).get("check"), 30, "a check of big's endpoint")
    big = remotes_of(st)["big"]
    assert big["reachable"] is True and big["check"]["http_status"] == 200 and big["check"]["latency_ms"] > 0
    assert big["key_set"] is True and big["api_key_env"] == "BIG_KEY" and big["accelerated"] == "unknown"
    assert big["last_request"]["http_status"] == 200 and big["in_flight"] == 0
    # Never planned, placed or run: no member, no launch machine, no server of Stoker's for it.
    assert [m["name"] for m in st["models"]] == ["default"]
    assert daemon.history(machine="launch:big", limit=10) == []

    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
    assert 'stoker_backend_info{in_use="remote",model="big",planned="remote"} 1.0' in metrics
    assert f'stoker_remote_info{{accelerated="unknown",endpoint="{endpoint.url}",model="big"}} 1.0' in metrics
    assert 'stoker_remote_up{model="big"} 1.0' in metrics
    assert 'stoker_accelerated{model="big"}' not in metrics  # unknown is never claimed either way
    done = subprocess.run(
        [*STOKER, "status"], env=daemon.env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert f"remote    big -> {endpoint.url} ({UPSTREAM_NAME}): reachable" in done, done
    assert "accelerated: unknown" in done


STOKER = [sys.executable, "-m", "stoker.daemon"]


def test_a_remote_model_added_by_a_config_reload_answers_without_a_restart(daemon, model, endpoint):
    port = free_port()
    daemon.env["BIG_KEY"] = endpoint.key
    write_config(daemon.paths, remote_config(model, port, ""))
    daemon.start()
    daemon.wait_state("ready")
    pid = daemon.call("status")["pid"]
    client = sdk(f"http://127.0.0.1:{port}/v1")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="big", prompt="The", max_tokens=2)
    sections = f'[models.big]\nendpoint = "{endpoint.url}"\napi_key_env = "BIG_KEY"\ncheck_interval_s = 1\n'
    write_config(daemon.paths, remote_config(model, port, sections))
    daemon.wait_for(lambda s: "big" in remotes_of(s), 30, "big added by the reload")
    assert client.completions.create(model="big", prompt="The", max_tokens=2).model == UPSTREAM_NAME
    st = daemon.call("status")
    assert st["pid"] == pid and st["restarts"] == 0  # the local model's server was not relaunched for it
    write_config(daemon.paths, remote_config(model, port, ""))  # and removed again
    daemon.wait_for(lambda s: "big" not in remotes_of(s), 30, "big removed by the reload")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="big", prompt="The", max_tokens=2)


class Recorder(http.server.BaseHTTPRequestHandler):
    """A loopback stand-in that records each request (path, headers, body) and answers like an
    OpenAI endpoint; a streamed chat is sent as three events `GAP_S` apart."""

    protocol_version = "HTTP/1.1"
    GAP_S = 0.6
    seen: list[dict] = []
    sent_last_at: list[float] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.__class__.seen.append({"path": self.path, "headers": dict(self.headers), "body": None})
        self._json({"object": "list", "data": [{"id": "upstream/model-x", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.__class__.seen.append({"path": self.path, "headers": dict(self.headers), "body": body})
        if not body.get("stream"):
            message = {"role": "assistant", "content": "hello"}
            self._json(
                {
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                }
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i, word in enumerate(("one", "two", "three")):
            if i:
                time.sleep(self.GAP_S)
            delta = {
                "object": "chat.completion.chunk",
                "model": body["model"],
                "choices": [{"index": 0, "delta": {"content": word}}],
            }
            self.wfile.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
            self.wfile.flush()
        self.__class__.sent_last_at.append(time.monotonic())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _json(self, content: dict) -> None:
        data = json.dumps(content).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def recorder():
    Recorder.seen, Recorder.sent_last_at = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_upstream_key_goes_to_the_endpoint_and_nowhere_else(daemon, model, recorder):
    port = free_port()
    upstream_key = "sk-upstream-" + secrets.token_hex(16)
    daemon.env["STUB_KEY"] = upstream_key
    sections = (
        f'[models.stub]\nendpoint = "{recorder}"\napi_key_env = "STUB_KEY"\nremote_model = "upstream/model-x"\n'
        "check_interval_s = 1\n"
    )
    text = remote_config(model, port, sections) + 'require_keys = true\nmax_body_bytes = "2 KiB"\n'
    write_config(daemon.paths, text)
    daemon.start()
    user_key = daemon.call("key.create", name="alice")["key"]
    base = f"http://127.0.0.1:{port}/v1"
    ask = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}

    # The front door's keys and limits apply as to any model, before anything goes upstream.
    assert httpx.post(f"{base}/chat/completions", json=ask, trust_env=False).json()["error"]["code"] == (
        "invalid_api_key"
    )
    big = {**ask, "messages": [{"role": "user", "content": "x" * 4096}]}
    too_big = httpx.post(
        f"{base}/chat/completions", json=big, headers={"Authorization": f"Bearer {user_key}"}, trust_env=False
    )
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "frontdoor_body_too_large"
    assert not [s for s in Recorder.seen if s["body"] is not None]

    client = openai.OpenAI(
        base_url=base, api_key=user_key, max_retries=0, http_client=openai.DefaultHttpxClient(trust_env=False)
    )
    reply = client.chat.completions.create(**ask)
    assert reply.choices[0].message.content == "hello" and reply.model == "upstream/model-x"
    posted = [s for s in Recorder.seen if s["body"] is not None]
    assert posted[0]["path"] == "/v1/chat/completions" and posted[0]["body"]["model"] == "upstream/model-x"
    headers = {k.lower(): v for k, v in posted[0]["headers"].items()}
    assert headers["authorization"] == f"Bearer {upstream_key}"  # the daemon's env's key, not alice's
    assert user_key not in json.dumps(Recorder.seen)

    # Streamed: each event passes as it arrives (the first reaches the client before the endpoint
    # has sent the last one), never buffered.
    stream = client.chat.completions.create(**ask, stream=True)
    words, arrived = [], []
    for chunk in stream:
        words.append(chunk.choices[0].delta.content)
        arrived.append(time.monotonic())
    assert words == ["one", "two", "three"]
    assert arrived[0] < Recorder.sent_last_at[-1] - Recorder.GAP_S, (arrived, Recorder.sent_last_at)

    checks = daemon.wait_for(lambda s: (remotes_of(s)["stub"].get("check") or {}).get("http_status") == 200, 30)
    gets = [s for s in Recorder.seen if s["body"] is None]
    assert (
        gets[0]["path"] == "/v1/models"
        and {k.lower(): v for k, v in gets[0]["headers"].items()}["authorization"] == f"Bearer {upstream_key}"
    )

    # Never shown, logged or stored: status (JSON and text), history, the daemon's log, the database.
    status_text = subprocess.run([*STOKER, "status"], env=daemon.env, capture_output=True, text=True, timeout=60).stdout
    history = json.dumps(daemon.history(limit=500))
    daemon.stop()
    stored = b"".join(p.read_bytes() for p in daemon.paths.data_dir.rglob("*") if p.is_file())
    for where, text in (
        ("status", json.dumps(checks)),
        ("status text", status_text),
        ("history", history),
        ("daemon log", daemon.log_text()),
    ):
        assert upstream_key not in text, where
    assert upstream_key.encode() not in stored
    assert "STUB_KEY" in json.dumps(checks)  # the variable's name is shown, its value never
