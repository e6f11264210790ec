"""/metrics on the front door, against a real daemon and llama-server, driven by the `openai` SDK.

A chat and a streamed chat are counted with their status, timed (first byte, duration) and
their tokens read from the engine's own figures; the backend in use is the CPU (proven, not
configured), nothing is accelerated, the server is ready. Restarts, crashes and fallbacks are
read from the store's history: a daemon restarted on the same home still reports them, while
the request figures (kept in memory) start again. With keys required, /metrics wants one too.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_frontdoor import sdk, start

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")
CHAT = "/v1/chat/completions"


def scrape(base: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(base.removesuffix("/v1") + "/metrics", headers=headers, trust_env=False, timeout=10)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def total(found: dict, name: str) -> float:
    return sum(v for (n, _), v in found.items() if n == name)


def new_server(daemon, old_pid: int) -> dict:
    return daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != old_pid, 120, "a new ready server")


def test_metrics_count_requests_and_keep_history_across_a_daemon_restart(daemon, model):
    base = start(daemon, model)
    first = daemon.wait_state("ready")
    client = sdk(base)
    messages = [{"role": "user", "content": "hi"}]
    # ignore_eos: the random tiny model may say its end-of-text at once; the counts must not hang on it.
    whole = {"ignore_eos": True}
    reply = client.chat.completions.create(model="default", messages=messages, max_tokens=4, extra_body=whole)
    chunks = list(
        client.chat.completions.create(model="default", messages=messages, max_tokens=3, stream=True, extra_body=whole)
    )
    # Not a count of chunks: the random model's tokens may decode to no text (a part of a UTF-8
    # character), and the engine then sends no delta for them, only the closing chunk.
    assert reply.usage is not None and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)

    page = scrape(base)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain; version=0.0.4")
    found = samples(page.text)
    assert value(found, "stoker_requests_total", route=CHAT, code="200") == 2
    assert value(found, "stoker_requests_total", route=CHAT, code="404") == 1
    assert value(found, "stoker_request_first_byte_seconds_count", route=CHAT) == 2  # the 404 has no first token
    assert value(found, "stoker_request_duration_seconds_count", route=CHAT) == 3
    assert 0 < value(found, "stoker_request_first_byte_seconds_sum", route=CHAT) < 60
    # What the front door itself added to those two first bytes: its share, the engine's left out.
    assert value(found, "stoker_frontdoor_added_seconds_count", route=CHAT) == 2
    added = value(found, "stoker_frontdoor_added_seconds_sum", route=CHAT)
    assert 0 < added < value(found, "stoker_request_first_byte_seconds_sum", route=CHAT)
    # The engine's own count: the non-streamed answer's usage, plus the streamed one's timings.
    generated = value(found, "stoker_generated_tokens_total", route=CHAT)
    assert generated == reply.usage.completion_tokens + 3, generated
    assert value(found, "stoker_generation_tokens_per_second_count", route=CHAT) == 2
    assert value(found, "stoker_generation_seconds_total", route=CHAT) > 0
    # What only Stoker knows: the plan and the proof agree on the CPU; nothing is accelerated.
    # One model, no [models]: its label is `default`.
    m = {"model": "default"}
    assert value(found, "stoker_server_state", state="ready", **m) == 1
    assert total(found, "stoker_server_state") == 1
    assert value(found, "stoker_backend_info", planned="cpu", in_use="cpu", **m) == 1
    assert value(found, "stoker_accelerated", **m) == 0 and value(found, "stoker_offloaded_layers", **m) == 0
    assert value(found, "stoker_queue_depth", **m) == 0 and value(found, "stoker_requests_in_flight", **m) == 0
    # auto on a machine without a GPU: each GPU backend passed over, as status lists them.
    status = daemon.call("status")
    counted: dict[str, set[str]] = {}
    for (name, labels), _ in found.items():
        if name == "stoker_fallbacks_total":
            counted.setdefault(dict(labels)["from"], set()).add(dict(labels)["reason"])
    assert counted == {f["backend"]: {f["reason"]} for f in status["fallbacks"]}
    fallbacks_before = total(found, "stoker_fallbacks_total")
    assert fallbacks_before == len(status["fallbacks"]) > 0

    daemon.call("restart")  # a restart asked for
    second = new_server(daemon, first["pid"])
    os.kill(second["pid"], signal.SIGKILL)  # and a crash, respawned
    third = new_server(daemon, second["pid"])
    found = samples(scrape(base).text)
    assert value(found, "stoker_server_restarts_total", cause="requested", **m) == 1
    assert value(found, "stoker_server_restarts_total", cause="crash", **m) == 1
    assert total(found, "stoker_server_crashes_total") == 1 and value(found, "stoker_crash_loops_total", **m) == 0
    before = {k: v for k, v in found.items() if k[0] in ("stoker_server_restarts_total", "stoker_server_crashes_total")}
    fallbacks_before = total(found, "stoker_fallbacks_total")

    # A new daemon on the same home (keys required this time): the history's counters are kept.
    daemon.stop()
    base = start(daemon, model, require_keys="true")
    daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != third["pid"], 120, "the new daemon's server")
    assert scrape(base).status_code == 401
    key = daemon.call("key.create", name="prometheus")["key"]
    page = scrape(base, key)
    assert page.status_code == 200
    found = samples(page.text)
    assert {k: v for k, v in found.items() if k in before} == before
    assert total(found, "stoker_fallbacks_total") >= fallbacks_before  # the new start planned again
    assert value(found, "stoker_requests_total", route=CHAT, code="200") is None  # request figures are per daemon
    assert value(found, "stoker_backend_info", planned="cpu", in_use="cpu", **m) == 1


@pytest.fixture
def other_model(tmp_path):
    """A second tiny model (other weights)."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path / "other" / "other.gguf", seed=7)


