"""A model split over two real RPC workers (`stoker worker` supervising ggml-rpc-server on
loopback): the tokens of a local run, the placement proven from the engine's own lines, and a
worker of another protocol version left out before anything is loaded."""

from __future__ import annotations


from rpc_peer import RpcPeer
from tests.integration.daemon_harness import tiny_config, write_config
from tests.integration.rpc_workers import complete, workers_config


def _split_ready(status: dict) -> bool:
    placement = status.get("workers") or {}
    return status["state"] == "ready" and placement.get("confirmed") is True


def test_a_model_split_over_two_workers_generates_the_tokens_of_a_local_run(daemon, model, two_workers):
    daemon.start()
    local = complete(daemon.wait_state("ready"))

    write_config(daemon.paths, workers_config(tiny_config(model), *(w.address for w in two_workers)))
    status = daemon.wait_for(_split_ready, 90, "the split placement confirmed")
    placement = status["workers"]
    assert [u["address"] for u in placement["used"]] == [w.address for w in two_workers]
    assert placement["left_out"] == [] and placement["protocol"] == "7.0.0"
    # Each worker holds part of the model, by the engine's own `RPCn[host:port] model buffer size` lines.
    assert all(placement["workers_model_mib"][w.address] > 0 for w in two_workers), placement
    assert len(placement["tensor_split"]) == 2
    # The layers' sentence names where they are, not "a CPU plan offloads nothing".
    assert (
        "layers on 2 RPC workers" in status["layers"]["why"] and "nothing is offloaded" not in status["layers"]["why"]
    )

    assert complete(status) == local

    plans = [h for h in daemon.history(machine="launch") if h["event"] == "PlanReady"]
    recorded = plans[0]["event_data"]["plan"]  # newest first
    assert recorded["rpc"]["used"][0]["address"] == two_workers[0].address
    args = recorded["backend_args"]
    assert args[args.index("--rpc") + 1] == ",".join(w.address for w in two_workers)
    assert "--tensor-split" in args and args[args.index("-ngl") + 1] == "all"


def test_a_worker_of_another_protocol_version_is_left_out_before_the_load(daemon, model, two_workers):
    peer = RpcPeer((6, 0, 0))
    try:
        write_config(daemon.paths, workers_config(tiny_config(model), peer.address, two_workers[0].address))
        daemon.start()
        status = daemon.wait_for(_split_ready, 90, "the placement on the matching worker")
        hellos = peer.hellos
        assert complete(status)  # it serves, on the matching worker
    finally:
        peer.close()
    placement = status["workers"]
    assert [u["address"] for u in placement["used"]] == [two_workers[0].address]
    (out,) = placement["left_out"]
    assert out["address"] == peer.address and out["reason"] == "rpc_version_mismatch"
    assert out["evidence"]["version"] == "6.0.0" and out["evidence"]["expected"] == "7.0.0"
    plans = [h for h in daemon.history(machine="launch") if h["event"] == "PlanReady"]
    assert hellos == len(plans)  # one check per plan, by the planner: llama-server was never pointed at it
