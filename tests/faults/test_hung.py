"""Hung engines: a SIGSTOPped llama-server is caught, and a long generation is not a hang.

The liveness watchdog judges progress, never wall time: a server that answers `/health`,
moves a slot or burns CPU is alive, however long its request runs. These run the real daemon
on the real engine with `[supervisor] hung_after_s` shortened so that a hang shows in seconds.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config

pytestmark = [pytest.mark.engine]


def config_with(model, *, hung_after: float, stable_after: float = 30, snapshots: bool = False, **server) -> str:
    text = tiny_config(model, snapshots=snapshots, **server)
    text = text.replace("stable_after_s = 30", f"stable_after_s = {stable_after}")
    return text.replace("[supervisor]\n", f"[supervisor]\nhung_after_s = {hung_after}\n")


def launch_rows(d: DaemonProcess) -> list[dict]:
    return list(reversed(d.history(machine="launch", limit=500)))


def test_a_stopped_engine_is_caught_restarted_and_counted(daemon, model):
    """SIGSTOP: no /health, no slot, no CPU. Stopped as server_hung within hung_after plus a
    sample, a snapshot attempted, counted as a crash (Stable, due meanwhile, forgives nothing
    while the engine is silent), and a new server serves."""
    write_config(daemon.paths, config_with(model, hung_after=8, stable_after=5.5, snapshots=True))
    daemon.start()
    first = daemon.wait_state("ready")
    os.kill(first["pid"], signal.SIGKILL)  # one crash first, which a silent Stable must not forgive
    second = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != first["pid"], 60, "a second server")
    os.kill(second["pid"], signal.SIGSTOP)
    try:
        third = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != second["pid"], 60, "a third server")
    finally:
        try:
            os.kill(second["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    rows = launch_rows(daemon)
    hung = next(r for r in rows if r["event"] == "EngineSilent" and r["to_state"] == "stopping")
    assert hung["reason"] == "server_hung"
    assert hung["evidence"]["silent_for"] >= 8 and hung["evidence"]["process"] == "stopped"
    crash = next(r for r in rows if r["to_state"] == "crashed" and r["reason"] == "server_hung")
    assert crash["evidence"]["crashes"] == 2 and crash["evidence"]["phase"] == "after_ready"
    unforgiven = [r for r in rows if r["event"] == "Stable" and r["evidence"].get("engine_silent")]
    assert unforgiven, "Stable came while the engine was silent and must not have forgiven the first crash"
    assert third["restarts"] == 2 and [p.pid for p in servers_for(model)] == [third["pid"]]
    assert "before hung" in daemon.log_text()  # the snapshot attempt (it cannot answer: given up)


def test_a_long_generation_is_not_a_hang(daemon, tmp_path):
    """One request that runs for many times hung_after on one thread, with a watchdog that
    samples every 0.25 s and gives /health 0.25 s: never stopped, the answer arrives whole."""
    model = write_tiny_model(tmp_path / "long.gguf", n_layer=4, n_embd=512, n_head=8, n_ctx=4096)
    write_config(daemon.paths, config_with(model, hung_after=1, ctx_size=4096, threads=1))
    daemon.start()
    st = daemon.wait_state("ready")
    body = {"prompt": "hello", "n_predict": 1500, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {st['api_key']}"}
    done: dict = {}

    def generate() -> None:
        done["reply"] = httpx.post(f"{st['endpoint']}/completion", json=body, headers=headers, timeout=300)

    worker = threading.Thread(target=generate)
    worker.start()
    worker.join(300)
    reply = done["reply"]
    assert reply.status_code == 200 and reply.json()["tokens_predicted"] == 1500
    took = reply.json()["timings"]["predicted_ms"] / 1000
    assert took > 3, f"the generation took {took:.1f} s: too short to prove anything against hung_after_s = 1"
    after = daemon.call("status")
    assert (after["state"], after["pid"], after["crashes"]) == ("ready", st["pid"], 0)
    assert not [r for r in launch_rows(daemon) if r["reason"] == "server_hung"]
    daemon.call("down")
    assert servers_for(model) == []
