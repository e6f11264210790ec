"""Clients that do not keep their connection: HTTP/1.0, and HTTP/1.1 with `Connection: close`.

A raw socket client (no SDK, no HTTP library on the sending side: curl -0, old proxies, load
balancers' health checks and shell scripts speak like this) sends one request, then reads until
the server closes the connection. The answer must arrive whole, in the framing the client
understands (an HTTP/1.0 client knows no chunked coding: its body ends when the connection does),
and the server must close the connection once the answer is over: the read returns EOF, it never
hangs waiting for the socket timeout.
"""

from __future__ import annotations

import json
import socket
import time

import h11
import pytest

from tests.integration.daemon_harness import start_with_frontdoor

pytestmark = [pytest.mark.engine]

READ_TIMEOUT_S = 20.0  # far past any answer of the tiny model: reaching it is a hang


def ask(
    port: int, version: bytes, method: bytes, target: bytes, body: bytes | None, close: bool
) -> tuple[bytes, float]:
    """Send one request on a new connection; everything the server sent until it closed, and
    how long the close came after the last byte."""
    head = [b"%s %s HTTP/%s" % (method, target, version), b"Host: 127.0.0.1"]
    if body is not None:
        head += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
    if close:
        head.append(b"Connection: close")
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + (body or b""))
        received, last = b"", time.monotonic()
        while True:
            try:
                data = sock.recv(65536)
            except socket.timeout:
                pytest.fail(
                    f"HTTP/{version.decode()} {target.decode()}: no EOF after {READ_TIMEOUT_S:g} s: {received!r}"
                )
            if not data:
                return received, time.monotonic() - last
            received += data
            last = time.monotonic()


def parse(raw: bytes, method: bytes, target: bytes) -> tuple[h11.Response, dict[bytes, bytes], bytes]:
    """The answer as an HTTP/1.1 client reads it (h11): its head, headers and de-framed body,
    which must end at the connection's close (no bytes left over, nothing missing)."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target=target, headers=[(b"host", b"x"), (b"connection", b"close")]))
    client.send(h11.EndOfMessage())
    client.receive_data(raw)
    client.receive_data(b"")  # the EOF the client saw
    response, body = None, b""
    while True:
        event = client.next_event()
        if type(event) is h11.Response:
            response = event
        elif type(event) is h11.Data:
            body += event.data
        elif type(event) is h11.EndOfMessage:
            break
        else:
            pytest.fail(f"the answer is not whole: {event!r} after {raw[:400]!r}")
    assert response is not None
    return response, dict(response.headers), body


def sse_events(body: bytes) -> list[bytes]:
    events = [e for e in body.split(b"\n\n") if e.strip()]
    assert all(e.startswith(b"data: ") for e in events), body[:400]
    return [e[len(b"data: ") :] for e in events]


@pytest.mark.parametrize("version", [b"1.0", b"1.1"], ids=["http10", "http11-close"])
def test_an_answer_arrives_whole_and_the_server_closes(daemon, model, version):
    base = start_with_frontdoor(daemon, model)
    port = int(base.rsplit(":", 1)[1].split("/")[0])
    daemon.wait_state("ready")
    close = version == b"1.1"  # HTTP/1.0 closes by default
    target = b"/v1/chat/completions"
    request = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    # A whole JSON answer: its body parses and says the generation finished.
    raw, closed_after = ask(port, version, b"POST", target, json.dumps(request).encode(), close)
    response, headers, body = parse(raw, b"POST", target)
    assert response.status_code == 200, raw[:400]
    if version == b"1.0":
        assert b"transfer-encoding" not in headers, headers  # an HTTP/1.0 client knows no chunks
    answer = json.loads(body)
    assert answer["choices"][0]["finish_reason"] is not None, answer
    assert closed_after < 2.0, closed_after

    # A stream: every event whole, ending with [DONE].
    raw, closed_after = ask(port, version, b"POST", target, json.dumps({**request, "stream": True}).encode(), close)
    response, headers, body = parse(raw, b"POST", target)
    assert response.status_code == 200, raw[:400]
    if version == b"1.0":
        assert b"transfer-encoding" not in headers, headers
    events = sse_events(body)
    assert events[-1] == b"[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), chunks[-2:]
    assert closed_after < 2.0, closed_after

    # The front door's own answers (the models list, an error) close the same way.
    raw, closed_after = ask(port, version, b"GET", b"/v1/models", None, close)
    response, _, body = parse(raw, b"GET", b"/v1/models")
    assert response.status_code == 200 and json.loads(body)["data"], raw[:400]
    assert closed_after < 2.0, closed_after
    raw, closed_after = ask(port, version, b"POST", target, b'{"model": "nope"}', close)
    response, _, body = parse(raw, b"POST", target)
    assert response.status_code == 404 and json.loads(body)["error"]["code"] == "model_not_found", raw[:400]
    assert closed_after < 2.0, closed_after
