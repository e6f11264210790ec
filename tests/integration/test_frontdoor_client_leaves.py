"""A client that leaves before its answer is over frees the engine: the front door closes the
engine's connection under it at once, and llama-server stops generating a streamed answer nobody
will read (else its slot stays busy for the rest of the answer, seconds to minutes, while other
requests wait). A streamed answer is noticed at its next write; a plain one, whose engine says
nothing until it is done, by watching the client's connection. (llama-server b11434 finishes a
non-streamed generation whose connection closed: only its connection is ours to close.)"""

from __future__ import annotations

import json
import socket
import time

import httpx
import psutil
import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from tests.integration.daemon_harness import servers_for, tiny_config, write_config
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]


def busy_slots(endpoint: str, key: str) -> list[int]:
    slots = httpx.get(f"{endpoint}/slots", headers={"Authorization": f"Bearer {key}"}, trust_env=False).json()
    return [s["id"] for s in slots if s.get("is_processing")]


def engine_connections(daemon_pid: int, endpoint: str) -> set[int]:
    """The daemon's open connections to the engine, by local port (the telemetry sampler's too)."""
    port = int(endpoint.rsplit(":", 1)[1])
    return {c.laddr.port for c in psutil.Process(daemon_pid).net_connections("tcp") if c.raddr and c.raddr.port == port}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_a_client_that_leaves_stops_the_engine(daemon, tmp_path, stream):
    model = write_tiny_model(tmp_path / "long.gguf", n_layer=4, n_embd=512, n_head=8, n_ctx=4096)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    write_config(daemon.paths, tiny_config(model, ctx_size=4096) + f"[frontdoor]\nport = {port}\n")
    daemon.start()
    st = daemon.wait_state("ready")
    assert daemon.proc is not None
    before = engine_connections(daemon.proc.pid, st["endpoint"])
    body = json.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 3500,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        if stream:
            got = b""
            while got.count(b"data: ") < 3:  # the answer is streaming
                got += client.recv(65536)
        wait_until(
            lambda: busy_slots(st["endpoint"], st["api_key"]), timeout=10, what="the engine generating", tick=0.02
        )
        forwarded = engine_connections(daemon.proc.pid, st["endpoint"]) - before
        assert len(forwarded) == 1, forwarded  # the front door's, carrying this request
    left = time.monotonic()
    wait_until(
        lambda: not forwarded & engine_connections(daemon.proc.pid, st["endpoint"]),
        timeout=1.0,
        what="the engine's connection to close after the client left",
        tick=0.02,
    )
    closed_s = time.monotonic() - left
    if stream:  # llama-server notices a closed connection while it streams, and stops
        wait_until(
            lambda: not busy_slots(st["endpoint"], st["api_key"]),
            timeout=3.0 - closed_s,
            what="the engine to stop generating for a client that left",
        )
    print(f"the engine's connection closed {closed_s:.2f} s after the client left")
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
    route = "/v1/chat/completions"
    if stream:
        assert f'stoker_responses_cut_total{{reason="client_gone",route="{route}"}} 1.0' in metrics, metrics
    else:  # gone before any answer began: counted with no status
        assert f'stoker_requests_total{{code="none",route="{route}"}} 1.0' in metrics, metrics
    # Nothing counts the request as in flight any more: the daemon stops at once, its server with it
    # (a request left counted made the stop wait out the drain, the harness killed the daemon, and
    # the engine was left running).
    began = time.monotonic()
    daemon.stop()
    leftovers = servers_for(model)
    for proc in leftovers:
        proc.kill()
    assert not leftovers and time.monotonic() - began < 20, (leftovers, time.monotonic() - began)
