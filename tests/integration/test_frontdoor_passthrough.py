"""The engine's whole client API through the front door, each route against the engine itself.

A real daemon runs llama-server (the tiny model with fill-in-the-middle tokens, `--reranking` so
that rerank answers); each test sends the same request to the engine directly (its endpoint and
per-launch key from `status`) and through the front door, and compares the answers: the front door
must pass each on as the engine gave it. The clients are the ones users have: the `openai` SDK for `responses.create` and
`models.retrieve`, the `anthropic` SDK for `messages.count_tokens`, httpx for llama-server's own
routes. Routes that would break Stoker's guarantees are refused with a reason code, and the front
door's own /health says per model whether it is ready.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.daemon_harness import free_port, tiny_config, write_config

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

# Greedy, and held to letters and spaces by a grammar: the random tiny model's tokens are often bytes of
# unfinished UTF-8 characters, which the engine cannot write into a JSON answer (it answers 500).
GREEDY = {"temperature": 0, "grammar": "root ::= [a-z ]+"}


class Pair:
    """The front door and the engine behind it, asked the same thing."""

    def __init__(self, daemon, root: str) -> None:
        self.daemon = daemon
        self.root = root  # the front door, without /v1
        status = daemon.wait_state("ready")
        self.engine = status["endpoint"]
        self.key = status["api_key"]
        self.front = httpx.Client(base_url=root, trust_env=False, timeout=60)
        self.direct = httpx.Client(
            base_url=self.engine, trust_env=False, timeout=60, headers={"Authorization": f"Bearer {self.key}"}
        )

    def both(self, method: str, path: str, body: Any = None) -> tuple[httpx.Response, httpx.Response]:
        """The engine's answer, then the front door's, to the same request."""
        direct = self.direct.request(method, path, json=body)
        front = self.front.request(method, path, json=body)
        return direct, front

    def openai(self, through_front: bool) -> openai.OpenAI:
        base, key = (f"{self.root}/v1", "none") if through_front else (f"{self.engine}/v1", self.key)
        return openai.OpenAI(
            base_url=base, api_key=key, max_retries=0, http_client=openai.DefaultHttpxClient(trust_env=False)
        )

    def anthropic(self, through_front: bool) -> anthropic.Anthropic:
        base, key = (self.root, "none") if through_front else (self.engine, self.key)
        return anthropic.Anthropic(
            base_url=base, api_key=key, max_retries=0, http_client=anthropic.DefaultHttpxClient(trust_env=False)
        )


def start(daemon, model, **frontdoor: str) -> Pair:
    port = free_port()
    lines = [f"port = {port}", *(f"{key} = {value}" for key, value in frontdoor.items())]
    config = tiny_config(model, extra_args=["--reranking"]) + "[frontdoor]\n" + "\n".join(lines) + "\n"
    write_config(daemon.paths, config)
    daemon.start()
    return Pair(daemon, f"http://127.0.0.1:{port}")


@pytest.fixture
def model(tmp_path):
    """The tiny model with fill-in-the-middle tokens, so that /infill answers."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path / "tiny-fim.gguf", fim=True)


@pytest.fixture
def pair(daemon, model):
    return start(daemon, model)


def same(direct: httpx.Response, front: httpx.Response, *, drop: tuple[str, ...] = ()) -> dict:
    """Both answered alike: status, content type and JSON (less the fields each answer makes anew)."""
    assert front.status_code == direct.status_code, (direct.text, front.text)
    assert front.headers["content-type"] == direct.headers["content-type"]
    a, b = direct.json(), front.json()
    if isinstance(a, dict):
        a = {k: v for k, v in a.items() if k not in drop}
        b = {k: v for k, v in b.items() if k not in drop}
    assert b == a
    return b


