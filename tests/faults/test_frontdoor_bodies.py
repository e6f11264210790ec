"""Malformed request bodies at the front door, over real loopback sockets: a chunked body whose
coding is broken (`zz`, a size of 31 digits, a chunk longer than it says), sent with the head or
after it, and a JSON body nested 100,000 deep are answered 400 in the API's error shape (OpenAI's,
or Anthropic's on /v1/messages), never 500 with a traceback; the front door serves on.

The front door is the real one (`serve_frontdoor`: h11, the app, the limits) in front of a
daemon view with no engine: every request here is refused before one would be asked.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

import attrs
import pytest
import trio

from stoker.daemon.config.model import Config
from stoker.daemon.frontdoor.server import serve_frontdoor
from tests.unit.test_frontdoor_metrics import Daemon

HEAD = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
MALFORMED = {
    "not-hexadecimal": b"zz\r\n{}\r\n0\r\n\r\n",
    "over-long-size": b"1" + b"0" * 30 + b"\r\n{}\r\n0\r\n\r\n",
    "chunk-longer-than-it-says": b'2\r\n{"model":1}\r\n0\r\n\r\n',
    "size-with-a-sign": b"+2\r\n{}\r\n0\r\n\r\n",
}
DEEP = 100_000


@pytest.fixture
async def frontdoor(nursery) -> AsyncIterator[int]:
    config = Config()
    config = attrs.evolve(config, frontdoor=attrs.evolve(config.frontdoor, port=0))
    [bound] = await nursery.start(serve_frontdoor, Daemon(None, None, config=config))
    yield int(bound.rsplit(":", 1)[1])


async def exchange(port: int, request: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send `request` (with `body`, if any, sent once the server asks for it with 100 Continue:
    read after the head, not with it) and read the answer: status, headers, body."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        got = b""
        if body:
            await stream.send_all(request[:-2] + b"Expect: 100-continue\r\n\r\n")
            while b"\r\n\r\n" not in got:
                got += await stream.receive_some(65536)
            assert got.startswith(b"HTTP/1.1 100 "), got
            got = got[got.index(b"\r\n\r\n") + 4 :]
        await stream.send_all(body or request)
        while b"\r\n\r\n" not in got or len(got) < _whole(got):
            data = await stream.receive_some(65536)
            if not data:
                break
            got += data
    head, _, payload = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, payload


def _whole(got: bytes) -> int:
    head, _, _ = got.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return len(got) + 1


async def serves_on(port: int) -> None:
    """The front door answers its next client (a route it does not have: no engine is asked)."""
    status, _, body = await exchange(port, b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 404 and "No route" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("apart", [False, True], ids=["with-the-head", "after-the-head"])
async def test_a_malformed_chunked_body_gets_400_in_the_apis_shape(frontdoor, case, apart, caplog):
    caplog.set_level(logging.INFO, logger="stoker.frontdoor")
    body = MALFORMED[case]
    head = HEAD % b"/v1/chat/completions"
    with trio.fail_after(10):
        status, headers, payload = (
            await exchange(frontdoor, head, body) if apart else await exchange(frontdoor, head + body)
        )
        assert status == 400 and headers["content-type"] == "application/json", (status, payload)
        assert headers.get("connection") == "close"
        error = json.loads(payload)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "frontdoor_malformed_body"), error
        assert "chunk" in error["message"]
        await serves_on(frontdoor)
    assert "Traceback" not in caplog.text and "failed on" not in caplog.text


async def test_a_malformed_chunked_body_on_messages_gets_anthropics_shape(frontdoor):
    with trio.fail_after(10):
        status, _, payload = await exchange(frontdoor, HEAD % b"/v1/messages" + MALFORMED["not-hexadecimal"])
    answer = json.loads(payload)
    assert status == 400 and answer["type"] == "error"
    assert (answer["error"]["type"], answer["error"]["code"]) == ("invalid_request_error", "frontdoor_malformed_body")


async def test_a_malformed_chunked_body_to_a_route_that_reads_none_leaves_the_front_door_serving(frontdoor):
    with trio.fail_after(10):
        status, _, _ = await exchange(frontdoor, (HEAD % b"/nowhere") + MALFORMED["chunk-longer-than-it-says"])
        assert status == 404
        await serves_on(frontdoor)


@pytest.mark.parametrize("opener,closer", [(b"[", b"]"), (b'{"a":', b"}")], ids=["arrays", "objects"])
@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/messages"])
async def test_a_json_body_nested_100000_deep_gets_400_not_500(frontdoor, opener, closer, path, caplog):
    body = opener * DEEP + b"1" + closer * DEEP
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with trio.fail_after(20):
        status, headers, payload = await exchange(frontdoor, head % (path, len(body)) + body)
        assert status == 400 and headers["content-type"] == "application/json", (status, payload[:300])
        answer = json.loads(payload)
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]
        assert ("type" in answer) == (path == b"/v1/messages")  # Anthropic's envelope on its route
        await serves_on(frontdoor)
    assert "Traceback" not in caplog.text
