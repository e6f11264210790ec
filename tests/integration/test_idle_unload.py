"""Idle unloads that keep the conversation: a real daemon, real llama-servers on tiny models,
requests through the front door.

A model with `idle_ttl_s = 2` is unloaded 2 s after its last request ended (a drained planned
stop with cause idle, its slots saved first), never while a request is in flight, never when
pinned; its history says idle and `stoker status` counts down, then says "unloaded (idle), N
slots saved". The next request loads it again and is held; the slots are restored before it is
answered, so the conversation's continuation is token-identical to the one the model gave
before it left, and the engine reports the whole conversation as cached (timings.cache_n) with
only the new tokens read (timings.prompt_n). A restore refused at the reload (the context size
changed meanwhile) still answers, by reading the conversation again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from stoker.daemon.core.errors import StokerError
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.integration.daemon_harness import free_port

pytestmark = [pytest.mark.engine]

TTL = 2.0
PROMPT = "hello world, this conversation goes on for a while"  # ~50 tokens of ctx 256
MORE = " and then some more"


@pytest.fixture
def other_model(tmp_path) -> Path:
    """A second tiny model (other weights, the same vocabulary)."""
    return write_tiny_model(tmp_path / "other" / "other.gguf", seed=7)


@pytest.fixture
def no_server_left(daemon, other_model):
    yield
    daemon.stop()
    leftovers = servers_for(other_model)
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


def start(daemon: DaemonProcess, sections: str, first: Path, max_loaded: int = 2, **server: object) -> str:
    """Start `daemon` with snapshots on, `sections` ([models.*]) and a front door; its base URL."""
    port = free_port()
    text = (
        tiny_config(first, snapshots=True, **server)
        + f"[placement]\nmax_loaded = {max_loaded}\n"
        + sections
        + f"[frontdoor]\nport = {port}\nhold_timeout_s = 120\n"
    )
    write_config(daemon.paths, text)
    daemon.start()
    return f"http://127.0.0.1:{port}"


def models_of(daemon: DaemonProcess) -> dict[str, dict]:
    return {m["name"]: m for m in daemon.call("status")["models"]}


def wait_model(daemon: DaemonProcess, name: str, state: str, timeout: float = 60.0) -> dict:
    daemon.wait_for(lambda s: any(m["name"] == name and m["state"] == state for m in s["models"]), timeout)
    return models_of(daemon)[name]


def tokenize(daemon: DaemonProcess, name: str, text: str) -> list[int]:
    """`text`'s tokens, asked of `name`'s own engine (not a use of the model: never through the front door)."""
    st = daemon.call("status", model=name)
    reply = httpx.post(
        f"{st['endpoint']}/tokenize",
        json={"content": text},
        headers={"Authorization": f"Bearer {st['api_key']}"},
        trust_env=False,
        timeout=60,
    )
    return reply.json()["tokens"]


def turn(base: str, model: str, prompt: list[int], n: int = 12) -> tuple[list[int], dict]:
    """One greedy turn through the front door: the tokens it generated, and the engine's timings."""
    reply = httpx.post(
        f"{base}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "seed": 1,
            "return_tokens": True,
            "verbose": True,  # llama-server's own answer beside OpenAI's: the generated token ids
        },
        trust_env=False,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    tokens = body["__verbose"]["tokens"]
    assert len(tokens) == n, body
    return tokens, body["timings"]


