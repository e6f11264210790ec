"""CORS at the front door, over real sockets against a real daemon and llama-server.

`[frontdoor] cors_origins` lists the web pages' origins that may call; the front door answers
every path's preflight itself (before any key check, as a browser sends none with it), puts the
Access-Control-* headers on every answer to a listed origin (relayed streams and errors too),
refuses other origins with 403 `frontdoor_origin_refused`, never allows credentials for `*`, and
takes a reload of the list without a relaunch.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.daemon_harness import free_port, tiny_config, write_config
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]

APP = "http://app.example:3000"
ELSEWHERE = "https://elsewhere.example"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# Every kind of route: forwarded, forwarded by query, the front door's own, refused, and none.
PATHS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/tokenize"),
    ("GET", "/props"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/default"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/slots/0"),
    ("GET", "/no/such/path"),
]


def config(model, port: int, origins: list[str], **frontdoor: str) -> str:
    listed = ", ".join(f'"{origin}"' for origin in origins)
    extra = "".join(f"{key} = {value}\n" for key, value in frontdoor.items())
    return tiny_config(model) + f"[frontdoor]\nport = {port}\ncors_origins = [{listed}]\n{extra}"


@pytest.fixture
def front(daemon, model):
    port = free_port()
    write_config(daemon.paths, config(model, port, [APP]))
    daemon.start()
    daemon.wait_state("ready")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60) as client:
        client.port = port  # type: ignore[attr-defined]
        yield client


def preflight(client: httpx.Client, path: str, method: str, origin: str) -> httpx.Response:
    return client.options(
        path,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang",
        },
    )


def test_every_route_answers_a_listed_origins_preflight(front):
    for method, path in PATHS:
        answer = preflight(front, path, method, APP)
        assert answer.status_code == 204, (path, answer.text)
        headers = answer.headers
        assert headers["access-control-allow-origin"] == APP, path
        assert headers["access-control-allow-credentials"] == "true"
        assert method in headers["access-control-allow-methods"].split(", "), (path, headers)
        assert headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-lang"
        assert int(headers["access-control-max-age"]) > 0 and "Origin" in headers.get_list("vary")
    # Chromium asks before a public page may reach a private address (Private Network Access).
    private = front.options(
        "/v1/chat/completions",
        headers={
            "Origin": APP,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Private-Network": "true",
        },
    )
    assert private.status_code == 204 and private.headers["access-control-allow-private-network"] == "true"


def test_a_listed_origins_answers_carry_the_headers_streams_and_errors_too(front):
    origin = {"Origin": APP}
    plain = front.post("/v1/chat/completions", json=CHAT, headers=origin)
    assert plain.status_code == 200 and plain.headers["access-control-allow-origin"] == APP
    with front.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=origin) as stream:
        assert stream.headers["access-control-allow-origin"] == APP
        assert b"[DONE]" in b"".join(stream.iter_bytes())
    tokens = front.post("/tokenize", json={"content": "hello"}, headers=origin)
    assert tokens.status_code == 200 and tokens.headers["access-control-allow-origin"] == APP
    missing = front.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=origin)
    assert missing.status_code == 404 and missing.headers["access-control-allow-origin"] == APP
    # A page's script may read Retry-After on a 503 (not a CORS-safelisted header).
    assert "Retry-After" in plain.headers["access-control-expose-headers"]


def test_other_origins_are_refused_and_the_front_doors_own_passes(front):
    denied = preflight(front, "/v1/chat/completions", "POST", ELSEWHERE)
    assert denied.status_code == 403 and "access-control-allow-origin" not in denied.headers
    assert denied.json()["error"]["code"] == "frontdoor_origin_refused"
    assert ELSEWHERE in denied.json()["error"]["message"]
    # A form's POST needs no preflight: refused all the same, so a page elsewhere cannot make the
    # engine work for it.
    form = {"Origin": ELSEWHERE, "Content-Type": "text/plain"}
    simple = front.post("/v1/chat/completions", content=json.dumps(CHAT), headers=form)
    assert simple.status_code == 403 and simple.json()["error"]["code"] == "frontdoor_origin_refused"
    # Anthropic's route answers in Anthropic's shape.
    anthropic = front.post("/v1/messages", json=CHAT, headers={"Origin": ELSEWHERE})
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["code"] == "frontdoor_origin_refused"

    own = front.post("/v1/chat/completions", json=CHAT, headers={"Origin": f"http://127.0.0.1:{front.port}"})
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers
    # A name made to resolve to 127.0.0.1 is not the front door's own origin while no key is needed.
    rebound = front.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"Origin": f"http://rebound.example:{front.port}", "Host": f"rebound.example:{front.port}"},
    )
    assert rebound.status_code == 403
    # Without an Origin (curl, the SDKs, servers) nothing changes.
    assert "access-control-allow-origin" not in front.post("/v1/chat/completions", json=CHAT).headers


def test_a_star_allows_any_origin_without_credentials_and_a_reload_applies(daemon, model, front):
    write_config(daemon.paths, config(model, front.port, ["*"]))
    wait_until(
        lambda: "config reloaded: frontdoor.cors_origins" in daemon.log_text(),
        timeout=30,
        what="the log line of the cors_origins change applied",
    )
    answer = preflight(front, "/v1/chat/completions", "POST", ELSEWHERE)
    assert answer.status_code == 204 and answer.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in answer.headers
    chat = front.post("/v1/chat/completions", json=CHAT, headers={"Origin": ELSEWHERE})
    assert chat.status_code == 200 and chat.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in chat.headers


def test_a_preflight_needs_no_key_where_keys_are_required(daemon, model):
    port = free_port()
    write_config(daemon.paths, config(model, port, [APP], require_keys="true"))
    daemon.start()
    daemon.wait_state("ready")
    key = daemon.call("key.create", name="page")["key"]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60) as client:
        answer = preflight(client, "/v1/chat/completions", "POST", APP)
        assert answer.status_code == 204 and answer.headers["access-control-allow-origin"] == APP
        refused = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": APP})
        # The page can read why: the 401 carries the CORS headers too.
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP
        keyed = client.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": APP, "Authorization": f"Bearer {key}"}
        )
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == APP
