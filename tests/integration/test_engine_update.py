"""`stoker engine update` and `rollback` with the real engine: the gate, the switch and the way back.

The releases are the real CPU bundle from the build cache, repacked (tests/integration/
engine_repack.py): a good one (the same engine as a new version), one whose engine dies when
launched to serve but passes the staged verification and smoke gate, and one whose engine
generates other tokens (a logit bias behind a wrapper) with a smoke reference of its own. A real
daemon serves the tiny model with snapshots on; the conversation it holds must survive.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from stoker.daemon.bundles.installed import bundle_meta_of
from stoker.daemon.core.errors import StokerError
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.integration.engine_repack import CRASH_WHEN_SERVING, biased_generation, repack, smoke_tokens
from tests.waits import wait_until

pytestmark = pytest.mark.engine

UPDATE_TIMEOUT = 300.0


@pytest.fixture
def serving(daemon: DaemonProcess, model: Path) -> dict:
    """The daemon serving the tiny model on the installed CPU bundle, snapshots on."""
    write_config(daemon.paths, tiny_config(model, snapshots=True))
    daemon.start()
    return daemon.wait_state("ready")


def engine_call(daemon: DaemonProcess, method: str, **params) -> dict:
    with daemon.client(timeout=UPDATE_TIMEOUT) as client:
        return client.call(method, **params)


def post(st: dict, path: str, body: dict) -> dict:
    reply = httpx.post(
        f"{st['endpoint']}{path}",
        json=body,
        headers={"Authorization": f"Bearer {st['api_key']}"},
        trust_env=False,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def turn(st: dict, prompt: list[int], n: int = 8) -> tuple[list[int], dict]:
    """One greedy turn in slot 0, kept in the slot's cache: the generated ids and the timings."""
    body = post(
        st,
        "/completion",
        {
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0,
            "top_k": 1,
            "id_slot": 0,
            "cache_prompt": True,
            "return_tokens": True,
        },
    )
    return body["tokens"], body["timings"]


def conversation(st: dict) -> tuple[list[int], list[int]]:
    """A two-turn conversation left in slot 0: its prompt so far, and the answer it gives now."""
    first = post(st, "/tokenize", {"content": "Once upon a time"})["tokens"]
    gen, _ = turn(st, first)
    second = first + gen + post(st, "/tokenize", {"content": " and then"})["tokens"]
    reference, _ = turn(st, second)
    return second, reference


def update_steps(daemon: DaemonProcess, slot: str, limit: int = 50) -> list[dict]:
    return list(reversed(daemon.history(machine=f"engine_update:{slot}", limit=limit)))