def test_responses_through_the_openai_sdk(pair):
    asked = {"model": "default", "input": "once upon a time", "max_output_tokens": 6, "extra_body": GREEDY}
    direct = pair.openai(False).responses.create(**asked)
    front = pair.openai(True).responses.create(**asked)
    assert front.output_text == direct.output_text and front.status == "completed"
    assert front.usage is not None and direct.usage is not None
    assert front.usage.output_tokens == direct.usage.output_tokens == 6
    assert front.usage.input_tokens == direct.usage.input_tokens
    assert front.model == asked["model"]  # the name the client sent, whatever the engine calls it

    # Streamed: the same events, in the same order, ending with the whole response. (The SDK's
    # `responses.stream()` helper cannot follow llama-server b11434's events, which lack
    # `output_index`, on the engine directly as through the front door: the raw events are compared.)
    events = {}
    for name, client in (("direct", pair.openai(False)), ("front", pair.openai(True))):
        streamed = list(client.responses.create(**asked, stream=True))
        last = streamed[-1]
        assert last.type == "response.completed"
        events[name] = ([event.type for event in streamed], last.response.output_text)
    assert events["front"] == events["direct"], events
    assert events["front"][1] == direct.output_text and len(events["front"][0]) > 5


def test_count_tokens_through_the_anthropic_sdk(pair):
    asked = {"model": "default", "system": "be brief", "messages": [{"role": "user", "content": "hello world"}]}
    direct = pair.anthropic(False).messages.count_tokens(**asked)
    front = pair.anthropic(True).messages.count_tokens(**asked)
    assert front.input_tokens == direct.input_tokens > 0
    # Its errors are Anthropic's shape, with the reason code.
    with pytest.raises(anthropic.NotFoundError) as missing:
        pair.anthropic(True).messages.count_tokens(model="no-such-model", messages=asked["messages"])
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert missing.value.body["error"]["code"] == "model_not_found"


def test_models_retrieve_through_the_openai_sdk(pair):
    client = pair.openai(True)
    listed = client.models.list().data
    assert len(listed) == 1
    for name in (listed[0].id, "default"):
        one = client.models.retrieve(name)
        assert one.id == listed[0].id and one.object == "model" and one.owned_by == "stoker"
        assert one.model_extra is not None and one.model_extra["stoker"]["state"] == "ready"
        # The same record, read a moment later: only the idle clock may have moved on.
        got, before = dict(one.model_extra["stoker"]), dict(listed[0].model_extra["stoker"])
        assert got.pop("idle_s") >= before.pop("idle_s")
        assert got == before
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank(pair, path):
    body = {"model": "default", "query": "the cat", "documents": ["a cat", "the train", "green steam"], "top_n": 3}
    answer = same(*pair.both("POST", path, body))
    assert len(answer["results"]) == 3


def test_tokenize_detokenize_and_apply_template(pair):
    tokens = same(*pair.both("POST", "/tokenize", {"model": "default", "content": "hello world", "with_pieces": True}))
    assert tokens["tokens"]
    ids = [t["id"] for t in tokens["tokens"]]
    text = same(*pair.both("POST", "/detokenize", {"model": "default", "tokens": ids}))
    assert text["content"].strip() == "hello world"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = same(*pair.both("POST", "/apply-template", {"model": "default", "messages": messages}))
    assert "be brief" in prompt["prompt"] and "hi" in prompt["prompt"]


def test_infill(pair):
    body = {"model": "default", "input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4}
    direct, front = pair.both("POST", "/infill", {**body, **GREEDY})
    assert direct.status_code == front.status_code == 200, (direct.text, front.text)
    assert front.json()["content"] == direct.json()["content"] and front.json()["tokens_predicted"] == 4


def test_props_by_query_and_default(pair):
    direct = pair.direct.get("/props")
    for path in ("/props", "/props?model=default", f"/props?model={pair.daemon.call('status')['model']}"):
        same(direct, pair.front.get(path))
    missing = pair.front.get("/props?model=no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/slots/0?action=save", {"filename": "x.bin"}),
        ("POST", "/slots/0?action=restore", {"filename": "x.bin"}),
        ("POST", "/slots/0?action=erase", None),
        ("GET", "/slots", None),
        ("POST", "/props", {"n_predict": 1}),
        ("POST", "/models/load", {"model": "default"}),
        ("POST", "/models/unload", {"model": "default"}),
        ("POST", "/lora-adapters", [{"id": 0, "scale": 1}]),
    ],
)
def test_routes_that_break_a_guarantee_are_refused(pair, method, path, body):
    refused = pair.front.request(method, path, json=body)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "frontdoor_route_refused" and error["type"] == "invalid_request_error"
    assert "not served through the front door" in error["message"]
    # The engine itself would have answered it.
    assert pair.direct.request(method, path, json=body).status_code != 403


