"""Several models, placed and evicted: two tiny models of different weights behind one front
door, a real daemon and real llama-servers, driven with the openai SDK.

Each request goes to the model it names (proven by the answer: each model's greedy tokens, also
asked of that model's own engine directly); a model not loaded is loaded on demand while the
request is held; `stoker status --json` lists both; with max_loaded = 1 asking for the other
model unloads the idle one (its history says why); an unknown model gets 404 listing what is
served; `stoker down MODEL` stops one while the other serves; a model whose GPU plan fails at
start falls back to the CPU while the other model is untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.integration.daemon_harness import free_port
from tests.integration.test_frontdoor import sdk
from tests.integration.test_third_party_backend import (  # noqa: F401  (daemons: a fixture)
    daemons,
    relabel_cpu_bundle,
    stoker,
    with_plugin,
)
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")

PROMPT = "The"


@pytest.fixture
def other_model(tmp_path) -> Path:
    """A second tiny model: other weights (another seed), so another identity and other answers."""
    return write_tiny_model(tmp_path / "other" / "other.gguf", seed=7)


@pytest.fixture
def no_server_left(daemon, daemons, tmp_path):  # noqa: F811  (daemons: the imported fixture)
    """The `daemon` fixture checks the first model's servers; this checks every other model's of
    the test, once every daemon of the test has shut down."""
    yield
    for each in [daemon, *daemons]:
        each.stop()
    leftovers = [proc for path in tmp_path.rglob("*.gguf") for proc in servers_for(path)]
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


def two_models(
    daemon: DaemonProcess, alpha: Path, beta: Path, *, max_loaded: int, alpha_extra: str = "", **frontdoor: object
) -> str:
    """Start `daemon` serving alpha (the default) and beta; the front door's /v1 URL."""
    port = free_port()
    text = (
        tiny_config(alpha)
        + f"[placement]\nmax_loaded = {max_loaded}\n"
        + f'[models.alpha]\nmodel = "{alpha}"\ndefault = true\n{alpha_extra}'
        + f'[models.beta]\nmodel = "{beta}"\n'
        + "[frontdoor]\n"
        + "\n".join(f"{k} = {v}" for k, v in {"port": port, **frontdoor}.items())
        + "\n"
    )
    write_config(daemon.paths, text)
    daemon.start()
    return f"http://127.0.0.1:{port}/v1"


def models_of(daemon: DaemonProcess) -> dict[str, dict]:
    return {m["name"]: m for m in daemon.call("status")["models"]}


def wait_model(daemon: DaemonProcess, name: str, state: str, timeout: float = 60.0) -> dict:
    return daemon.wait_for(lambda s: any(m["name"] == name and m["state"] == state for m in s["models"]), timeout)


def greedy(client: "openai.OpenAI", model: str) -> tuple[str, str]:
    """(the answer's text, the answer's model field) for one greedy completion."""
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, seed=1)
    return reply.choices[0].text, reply.model


def direct(daemon: DaemonProcess, name: str) -> str:
    """The same greedy completion asked of `name`'s own engine, bypassing the front door."""
    st = daemon.call("status", model=name)
    assert st["name"] == name and st["state"] == "ready", st
    reply = httpx.post(
        f"{st['endpoint']}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "seed": 1},
        headers={"Authorization": f"Bearer {st['api_key']}"},
        trust_env=False,
        timeout=60,
    )
    return reply.json()["choices"][0]["text"]