def test_an_engine_that_dies_when_serving_is_rolled_back_and_the_conversation_kept(
    serving, daemon, model, cpu_bundle, tmp_path
):
    slot = f"cpu-{serving['variant']}"
    old_version = serving["engine"]["version"]
    assert serving["engine"] == {
        "slot": slot,
        "version": old_version,
        "previous": None,
        "update_state": None,
        "update_reason": None,
        "last_check": None,
    }
    prompt, reference = conversation(serving)
    broken = repack(cpu_bundle, tmp_path / "broken.zip", version=f"{old_version}.1", wrapper=CRASH_WHEN_SERVING)

    started = time.monotonic()
    with pytest.raises(StokerError) as refused:
        engine_call(daemon, "engine.update", bundle=str(broken))
    took = time.monotonic() - started
    err = refused.value
    assert err.reason == "engine_update_rolled_back", err.to_dict()
    assert err.evidence["gate"] == "start" and err.evidence["server"] == "default"
    assert err.evidence["restoring"] == old_version and err.evidence["discarded"] == f"{old_version}.1"

    st = daemon.wait_state("ready", timeout=120)
    assert st["pid"] != serving["pid"]
    assert st["engine"]["version"] == old_version and st["engine"]["previous"] is None
    assert st["engine"]["update_state"] == "rolled_back"
    assert st["engine"]["update_reason"] == "engine_update_rolled_back"
    assert not (daemon.paths.bundles_dir / f".update-{slot}").exists()
    assert not (daemon.paths.bundles_dir / f".rollback-{slot}").exists()

    # The conversation the old engine held before the update is back in its slot, whole.
    again, timings = turn(st, prompt)
    assert again == reference
    assert timings["cache_n"] >= len(prompt) - 1, timings
    assert st["snapshots"]["restored"], st["snapshots"]

    steps = update_steps(daemon, slot)
    assert [s["to_state"] for s in steps] == [
        "resolving",
        "staging",
        "comparing",
        "switching",
        "restarting",
        "rolling_back",
        "rolled_back",
    ]
    assert steps[-1]["reason"] == "engine_update_rolled_back" and steps[-1]["evidence"]["gate"] == "start"
    launch = daemon.history(machine="launch", limit=60)
    assert any(r["to_state"] == "crashed" for r in launch), [r["to_state"] for r in launch]
    (record,) = [i for i in st["installs"] if i["machine"] == f"install:{slot}"]
    assert (record["version"], record["by"], record["previous"]) == (old_version, "engine_rollback", None), record

    # A manifest that still lists the rolled-back release: `stoker install cpu` keeps the slot.
    entry = {
        "url": broken.as_uri(),
        "sha256": hashlib.sha256(broken.read_bytes()).hexdigest(),
        "size": broken.stat().st_size,
        "backend": "cpu",
        "variant": serving["variant"],
        "version": f"{old_version}.1",
        "platform": bundle_meta_of(broken).platform,
    }
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))
    write_config(daemon.paths, tiny_config(model, snapshots=True) + f'[bundles]\nmanifest = "{manifest}"\n')
    wait_until(
        lambda: "config reloaded: bundles.manifest" in daemon.log_text(),
        timeout=30,
        what="the log line of the manifest change applied",
        detail=lambda: daemon.log_text()[-2000:],
    )
    installed = engine_call(daemon, "install", backend="cpu")["installed"]
    assert installed["version"] == old_version
    (last,) = daemon.history(machine=f"install:{slot}", limit=1)
    assert last["to_state"] == "installed" and last["evidence"]["outcome"] == "kept", last
    assert last["evidence"]["rejected"]["reason"] == "engine_update_rolled_back"
    assert daemon.call("status")["pid"] == st["pid"]  # nothing was restarted

    # `stoker engine update` from that channel does not switch to the rolled-back release again
    # (it would restart the server to crash the same way): it says it was rolled back, and why.
    held = engine_call(daemon, "engine.update")
    assert held["state"] == "current" and held["reason"] == "engine_update_rolled_back", held
    assert f"{old_version}.1 was rolled back here before (start gate: server default exited" in held["message"]
    said = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "engine", "update"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=UPDATE_TIMEOUT,
    )
    assert said.returncode == 0 and "not updated (engine_update_rolled_back)" in said.stdout, said
    # Rolled back as a named zip, it is known by its digest: staged once to learn it, held back
    # before the comparison, then known by its zip and not staged at all.
    to = [s["to_state"] for s in update_steps(daemon, slot)[-5:]]
    assert to == ["resolving", "staging", "current", "resolving", "current"], to
    assert daemon.call("status")["pid"] == st["pid"]  # still nothing restarted
    print(
        f"rolled back in {took:.1f} s: " + ", ".join(f"{s['to_state']} +{s['at'] - steps[0]['at']:.1f}s" for s in steps)
    )