def test_health_says_per_model_whether_it_is_ready(pair):
    health = pair.front.get("/health")
    assert health.status_code == 200
    assert health.json() == {
        "status": "ok",
        "models": [{"name": "default", "state": "ready", "ready": True, "loads_on_demand": False, "default": True}],
    }
    assert pair.front.get("/health?model=default").json()["model"]["ready"] is True
    assert pair.front.get("/health?model=nope").status_code == 404
    pair.daemon.call("down")
    down = pair.front.get("/health?model=default")
    assert down.status_code == 503 and down.json()["status"] == "not_ready"
    assert down.json()["model"]["state"] == "stopped" and down.json()["model"]["ready"] is False
    assert pair.front.get("/health").status_code == 200  # the front door itself serves


def test_passthrough_routes_keep_the_keys_the_access_log_and_the_metrics(daemon, model):
    pair = start(daemon, model, require_keys="true")
    key = daemon.call("key.create", name="tools")["key"]
    body = {"model": "default", "content": "hello"}
    refused = pair.front.post("/tokenize", json=body)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert pair.front.get("/props").status_code == 401
    assert pair.front.get("/v1/models/default").status_code == 401
    # A health check without a key learns only that the front door serves.
    assert pair.front.get("/health").json() == {"status": "ok"}
    auth = {"Authorization": f"Bearer {key}"}
    assert (
        pair.front.post("/tokenize", json=body, headers=auth).json() == pair.direct.post("/tokenize", json=body).json()
    )
    assert pair.front.get("/v1/models/default", headers=auth).status_code == 200
    assert len(pair.front.get("/health", headers=auth).json()["models"]) == 1

    metrics = pair.front.get("/metrics", headers=auth).text
    assert 'stoker_requests_total{code="200",route="/tokenize"} 1.0' in metrics
    assert 'stoker_requests_total{code="401",route="/tokenize"} 1.0' in metrics
    assert 'stoker_requests_total{code="200",route="/v1/models/{id}"} 1.0' in metrics
    access = [line for line in daemon.log_text().splitlines() if "stoker.access" in line]
    tokenize = [line for line in access if " POST /tokenize 200 " in line]
    assert len(tokenize) == 1 and "model=default instance=default" in tokenize[0] and "key=tools" in tokenize[0]


def test_a_passthrough_request_is_held_across_a_restart(pair):
    first = pair.daemon.call("status")
    pair.daemon.call("restart")
    assert pair.daemon.call("status")["state"] != "ready"
    answer = pair.front.post("/tokenize", json={"model": "default", "content": "hello"})
    assert answer.status_code == 200 and answer.json()["tokens"]
    assert pair.daemon.wait_state("ready")["pid"] != first["pid"]


def test_a_remote_model_takes_the_openai_routes_only(daemon, model):
    """A remote model ([models.NAME] endpoint) is reached through the OpenAI-compatible routes:
    /v1/responses goes to its endpoint (here nothing listens: 503 remote_endpoint_unreachable), a
    llama-server route gets 400 remote_route_unsupported without the endpoint being asked."""
    port, nowhere = free_port(), free_port()
    remote = f'[models.far]\nendpoint = "http://127.0.0.1:{nowhere}/v1"\n'
    write_config(daemon.paths, tiny_config(model) + remote + f"[frontdoor]\nport = {port}\n")
    daemon.start()
    daemon.wait_state("ready")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60) as front:
        sent = front.post("/v1/responses", json={"model": "far", "input": "hi"})
        assert sent.status_code == 503 and sent.json()["error"]["code"] == "remote_endpoint_unreachable"
        for method, path, body in (
            ("POST", "/tokenize", {"model": "far", "content": "hi"}),
            ("GET", "/props?model=far", None),
        ):
            refused = front.request(method, path, json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "remote_route_unsupported"
        # The local model still answers them.
        assert front.post("/tokenize", json={"content": "hi"}).status_code == 200