def cli_status(daemon: DaemonProcess) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status", "--json"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_each_model_answers_by_name_and_one_is_loaded_on_demand(daemon, model, other_model, no_server_left):
    base = two_models(daemon, model, other_model, max_loaded=2)
    wait_model(daemon, "alpha", "ready")
    st = cli_status(daemon)
    assert st["name"] == "alpha" and st["state"] == "ready" and st["max_loaded"] == 2  # the default's, on top
    listed = {m["name"]: m for m in st["models"]}
    assert listed["alpha"]["state"] == "ready" and listed["alpha"]["default"] and listed["alpha"]["backend"] == "cpu"
    assert listed["beta"]["state"] == "stopped" and listed["beta"]["loads_on_demand"]  # not started with the daemon
    assert not servers_for(other_model)

    client = sdk(base)
    page = {m.id: m for m in client.models.list().data}
    assert set(page) == {"alpha", "beta"}
    assert page["alpha"].model_extra["stoker"]["state"] == "ready"
    assert page["beta"].model_extra["stoker"]["state"] == "stopped"

    # beta is not loaded: the request is held while it loads, then answered by beta.
    started = time.monotonic()
    beta_text, beta_id = greedy(client, "beta")
    held_s = time.monotonic() - started
    assert beta_id == "beta"
    assert len(servers_for(other_model)) == 1
    alpha_text, alpha_id = greedy(client, "alpha")
    assert alpha_id == "alpha"
    # Routed by name: each answer is that model's own (asked of its engine directly), and they differ.
    assert beta_text == direct(daemon, "beta") and alpha_text == direct(daemon, "alpha")
    assert alpha_text != beta_text
    # The other names a model answers to: "default", its file's name and stem.
    assert greedy(client, "default")[0] == alpha_text
    assert greedy(client, other_model.name)[0] == beta_text and greedy(client, "other")[0] == beta_text
    assert {m["name"]: m["state"] for m in cli_status(daemon)["models"]} == {"alpha": "ready", "beta": "ready"}
    metrics = httpx.get(base.removesuffix("/v1") + "/metrics", trust_env=False).text
    # beta's request, and only it, was held
    assert 'stoker_requests_held_total{model="beta"} 1.0' in metrics
    assert 'stoker_requests_held_total{model="alpha"} 0.0' in metrics
    print(f"beta loaded on demand: answered after {held_s:.2f} s")

    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
    assert missing.value.code == "model_not_found"
    assert "alpha" in missing.value.message and "beta" in missing.value.message


def test_max_loaded_one_unloads_the_idle_model_and_says_why(daemon, model, other_model, no_server_left):
    base = two_models(daemon, model, other_model, max_loaded=1)
    wait_model(daemon, "alpha", "ready")
    client = sdk(base)
    alpha_text = greedy(client, "alpha")[0]

    started = time.monotonic()
    beta_text = greedy(client, "beta")[0]  # alpha is idle: unloaded first, then beta loads
    print(f"swap alpha -> beta answered after {time.monotonic() - started:.2f} s")
    models = models_of(daemon)
    assert models["beta"]["state"] == "ready"
    assert models["alpha"]["state"] == "stopped" and models["alpha"]["down_cause"] == "evicted"
    assert models["alpha"]["loads_on_demand"] and not servers_for(model)
    evicted = [r for r in daemon.history(machine="launch:alpha", limit=50) if r["reason"] == "placement_evicted"]
    assert len(evicted) == 1, daemon.history(machine="launch:alpha", limit=50)
    assert evicted[0]["event_data"]["cause"] == "evicted" and evicted[0]["evidence"]["for"] == "beta"
    assert evicted[0]["evidence"]["max_loaded"] == 1

    # And back: alpha is loaded again for its request, beta unloaded; the answers are unchanged.
    assert greedy(client, "alpha")[0] == alpha_text
    models = models_of(daemon)
    assert (models["alpha"]["state"], models["beta"]["state"]) == ("ready", "stopped")
    assert models["beta"]["down_cause"] == "evicted"
    assert greedy(client, "beta")[0] == beta_text


