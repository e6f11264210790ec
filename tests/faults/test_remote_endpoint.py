"""Remote models under faults (`[models.NAME] endpoint`, docs/reliability.md "Remote models"): the
endpoint (a real llama-server the test starts on loopback, standing in for a vLLM cluster) killed
and brought back, a wrong and an unset upstream key, and an endpoint that cuts a stream midway.
What a client of the front door sees each time: the API's error shape with a reason code, a
Retry-After only where sending again is safe, and answers again as soon as the endpoint is back,
with nothing to restart in Stoker.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.integration.daemon_harness import free_port, write_config
from tests.integration.test_frontdoor import sdk
from tests.integration.test_remote_endpoint import UPSTREAM_NAME, endpoint, remote_config, remotes_of  # noqa: F401

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")


def test_an_endpoint_killed_is_reason_coded_and_answers_again_once_back(daemon, model, endpoint):  # noqa: F811
    port = free_port()
    daemon.env.update({"BIG_KEY": endpoint.key, "WRONG_KEY": "sk-not-the-endpoints"})
    daemon.env.pop("ABSENT_KEY", None)
    sections = "".join(
        f'[models.{name}]\nendpoint = "{endpoint.url}"\napi_key_env = "{env}"\ncheck_interval_s = 1\n'
        for name, env in (("big", "BIG_KEY"), ("wrong", "WRONG_KEY"), ("nokey", "ABSENT_KEY"))
    )
    write_config(daemon.paths, remote_config(model, port, sections))
    daemon.start()
    base = f"http://127.0.0.1:{port}/v1"
    client = sdk(base)
    ask = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert client.chat.completions.create(model="big", **ask).model == UPSTREAM_NAME

    # The endpoint's 401 is the upstream key's fault: 502 with its own code, never a 401 to the client.
    with pytest.raises(openai.APIStatusError) as rejected:
        client.chat.completions.create(model="wrong", **ask)
    assert rejected.value.status_code == 502 and rejected.value.code == "remote_key_rejected"
    assert "not your front door key" in rejected.value.message and "$WRONG_KEY" in rejected.value.message
    assert "Invalid API Key" in rejected.value.message  # the endpoint's own words
    with pytest.raises(openai.APIStatusError) as missing:
        client.chat.completions.create(model="nokey", **ask)
    assert missing.value.status_code == 503 and missing.value.code == "remote_key_missing"
    assert "$ABSENT_KEY" in missing.value.message

    endpoint.kill()
    started = time.monotonic()
    down = httpx.post(f"{base}/chat/completions", json={"model": "big", **ask}, trust_env=False, timeout=30)
    assert time.monotonic() - started < 5  # refused at once, not held
    assert down.status_code == 503 and down.headers["retry-after"] == "5"
    assert down.json()["error"]["code"] == "remote_endpoint_unreachable"
    assert endpoint.url in down.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as streamed:
        list(client.chat.completions.create(model="big", stream=True, **ask))
    assert streamed.value.status_code == 503 and streamed.value.code == "remote_endpoint_unreachable"
    st = daemon.wait_for(
        lambda s: (remotes_of(s)["big"].get("check") or {}).get("reachable") is False, 30, "big's check: unreachable"
    )
    big = remotes_of(st)["big"]
    assert big["reason"] == "remote_endpoint_unreachable" and "Connection refused" in big["check"]["error"]
    assert 'stoker_remote_up{model="big"} 0.0' in httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text

    endpoint.start()  # back on the same address: answered again, with nothing to restart in Stoker
    assert client.chat.completions.create(model="big", **ask).model == UPSTREAM_NAME
    # Each endpoint's check runs on its own clock: wait for both to have run since it came back.
    # A check that met the endpoint still loading got its 503 (reachable, the key not judged yet):
    # the wrong key's check says what it is at the next one that reaches the loaded endpoint.
    st = daemon.wait_for(
        lambda s: (
            (remotes_of(s)["big"].get("check") or {}).get("reachable") is True
            and (remotes_of(s)["wrong"].get("check") or {}).get("reason") == "remote_key_rejected"
        ),
        30,
        "big's check: reachable; wrong's: reachable, the key refused",
    )
    assert remotes_of(st)["big"]["reason"] is None
    assert remotes_of(st)["wrong"]["check"]["reachable"] is True
    assert remotes_of(st)["nokey"]["key_set"] is False and remotes_of(st)["nokey"]["reason"] == "remote_key_missing"


@pytest.fixture
def cutting_endpoint():
    """An endpoint on loopback that starts a chunked SSE answer, sends one event and closes the
    connection without the last chunk (a cluster's worker lost mid-answer); /models answers 200."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                if request.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                    continue
                event = (
                    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"one"}}]}\n\n'
                )
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n" % (len(event), event)
                )
                time.sleep(0.2)  # then the connection closes: no more chunks, no last one

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    stop.set()
    thread.join(5)
    listener.close()


def test_a_stream_the_endpoint_cuts_midway_ends_with_the_cut_event(daemon, model, cutting_endpoint):
    port = free_port()
    write_config(daemon.paths, remote_config(model, port, f'[models.big]\nendpoint = "{cutting_endpoint}"\n'))
    daemon.start()
    body = {"model": "big", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream(
        "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, trust_env=False, timeout=30
    ) as answer:
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert answer.status_code == 200
    assert '"content":"one"' in events[0]  # what the endpoint sent, passed on
    assert '"code": "engine_stream_cut"' in events[-1]  # then the stream says it was cut, never ends silently