def test_an_idle_model_is_unloaded_and_its_conversation_comes_back_token_identical(
    daemon, model, other_model, no_server_left
):
    # alpha: pinned (never unloaded for idleness, whatever its TTL); beta loads on demand.
    base = start(
        daemon,
        f'[models.alpha]\nmodel = "{other_model}"\ndefault = true\npinned = true\nidle_ttl_s = {TTL}\n'
        f'[models.beta]\nmodel = "{model}"\nidle_ttl_s = {TTL}\n',
        other_model,
    )
    wait_model(daemon, "alpha", "ready")
    first = tokenize(daemon, "alpha", PROMPT)  # the same vocabulary as beta's

    # A conversation with beta (loaded on demand for it), and the continuation it gives while loaded.
    gen, _ = turn(base, "beta", first)
    second = first + gen + tokenize(daemon, "alpha", MORE)
    reference, _ = turn(base, "beta", second)
    again, _ = turn(base, "beta", first)  # the slot holds the first turn again, as the user left it
    assert again == gen
    last_answer = time.time()

    # While it waits, status counts down to the unload.
    beta = models_of(daemon)["beta"]
    assert beta["state"] == "ready" and 0 < beta["idle_unload_in_s"] <= TTL, beta
    beta = wait_model(daemon, "beta", "stopped", timeout=30)
    unloaded_after = time.time() - last_answer
    assert unloaded_after >= TTL - 0.1, unloaded_after  # not before its TTL
    assert beta["down_cause"] == "idle" and beta["loads_on_demand"] and beta["slots_saved"] == 1, beta
    assert not servers_for(model)
    history = daemon.history(machine="launch:beta", limit=50)
    (idle,) = [r for r in history if r["reason"] == "idle_unloaded"]
    assert idle["to_state"] == "stopping" and idle["event_data"]["cause"] == "idle"
    assert idle["evidence"]["idle_ttl_s"] == TTL and idle["evidence"]["idle_s"] >= TTL - 0.1
    (saved,) = [s for s in daemon.call("snapshot.list", model="beta")["snapshots"] if s["cause"] == "idle"]
    assert saved["n_tokens"] >= len(first) + len(gen) - 1
    done = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status"], env=daemon.env, capture_output=True, text=True, timeout=60
    )
    assert "unloaded (idle), 1 slots saved" in " ".join(done.stdout.split()), done.stdout

    # alpha is pinned: idle far past its TTL, still loaded.
    alpha = models_of(daemon)["alpha"]
    assert alpha["state"] == "ready" and alpha["idle_s"] > TTL and alpha["idle_unload_in_s"] is None, alpha

    # The user comes back: the request loads beta again (held), the slot is restored before it
    # is answered, and the continuation is the one beta gave while it stayed loaded.
    assert models_of(daemon)["beta"]["state"] == "stopped"
    sent = time.time()
    after, timings = turn(base, "beta", second)
    answered = time.time()
    # It was held: beta was loaded for it, between its send and its answer.
    (ready,) = [r for r in daemon.history(machine="launch:beta", limit=20) if r["event"] == "Ready" and r["at"] >= sent]
    assert ready["at"] <= answered
    assert after == reference
    assert timings["cache_n"] >= len(first) + len(gen) - 1, timings  # the conversation was not read again
    assert timings["prompt_n"] <= len(second) - len(first), timings
    st = daemon.call("status", model="beta")
    (restored,) = st["snapshots"]["restored"]
    assert restored["id"] == saved["id"] and restored["slot"] == 0
    print(f"unloaded {unloaded_after:.2f} s after the last answer; reload answered with cache_n {timings['cache_n']}")


def test_never_unloaded_while_a_request_is_in_flight(daemon, model, other_model, no_server_left):
    base = start(daemon, f'[models.solo]\nmodel = "{model}"\ndefault = true\nidle_ttl_s = {TTL}\n', model)
    wait_model(daemon, "solo", "ready")
    first = tokenize(daemon, "solo", PROMPT)
    turn(base, "solo", first)
    pid = models_of(daemon)["solo"]["pid"]
    # The engine stops answering (SIGSTOP) with a request in flight: for 2 TTLs, that request is
    # all there is; the model must stay loaded.
    os.kill(pid, signal.SIGSTOP)
    outcome: dict[str, object] = {}
    asker = threading.Thread(target=lambda: outcome.update(answer=turn(base, "solo", first)))
    try:
        asker.start()
        daemon.wait_for(lambda s: s["models"][0]["in_flight"] == 1, 30, "the request in flight")
        time.sleep(2 * TTL)
        solo = models_of(daemon)["solo"]
        assert solo["state"] == "ready" and solo["pid"] == pid and solo["in_flight"] == 1, solo
        assert solo["idle_unload_in_s"] is None  # no countdown while in use
    finally:
        os.kill(pid, signal.SIGCONT)
    asker.join(60)
    assert "answer" in outcome
    ended = time.time()
    solo = wait_model(daemon, "solo", "stopped", timeout=30)  # then idle: unloaded TTL after that answer
    assert time.time() - ended >= TTL - 0.2 and solo["down_cause"] == "idle"