def test_down_one_model_while_the_other_serves(daemon, model, other_model, no_server_left):
    base = two_models(daemon, model, other_model, max_loaded=2)
    wait_model(daemon, "alpha", "ready")
    client = sdk(base)
    greedy(client, "beta")
    done = stoker(daemon.env, "down", "beta", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    st = json.loads(done.stdout)
    assert st["name"] == "beta" and st["state"] == "stopped"
    assert not servers_for(other_model) and len(servers_for(model)) == 1
    # beta stays down until `stoker up beta`: its requests are refused, not loaded again.
    with pytest.raises(openai.APIStatusError) as down:
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)
    assert down.value.status_code == 503 and down.value.code == "frontdoor_server_down"
    assert "`stoker up beta` starts it" in down.value.message  # the command that fixes it, not the default's
    assert greedy(client, "alpha")[1] == "alpha"  # the other serves on
    models = models_of(daemon)
    assert models["beta"]["down_cause"] == "user" and not models["beta"]["loads_on_demand"]
    done = stoker(daemon.env, "up", "beta", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["state"] == "ready", done.stdout + done.stderr
    assert greedy(client, "beta")[1] == "beta"


def test_a_model_whose_gpu_plan_fails_falls_back_while_the_other_is_untouched(
    stoker_home,
    installed_cpu_bundle,
    model,
    other_model,
    plugin_site,
    daemons,  # noqa: F811  (the imported fixture)
    tmp_path,
    no_server_left,
):
    lost = tmp_path / "fakegpu-device-lost"
    lost.touch()  # FakeGPU's engine dies while loading: a plan on it fails at start
    d = DaemonProcess(stoker_home, env=with_plugin(plugin_site, "FakeGPU 9000:8192"))
    relabel_cpu_bundle(installed_cpu_bundle.root, tmp_path / "fakegpu-bundle", lost)
    done = stoker(d.env, "bundle", "install", str(tmp_path / "fakegpu-bundle"), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    daemons.append(d)
    # alpha is forced onto the CPU; beta prefers whatever is best (FakeGPU first).
    base = two_models(d, model, other_model, max_loaded=2, alpha_extra='prefer = "cpu"\n')
    wait_model(d, "alpha", "ready")
    alpha_pid = models_of(d)["alpha"]["pid"]
    client = sdk(base)
    assert greedy(client, "beta")[1] == "beta"  # held through FakeGPU's failed start and the fallback
    beta = d.call("status", model="beta")
    assert beta["backend"] == "cpu" and beta["planned_backend"] == "cpu"
    assert {f["backend"]: f["reason"] for f in beta["fallbacks"]}.get("fakegpu") == "fakegpu_startup_failed"
    failed = [r for r in d.history(machine="fallback:beta", limit=200) if r["reason"] == "fakegpu_startup_failed"]
    assert failed, d.history(machine="fallback:beta", limit=200)
    # alpha never tried FakeGPU, never stopped, and its history has no fallback of beta's.
    alpha = d.call("status", model="alpha")
    assert alpha["pid"] == alpha_pid and alpha["backend"] == "cpu" and alpha["fallbacks"] == []
    assert not [r for r in d.history(machine="fallback:alpha", limit=200) if r["reason"] == "fakegpu_startup_failed"]
    assert os.path.exists(lost)


def test_a_request_waits_while_the_loaded_model_answers_then_it_is_unloaded(
    daemon, tmp_path, other_model, no_server_left
):
    # alpha answers a long stream (a model with room for one: seconds on 2 cores): it is busy, so
    # beta's request is held until that answer is over.
    long_model = write_tiny_model(tmp_path / "long" / "long.gguf", n_layer=4, n_embd=512, n_head=8, n_ctx=4096)
    base = two_models(
        daemon, long_model, other_model, max_loaded=1, alpha_extra="ctx_size = 4096\n", hold_timeout_s=900
    )  # the hold outlasts the long answer however slow a busy machine makes it
    wait_model(daemon, "alpha", "ready")
    client = sdk(base)
    outcome: dict[str, object] = {}

    def ask_beta() -> None:
        started = time.monotonic()
        outcome["text"] = greedy(client, "beta")[0]
        outcome["after_s"] = time.monotonic() - started

    stream = client.chat.completions.create(
        model="alpha",
        messages=[{"role": "user", "content": "hi"}],
        # Longer than any machine takes to show beta held (300 tokens were over in 0.6 s on a quiet
        # 2-core machine, before the check); the client ends it once that is seen.
        max_tokens=4000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    asker = threading.Thread(target=ask_beta)
    asker.start()
    asked_at = time.monotonic()
    models = wait_until(
        lambda: (found := models_of(daemon))["beta"]["waiting"] == 1 and found, timeout=30, what="beta's request held"
    )
    assert models["alpha"]["state"] == "ready" and models["alpha"]["in_flight"] == 1
    assert models["beta"]["state"] == "stopped" and "text" not in outcome  # held: no room while alpha is busy
    # alpha goes on answering while beta waits (it is not stopped under its answer), then the
    # client ends the answer: alpha is idle, unloaded, and beta loads for the held request.
    more = [next(chunks) for _ in range(100)]
    assert all(chunk.choices for chunk in more) and "text" not in outcome
    assert models_of(daemon)["beta"]["waiting"] == 1
    stream.close()
    print(f"alpha's stream ran {time.monotonic() - asked_at:.1f} s more after beta was asked for")
    asker.join(120)
    assert outcome["after_s"] >= 0.5 and outcome["text"]  # type: ignore[operator]
    models = models_of(daemon)
    assert (models["alpha"]["state"], models["alpha"]["down_cause"], models["beta"]["state"]) == (
        "stopped",
        "evicted",
        "ready",
    )


def test_a_pinned_model_is_never_unloaded_and_the_request_gets_placement_no_room(
    daemon, model, other_model, no_server_left
):
    base = two_models(daemon, model, other_model, max_loaded=1, alpha_extra="pinned = true\n", hold_timeout_s=2)
    wait_model(daemon, "alpha", "ready")
    client = sdk(base)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)
    assert time.monotonic() - started >= 2.0  # held for hold_timeout_s first
    assert refused.value.status_code == 503 and refused.value.code == "placement_no_room"
    assert refused.value.response.headers["retry-after"] == "5"
    assert models_of(daemon)["alpha"]["state"] == "ready" and not servers_for(other_model)
    assert greedy(client, "alpha")[1] == "alpha"
    done = stoker(daemon.env, "up", "beta", "--json")  # `up` does not wait: it says why at once
    assert done.returncode != 0 and "placement_no_room" in done.stdout + done.stderr, done.stdout + done.stderr


def test_models_added_and_removed_while_the_daemon_runs(daemon, model, other_model, no_server_left):
    port = free_port()
    frontdoor = f"[frontdoor]\nport = {port}\n"
    write_config(daemon.paths, tiny_config(model) + frontdoor)  # no [models]: one model, "default"
    daemon.start()
    daemon.wait_state("ready")
    client = sdk(f"http://127.0.0.1:{port}/v1")
    assert [m["name"] for m in daemon.call("status")["models"]] == ["default"]
    # Two sections appear: "default" is no longer configured (its server stops), alpha and beta are.
    sections = f'[models.alpha]\nmodel = "{model}"\n[models.beta]\nmodel = "{other_model}"\n'
    write_config(daemon.paths, tiny_config(model) + sections + frontdoor)
    st = daemon.wait_for(lambda s: [m["name"] for m in s["models"]] == ["alpha", "beta"], 60, "alpha and beta")
    st = wait_model(daemon, "alpha", "ready")  # the new default starts with the daemon's config
    assert st["name"] == "alpha"
    assert greedy(client, "beta")[1] == "beta"
    history = daemon.history(machine="launch", limit=50)
    assert any(r["event"] == "DownRequested" and r["event_data"]["cause"] == "removed" for r in history), history
    # beta's section goes: its server is stopped (drained like any planned stop) and it is no longer served.
    write_config(daemon.paths, tiny_config(model) + f'[models.alpha]\nmodel = "{model}"\n' + frontdoor)
    daemon.wait_for(lambda s: [m["name"] for m in s["models"]] == ["alpha"], 60, "alpha alone")
    wait_until(lambda: not servers_for(other_model), timeout=30, what="beta's server to be stopped")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=2)
    assert greedy(client, "alpha")[1] == "alpha"


def test_a_killed_daemon_adopts_every_models_server_and_stops_one_no_longer_configured(
    daemon, model, other_model, no_server_left
):
    base = two_models(daemon, model, other_model, max_loaded=2)
    wait_model(daemon, "alpha", "ready")
    client = sdk(base)
    greedy(client, "beta")
    pids = {name: m["pid"] for name, m in models_of(daemon).items()}
    daemon.kill9()
    daemon.start()  # the same config: both servers are proven and kept, beta's too (not autostarted)
    wait_model(daemon, "beta", "ready")
    wait_model(daemon, "alpha", "ready")
    assert {name: m["pid"] for name, m in models_of(daemon).items()} == pids
    assert greedy(client, "beta")[1] == "beta"
    daemon.kill9()
    # beta's section is gone when the daemon comes back: its server, still running, is stopped.
    text = daemon.paths.config_file.read_text()
    write_config(daemon.paths, text.replace(f'[models.beta]\nmodel = "{other_model}"\n', ""))
    daemon.start()
    wait_model(daemon, "alpha", "ready")
    assert [m["name"] for m in daemon.call("status")["models"]] == ["alpha"]
    wait_until(lambda: not servers_for(other_model), timeout=30, what="beta's server to be stopped")
    assert models_of(daemon)["alpha"]["pid"] == pids["alpha"]
    # The process is gone a moment before the machine records it.
    wait_until(
        lambda: daemon.history(machine="launch:beta", limit=1)[0]["to_state"] == "stopped",
        timeout=30,
        what="launch:beta's stopped transition",
    )