def test_an_engine_whose_tokens_differ_is_refused_before_the_switch(serving, daemon, cpu_bundle, tmp_path):
    slot = f"cpu-{serving['variant']}"
    old_version = serving["engine"]["version"]
    suppressed = smoke_tokens(cpu_bundle)[2]
    other = repack(
        cpu_bundle, tmp_path / "other.zip", version=f"{old_version}.2", wrapper=biased_generation(suppressed)
    )
    assert smoke_tokens(other)[:2] == smoke_tokens(cpu_bundle)[:2] and smoke_tokens(other) != smoke_tokens(cpu_bundle)

    with pytest.raises(StokerError) as refused:
        engine_call(daemon, "engine.update", bundle=str(other))
    err = refused.value
    assert err.reason == "engine_update_rejected", err.to_dict()
    assert err.evidence["gate"] == "tokens" and err.evidence["first_difference"] == 2
    assert err.evidence["old_tokens"] == smoke_tokens(cpu_bundle)
    assert err.evidence["new_tokens"] == smoke_tokens(other)

    st = daemon.call("status")
    assert st["state"] == "ready" and st["pid"] == serving["pid"]  # never stopped
    assert st["engine"]["version"] == old_version and st["engine"]["previous"] is None
    assert not (daemon.paths.bundles_dir / f".update-{slot}").exists()
    assert [s["to_state"] for s in update_steps(daemon, slot)] == ["resolving", "staging", "comparing", "rejected"]


def test_a_good_update_sticks_and_rollback_by_hand_goes_back(serving, daemon, model, cpu_bundle, tmp_path):
    slot = f"cpu-{serving['variant']}"
    old_version = serving["engine"]["version"]
    new_version = f"{old_version}.3"
    good = repack(cpu_bundle, tmp_path / "good.zip", version=new_version)
    prompt, reference = conversation(serving)

    started = time.monotonic()
    result = engine_call(daemon, "engine.update", bundle=str(good))
    print(f"updated in {time.monotonic() - started:.1f} s")
    assert result["state"] == "updated" and result["candidate"] == new_version
    assert [v["outcome"] for v in result["verdicts"]] == ["ready"]
    assert result["engine"]["version"] == new_version and result["engine"]["previous"] == old_version
    st = daemon.wait_state("ready")
    assert st["pid"] != serving["pid"] and st["engine"]["version"] == new_version
    again, _ = turn(st, prompt)
    assert again == reference

    shown = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status"], env=daemon.env, capture_output=True, text=True, timeout=60
    )
    assert f"version   {new_version} ({slot}; previous {old_version} kept)" in shown.stdout, shown.stdout

    # The same bundle again: nothing to do.
    assert engine_call(daemon, "engine.update", bundle=str(good))["state"] == "current"

    done = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "engine", "rollback"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=UPDATE_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert "rolled back" in done.stdout
    st = daemon.wait_for(
        lambda s: s["state"] == "ready" and s["engine"]["version"] == old_version, what="the old engine serving"
    )
    assert st["engine"]["previous"] == new_version  # kept: a second rollback undoes the first
    last = update_steps(daemon, slot)[-1]
    assert last["to_state"] == "rolled_back" and last["reason"] is None and last["evidence"]["by_hand"]
    (record,) = [i for i in st["installs"] if i["machine"] == f"install:{slot}"]
    assert (record["version"], record["by"], record["previous"]) == (old_version, "engine_rollback", new_version)
    assert servers_for(model)


def test_rollback_with_nothing_kept_says_so(serving, daemon):
    with pytest.raises(StokerError) as refused:
        engine_call(daemon, "engine.rollback")
    assert refused.value.reason == "engine_rollback_unavailable"
    assert daemon.call("status")["pid"] == serving["pid"]


