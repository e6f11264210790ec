"""The save before a stop runs out of its budget: the stop still completes, and the lost save is
said (a 130k-token save once needed 28 s of a fixed 20 s budget, and was lost silently).

Two ways a stop's save cannot finish, both with the real engine:
- the slot is busy generating: the engine defers the save until the generation ends;
- the engine is frozen (SIGSTOP): it does not even list its slots.
The budget is `[snapshots] stop_budget_s`, set small here; "auto" scales it with the KV to save.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.integration.daemon_harness import servers_for, tiny_config, write_config
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]

BUDGET_S = 1.0
GRACE_S = 3.0  # tiny_config's stop_grace_s


def _engine(status: dict) -> tuple[str, dict[str, str]]:
    return status["endpoint"], {"Authorization": f"Bearer {status['api_key']}"}


def _timeouts(daemon) -> list[dict]:
    snaps = daemon.call("status")["snapshots"] or {}
    return [d for d in snaps.get("dropped", []) if d["reason"] == "snapshot_save_timeout"]


def test_a_busy_slot_outlasts_the_stop_budget_and_the_lost_save_is_reported(daemon, tmp_path):
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "long.gguf", n_ctx=16384)  # room for a long generation
    write_config(daemon.paths, tiny_config(model, snapshots={"stop_budget_s": BUDGET_S}, ctx_size=16384))
    daemon.start()
    st = daemon.wait_state("ready")
    url, headers = _engine(st)
    # A long generation in slot 0: the engine defers a save of a busy slot until it is done.
    body = {"prompt": "once upon a time", "n_predict": 15000, "ignore_eos": True, "id_slot": 0, "cache_prompt": True}

    def generate() -> None:
        try:
            httpx.post(url + "/completion", json=body, headers=headers, timeout=120)
        except httpx.HTTPError:
            pass  # the stop ends the generation, and its connection with it

    generating = threading.Thread(target=generate, daemon=True)
    generating.start()

    def busy() -> bool:
        slot = httpx.get(url + "/slots", headers=headers, timeout=10).json()[0]
        return slot["is_processing"] and (slot.get("n_prompt_tokens") or 0) > 0

    wait_until(busy, timeout=30, what="slot 0 busy with the prompt")
    started = time.monotonic()
    daemon.call("down")
    daemon.wait_state("stopped", timeout=60)
    took = time.monotonic() - started
    assert took < BUDGET_S + GRACE_S + 10, took  # the budget bounded the wait
    (timeout,) = _timeouts(daemon)
    assert (timeout["phase"], timeout["cause"], timeout["slots"]) == ("saving", "stop", [0])
    assert timeout["budget_s"] == BUDGET_S and timeout["elapsed_s"] >= BUDGET_S * 0.9
    assert timeout["n_tokens"] > 0 and timeout["expected_bytes"] > 0 and timeout["stop_budget_setting"] == BUDGET_S
    assert daemon.call("snapshot.list")["snapshots"] == []  # nothing half-saved was catalogued
    assert not [p for p in daemon.paths.snapshots_dir.iterdir() if p.name.startswith("partial-")]
    assert "snapshot_save_timeout" in daemon.output.read_text()
    generating.join(5)
    assert not servers_for(model)


def test_a_frozen_engine_at_stop_costs_the_budget_not_more_and_is_reported(daemon, model):
    write_config(daemon.paths, tiny_config(model, snapshots={"stop_budget_s": BUDGET_S}))
    daemon.start()
    st = daemon.wait_state("ready")
    url, headers = _engine(st)
    httpx.post(
        url + "/completion",
        json={"prompt": "hello world", "n_predict": 4, "id_slot": 0, "cache_prompt": True},
        headers=headers,
        timeout=60,
    )
    os.kill(st["pid"], signal.SIGSTOP)
    try:
        started = time.monotonic()
        daemon.call("down")
        daemon.wait_state("stopped", timeout=60)
        took = time.monotonic() - started
    finally:
        try:
            os.kill(st["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert took < BUDGET_S + GRACE_S + 10, took
    (timeout,) = _timeouts(daemon)
    assert (timeout["phase"], timeout["budget_s"]) == ("listing", BUDGET_S)
    assert timeout["elapsed_s"] >= BUDGET_S * 0.9
    assert daemon.call("snapshot.list")["snapshots"] == []