def test_two_models_each_have_their_own_series(daemon, model, other_model):
    """alpha (the default, started with the daemon) and beta (loaded on demand while its request
    is held): each its own state, backend, layers, held and in-flight requests, and restarts by
    the model whose launch machine recorded them."""
    from tests.integration.daemon_harness import servers_for
    from tests.integration.test_several_models import two_models, wait_model

    try:
        base = two_models(daemon, model, other_model, max_loaded=2)
        wait_model(daemon, "alpha", "ready")
        found = samples(scrape(base).text)
        a, b = {"model": "alpha"}, {"model": "beta"}
        assert value(found, "stoker_server_state", state="ready", **a) == 1
        assert value(found, "stoker_server_state", state="stopped", **b) == 1  # not loaded yet
        assert value(found, "stoker_backend_info", planned="cpu", in_use="cpu", **a) == 1
        assert not any(n == "stoker_backend_info" and dict(labels)["model"] == "beta" for n, labels in found)
        assert value(found, "stoker_server_restarts_total", cause="requested", **b) == 0  # configured: from zero

        client = sdk(base)
        client.completions.create(model="beta", prompt="The", max_tokens=2)  # held while beta loads
        daemon.call("restart", model="alpha")
        alpha = wait_model(daemon, "alpha", "ready")
        found = samples(scrape(base).text)
        for labels in (a, b):
            assert value(found, "stoker_server_state", state="ready", **labels) == 1
            assert value(found, "stoker_backend_info", planned="cpu", in_use="cpu", **labels) == 1
            assert value(found, "stoker_accelerated", **labels) == 0
            assert value(found, "stoker_offloaded_layers", **labels) == 0
            assert value(found, "stoker_requests_in_flight", **labels) == 0
        assert (
            value(found, "stoker_requests_held_total", **b) == 1
            and value(found, "stoker_requests_held_total", **a) == 0
        )
        assert value(found, "stoker_server_restarts_total", cause="requested", **a) == 1
        assert value(found, "stoker_server_restarts_total", cause="requested", **b) == 0
        assert total(found, "stoker_server_state") == 2  # one state each
        assert {m["name"]: m["state"] for m in alpha["models"]} == {"alpha": "ready", "beta": "ready"}
    finally:
        daemon.stop()
        leftovers = servers_for(other_model)
        for proc in leftovers:
            proc.kill()
        assert not leftovers