def test_the_automatic_check_updates_from_the_manifest_by_itself(daemon, model, cpu_bundle, tmp_path):
    meta = bundle_meta_of(cpu_bundle)
    new_version = f"{meta.version}.4"
    good = repack(cpu_bundle, tmp_path / "good.zip", version=new_version)
    entry = {
        "url": good.as_uri(),
        "sha256": hashlib.sha256(good.read_bytes()).hexdigest(),
        "size": good.stat().st_size,
        "backend": "cpu",
        "variant": meta.variant,
        "version": new_version,
        "platform": meta.platform,
    }
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))
    engine = f'[bundles]\nmanifest = "{manifest}"\n[engine]\nauto_update = true\ncheck_interval_s = 1\n'
    write_config(daemon.paths, tiny_config(model) + engine)
    daemon.start()
    st = daemon.wait_for(
        lambda s: (
            s["state"] == "ready"
            and (s.get("engine") or {}).get("version") == new_version
            and s["engine"]["update_state"] == "updated"
        ),  # the slot switches before the gates end
        timeout=180,
        what="the automatic update",
    )
    assert st["engine"]["previous"] == meta.version
    slot = f"cpu-{meta.variant}"
    steps = update_steps(daemon, slot, limit=5000)  # the check goes on every second: "current" since
    asked = [s for s in steps if s["event"] == "UpdateRequested"]
    assert asked and all(s["event_data"]["automatic"] is True for s in asked)
    assert [s["to_state"] for s in steps].count("updated") == 1
    # The check goes on every second and finds nothing newer: no history row (two per check before),
    # and status says when it last ran and what it found.
    since = time.time()
    st = daemon.wait_for(
        lambda s: ((s.get("engine") or {}).get("last_check") or {}).get("at", 0) > since + 2,
        timeout=30,
        what="two more checks",
    )
    last = st["engine"]["last_check"]
    assert last["result"] == "current" and last["installed"] == last["offered"] == new_version, last
    after = update_steps(daemon, slot, limit=5000)
    assert after == steps and after[-1]["to_state"] == "updated", [s["to_state"] for s in after[len(steps) :]]
    installs = {i["machine"]: i for i in st["installs"]}
    record = installs.get(f"install:{slot}")
    assert record is not None and record["version"] == new_version and record["by"] == "engine_update", record
    assert record["previous"] == meta.version


def test_the_automatic_check_rolls_a_broken_release_back_once_and_never_again(daemon, model, cpu_bundle, tmp_path):
    """The channel lists a release whose engine dies when serving, auto_update checks every
    second: one update, one rollback, and from then on every check says it was rolled back
    (no history row, no restart: the same server pid across further checks)."""
    meta = bundle_meta_of(cpu_bundle)
    broken = repack(cpu_bundle, tmp_path / "broken.zip", version=f"{meta.version}.5", wrapper=CRASH_WHEN_SERVING)
    entry = {
        "url": broken.as_uri(),
        "sha256": hashlib.sha256(broken.read_bytes()).hexdigest(),
        "size": broken.stat().st_size,
        "backend": "cpu",
        "variant": meta.variant,
        "version": f"{meta.version}.5",
        "platform": meta.platform,
    }
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))
    engine = f'[bundles]\nmanifest = "{manifest}"\n[engine]\nauto_update = true\ncheck_interval_s = 1\n'
    write_config(daemon.paths, tiny_config(model) + engine)
    daemon.start()
    slot = f"cpu-{meta.variant}"
    st = daemon.wait_for(
        lambda s: s["state"] == "ready" and (s.get("engine") or {}).get("update_state") == "rolled_back",
        timeout=300,
        what="the automatic update rolled back",
    )
    pid = st["pid"]
    since = time.time()
    st = daemon.wait_for(
        lambda s: ((s.get("engine") or {}).get("last_check") or {}).get("at", 0) > since + 3,
        timeout=60,
        what="three more checks",
    )
    last = st["engine"]["last_check"]
    assert last["result"] == "current" and "rolled back here before" in last["message"], last
    assert st["pid"] == pid and st["state"] == "ready" and st["engine"]["version"] == meta.version
    steps = [s["to_state"] for s in update_steps(daemon, slot, limit=5000)]
    assert steps.count("rolled_back") == 1 and steps.count("staging") == 1, steps
