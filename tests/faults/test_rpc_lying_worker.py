"""An RPC worker that lies: it answers the head's check (HELLO with this bundle's protocol
version, a device with free memory) and then fails inside the engine (it closes the connection
at the first real command). The engine aborts; the next plan leaves that worker out, with its
reason, and the model comes back up without it instead of crashing into crash_loop."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.daemon_harness import tiny_config, write_config
from tests.integration.rpc_workers import complete, workers_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from rpc_peer import RpcPeer  # noqa: E402

pytestmark = [pytest.mark.engine]


def test_a_worker_that_answers_the_check_but_fails_in_the_engine_is_left_out(daemon, model):
    peer = RpcPeer((7, 0, 0))  # this bundle's protocol: the check passes
    try:
        write_config(daemon.paths, workers_config(tiny_config(model), peer.address))
        daemon.start()
        status = daemon.wait_for(
            lambda s: s["state"] == "failed" or (s["state"] == "ready" and s["restarts"] + s["crashes"] > 0),
            120,
            "the model back up after the engine failed with the worker (or failed)",
        )
        assert status["state"] == "ready", (status["state"], status["reason"], status.get("workers"))
        assert complete(status)  # it serves, locally
    finally:
        peer.close()
    placement = status["workers"]
    assert placement["used"] == [] and placement["tensor_split"] == []
    (out,) = placement["left_out"]
    assert out["address"] == peer.address and out["reason"] == "rpc_worker_failed"
    assert out["evidence"]["was_in_plan"] is True and out["evidence"]["reachable"] is True
    history = daemon.history(machine="launch", limit=50)
    exits = [h for h in history if h["event"] == "ServerExited"]
    assert [h["reason"] for h in exits] == ["rpc_worker_lost"], exits  # one failure, then up without it
    plans = [h for h in history if h["event"] == "PlanReady"]
    assert len(plans) == 2 and plans[0]["event_data"]["plan"]["rpc"]["used"] == [], plans[0]  # newest first
    print(f"engine failed once with the lying worker; re-planned without it: {out['reason']}")