def test_a_restore_refused_after_the_unload_still_answers_by_reading_the_conversation_again(
    daemon, model, other_model, no_server_left
):
    sections = f'[models.solo]\nmodel = "{model}"\ndefault = true\nidle_ttl_s = {TTL}\n'
    base = start(daemon, sections, model)
    wait_model(daemon, "solo", "ready")
    first, more = tokenize(daemon, "solo", PROMPT), tokenize(daemon, "solo", MORE)
    gen, _ = turn(base, "solo", first)
    solo = wait_model(daemon, "solo", "stopped", timeout=30)
    assert solo["down_cause"] == "idle" and solo["slots_saved"] == 1
    # While it is unloaded, its context size changes: the saved slot no longer fits the next server.
    write_config(
        daemon.paths,
        daemon.paths.config_file.read_text().replace(
            sections, sections.replace("idle_ttl_s", "ctx_size = 512\nidle_ttl_s")
        ),
    )
    daemon.wait_for(
        lambda s: any(r["event"] == "ConfigChanged" for r in daemon.history(machine="launch:solo", limit=5)),
        30,
        "the new config",
    )
    second = first + gen + more
    after, timings = turn(base, "solo", second)  # held, loaded with ctx 512, answered all the same
    assert len(after) == 12
    assert timings["cache_n"] == 0 and timings["prompt_n"] == len(second), timings  # read again, whole
    st = daemon.call("status", model="solo")
    assert st["n_ctx"] == 512 and st["snapshots"]["restored"] == []
    (refused,) = st["snapshots"]["refused"]
    assert refused["reason"] == "snapshot_layout_mismatch" and "n_ctx" in refused["evidence"]["differs"]


def test_two_conversations_in_two_slots_each_come_back_to_its_own_slot(daemon, model, other_model, no_server_left):
    """With two slots, no id_slot: after the reload each continuation lands in the slot that holds
    its conversation (the engine picks the slot sharing the longest prefix with the prompt)."""
    base = start(daemon, f'[models.duo]\nmodel = "{model}"\ndefault = true\nidle_ttl_s = {TTL}\nparallel = 2\n', model)
    wait_model(daemon, "duo", "ready")
    talks = [tokenize(daemon, "duo", text) for text in (PROMPT, "a different talk about quiet amber lanterns")]
    more = tokenize(daemon, "duo", MORE)
    answers = [turn(base, "duo", talk)[0] for talk in talks]
    nexts = [talk + answer + more for talk, answer in zip(talks, answers)]
    references = [turn(base, "duo", nxt)[0] for nxt in nexts]
    for talk in talks:  # each slot as its user left it
        turn(base, "duo", talk)
    duo = wait_model(daemon, "duo", "stopped", timeout=30)
    assert duo["down_cause"] == "idle" and duo["slots_saved"] == 2, duo
    # Asked in the other order than they were left: each still finds its own slot.
    for i in (1, 0):
        after, timings = turn(base, "duo", nexts[i])
        assert after == references[i]
        assert timings["cache_n"] >= len(talks[i]) + len(answers[i]) - 1, (i, timings)
    restored = daemon.call("status", model="duo")["snapshots"]["restored"]
    assert sorted(r["slot"] for r in restored) == [0, 1]


def test_two_sections_on_one_file_never_restore_each_others_conversation(daemon, model, other_model, no_server_left):
    """[models.a] and [models.b] serve the same file with the same layout: a conversation held by
    a comes back to a only; b's reload restores nothing of it (it re-reads a prompt it never saw),
    and after a daemon restart status still says how many slots each one's last stop saved."""
    base = start(
        daemon,
        f'[models.c]\nmodel = "{other_model}"\ndefault = true\npinned = true\n'
        f'[models.a]\nmodel = "{model}"\nidle_ttl_s = {TTL}\n'
        f'[models.b]\nmodel = "{model}"\nidle_ttl_s = {TTL}\n',
        other_model,
        max_loaded=3,
    )
    wait_model(daemon, "c", "ready")
    first, more = tokenize(daemon, "c", PROMPT), tokenize(daemon, "c", MORE)  # one vocabulary for all three

    # A conversation with a; b is loaded beside it and talks to nobody.
    gen, _ = turn(base, "a", first)
    second = first + gen + more
    reference, _ = turn(base, "a", second)
    assert turn(base, "a", first)[0] == gen  # a's slot holds the first turn again, as its user left it
    daemon.call("up", model="b")
    wait_model(daemon, "b", "ready")
    wait_model(daemon, "a", "stopped", timeout=30)
    wait_model(daemon, "b", "stopped", timeout=30)
    models = models_of(daemon)
    assert (models["a"]["down_cause"], models["b"]["down_cause"]) == ("idle", "idle"), models
    assert (models["a"]["slots_saved"], models["b"]["slots_saved"]) == (1, 0), models

    # b is asked a's continuation: b never saw it, so b reads it whole; nothing of a's is restored.
    _, timings = turn(base, "b", second)
    assert timings["cache_n"] == 0 and timings["prompt_n"] == len(second), timings
    assert daemon.call("status", model="b")["snapshots"]["restored"] == []
    # a gets its own conversation back: the continuation it gave while loaded, only the new tokens read.
    after, timings = turn(base, "a", second)
    assert after == reference
    assert timings["cache_n"] >= len(first) + len(gen) - 1, timings
    (restored,) = daemon.call("status", model="a")["snapshots"]["restored"]

    # Each model lists its own snapshots; an explicit restore into the other is refused.
    assert [s["id"] for s in daemon.call("snapshot.list", model="a")["snapshots"]] == [restored["id"]]
    # (b may have idled out while a reloaded on a busy machine, saving its own slot: never a's.)
    assert restored["id"] not in {s["id"] for s in daemon.call("snapshot.list", model="b")["snapshots"]}
    with pytest.raises(StokerError) as refused:
        daemon.call("snapshot.restore", id=restored["id"], model="b")
    assert refused.value.reason == "snapshot_instance_mismatch", refused.value
    assert refused.value.evidence["saved_by"] == "a" and refused.value.evidence["model"] == "b"

    # Both unload again, each saving its own slot; the daemon restarts; status still knows.
    gen_b, _ = turn(base, "b", second)
    wait_model(daemon, "a", "stopped", timeout=30)
    wait_model(daemon, "b", "stopped", timeout=30)
    daemon.stop()
    daemon.start()
    wait_model(daemon, "c", "ready")
    models = models_of(daemon)
    for name in ("a", "b"):
        assert models[name]["state"] == "stopped" and models[name]["down_cause"] == "idle", models[name]
        assert models[name]["slots_saved"] == 1, models[name]
    shown = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status"], env=daemon.env, capture_output=True, text=True, timeout=60
    ).stdout
    lines = [" ".join(line.split()) for line in shown.splitlines()]
    for name in ("a", "b"):
        assert any(line.startswith(f"{name} stopped") and "unloaded (idle), 1 slots saved" in line for line in lines), (
            shown
        )

    # After the restart b's own conversation comes back to b.
    _, timings = turn(base, "b", second + gen_b + more)
    assert timings["cache_n"] >= len(second) + len(gen_b) - 1, timings


def test_a_requests_keep_alive_wins_over_the_models_idle_ttl(daemon, model, other_model, no_server_left):
    """As Ollama's clients send it: `keep_alive: -1` keeps the model loaded past its TTL, `0` unloads
    it once answered, and a value that is no duration is a 400 that changes nothing."""
    base = start(daemon, f'[models.solo]\nmodel = "{model}"\ndefault = true\nidle_ttl_s = {TTL}\n', model)
    wait_model(daemon, "solo", "ready")
    ask = {"model": "solo", "prompt": "hi", "max_tokens": 2}
    kept = httpx.post(f"{base}/v1/completions", json={**ask, "keep_alive": -1}, trust_env=False, timeout=120)
    assert kept.status_code == 200, kept.text
    daemon.wait_for(lambda s: s["models"][0]["in_flight"] == 0, 30, "the answer to be over")
    assert models_of(daemon)["solo"]["idle_unload_in_s"] is None  # kept for good: no countdown
    time.sleep(2 * TTL)  # well past idle_ttl_s: still loaded
    assert models_of(daemon)["solo"]["state"] == "ready"

    bad = httpx.post(f"{base}/v1/completions", json={**ask, "keep_alive": "soon"}, trust_env=False, timeout=60)
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]["message"]

    done = httpx.post(f"{base}/v1/completions", json={**ask, "keep_alive": "0s"}, trust_env=False, timeout=120)
    assert done.status_code == 200, done.text
    solo = wait_model(daemon, "solo", "stopped", timeout=30)  # unloaded once answered, not TTL later
    assert solo["down_cause"] == "idle"
