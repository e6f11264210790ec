"""The placement over RPC workers (states/fleet/rpc_placement.py) and the reading of one through the
protocol (daemon/workers/rpc_wire.py) against a loopback peer speaking ggml-rpc's opening."""

from __future__ import annotations

import trio

from stoker.daemon.fallback.workers import with_worker_layers
from stoker.daemon.workers.rpc_wire import read_worker, read_workers
from stoker.states.launch import records as LR
from stoker.states.reasons import ReasonCode
from stoker.states.fleet.rpc_placement import LocalDevice, RemoteDevice, WorkerReading, confirm, lost_workers, place
from rpc_peer import RpcPeer

GIB = 2**30


def _ok(address: str, *free_gib: int, version: str = "7.0.0") -> WorkerReading:
    devices = tuple(RemoteDevice(i, f * GIB, 2 * f * GIB) for i, f in enumerate(free_gib))
    return WorkerReading(address, True, version, devices)


def test_split_follows_free_memory_workers_first_then_local_gpus():
    placement = place(
        (_ok("10.0.0.2:50052", 3), _ok("10.0.0.3:50052", 1, 2)), "7.0.0", local=(LocalDevice("0: NVIDIA H200", 4096),)
    )
    assert placement.endpoints == ("10.0.0.2:50052", "10.0.0.3:50052")
    assert [w.device_names for w in placement.used] == [("RPC0",), ("RPC1", "RPC2")]
    assert placement.split == (3072.0, 1024.0, 2048.0, 4096.0)
    assert placement.args == ("--rpc", "10.0.0.2:50052,10.0.0.3:50052", "--tensor-split", "3072,1024,2048,4096")
    assert placement.left_out == () and placement.reason is None


def test_each_left_out_worker_has_its_reason_and_evidence():
    readings = (
        WorkerReading("a:1", False, error="connect: [Errno 111] Connection refused"),
        _ok("b:2", 1, version="6.1.0"),
        WorkerReading("c:3", False, error="connect: refused"),
        _ok("d:4", 2),
    )
    placement = place(readings, "7.0.0", lost=frozenset({"c:3"}))
    reasons = {o.address: o.reason for o in placement.left_out}
    assert reasons == {
        "a:1": ReasonCode.RPC_WORKER_UNREACHABLE,
        "b:2": ReasonCode.RPC_VERSION_MISMATCH,
        "c:3": ReasonCode.RPC_WORKER_LOST,
    }
    mismatch = next(o for o in placement.left_out if o.address == "b:2")
    assert mismatch.evidence["version"] == "6.1.0" and mismatch.evidence["expected"] == "7.0.0"
    assert placement.endpoints == ("d:4",) and placement.used[0].device_names == ("RPC0",)


def test_a_worker_that_passes_the_check_but_failed_in_the_engine_is_left_out_of_the_next_plan():
    # The engine lost an RPC connection, yet every worker of its plan answers the check now: the
    # ones that failed inside the engine are among them, so none of that plan is readmitted.
    readings = (_ok("liar:1", 1), _ok("spare:2", 1))
    placement = place(readings, "7.0.0", lost=frozenset({"liar:1"}))
    (out,) = placement.left_out
    assert (out.address, out.reason) == ("liar:1", ReasonCode.RPC_WORKER_FAILED)
    assert out.evidence["was_in_plan"] is True and out.evidence["reachable"] is True
    assert placement.endpoints == ("spare:2",)
    # Alone in its plan: the next one runs locally (no --rpc), not on the worker again.
    alone = place((_ok("liar:1", 1),), "7.0.0", lost=frozenset({"liar:1"}))
    assert alone.used == () and alone.args == () and alone.reason is ReasonCode.RPC_WORKER_FAILED
    # A worker of that plan that is gone now explains the loss: the others of it are trusted.
    gone = place(
        (WorkerReading("dead:1", False, error="refused"), _ok("liar:1", 1)),
        "7.0.0",
        lost=frozenset({"dead:1", "liar:1"}),
    )
    assert [(o.address, o.reason) for o in gone.left_out] == [("dead:1", ReasonCode.RPC_WORKER_LOST)]
    assert gone.endpoints == ("liar:1",)
    # Without a lost connection nothing is held against a worker that answers.
    assert place(readings, "7.0.0").endpoints == ("liar:1", "spare:2")


def test_no_worker_left_means_no_rpc_arguments_and_local_layers_as_planned():
    placement = place((WorkerReading("a:1", False, error="x"),), "7.0.0", local=(LocalDevice("0", 100),))
    assert placement.args == () and placement.split == ()
    assert with_worker_layers(["-ngl", "0"], placement, "auto") == ["-ngl", "0"]


def test_a_bundle_without_rpc_pairs_with_no_worker():
    placement = place((_ok("a:1", 1),), None)
    assert placement.left_out[0].reason == ReasonCode.RPC_VERSION_MISMATCH and not placement.used


def test_worker_layers_replace_the_backends_layer_count():
    placement = place((_ok("a:1", 1),), "7.0.0")
    assert with_worker_layers(["-ngl", "0"], placement, "auto") == [
        "-ngl",
        "all",
        "--rpc",
        "a:1",
        "--tensor-split",
        "1024",
    ]
    assert with_worker_layers(["-ngl", "auto", "--x"], placement, 7)[:3] == ["-ngl", "7", "--x"]


def test_lost_workers_only_after_an_exit_that_lost_one():
    placement = place((_ok("a:1", 1), _ok("b:2", 1)), "7.0.0")
    plan = LR.LaunchPlan("cpu", "avx2", "/b", "/b/s", "/m", rpc=placement)
    assert lost_workers(ReasonCode.RPC_WORKER_LOST, plan.rpc) == frozenset({"a:1", "b:2"})
    assert lost_workers(ReasonCode.SERVER_CRASHED, plan.rpc) == frozenset()
    assert lost_workers(ReasonCode.RPC_WORKER_LOST, None) == frozenset()


def test_the_plan_round_trips_through_history_json():
    from stoker.states.machine import from_json, to_json

    placement = place((_ok("a:1", 1), WorkerReading("b:2", False, error="refused")), "7.0.0")
    plan = LR.LaunchPlan("cpu", "avx2", "/b", "/b/s", "/m", rpc=placement)
    assert from_json(LR.LaunchPlan, to_json(plan)) == plan


def test_confirm_reads_the_engines_buffer_lines():
    placement = place((_ok("127.0.0.1:5", 1), _ok("127.0.0.1:6", 1)), "7.0.0")
    buffers = [
        {"kind": "model", "device": "RPC0[127.0.0.1:5]", "mib": 1.5},
        {"kind": "model", "device": "RPC0[127.0.0.1:6]", "mib": 1.25},  # the device's index on its worker
        {"kind": "model", "device": "CPU_Mapped", "mib": 0.5},
        {"kind": "KV", "device": "RPC0[127.0.0.1:5]", "mib": 9.0},
    ]
    proof = confirm(placement, buffers)
    assert proof["confirmed"] is True
    assert proof["workers_model_mib"] == {"127.0.0.1:5": 1.5, "127.0.0.1:6": 1.25}
    assert proof["local_model_mib"] == {"CPU_Mapped": 0.5}
    assert confirm(placement, buffers[:1])["missing"] == ["127.0.0.1:6"]


async def test_reading_a_peer_through_the_protocol():
    peer = RpcPeer((7, 0, 0), ((3 * GIB, 4 * GIB), (GIB, 2 * GIB)))
    other = RpcPeer((6, 5, 4))
    try:
        with trio.fail_after(10):
            reading = await read_worker(peer.address, "7.0.0")
            assert reading.reachable and reading.version == "7.0.0"
            assert reading.devices == (RemoteDevice(0, 3 * GIB, 4 * GIB), RemoteDevice(1, GIB, 2 * GIB))
            mismatched, gone = await read_workers((other.address, "127.0.0.1:1"), "7.0.0", timeout_s=2)
    finally:
        peer.close()
        other.close()
    assert mismatched.reachable and mismatched.version == "6.5.4" and mismatched.devices == ()
    assert not gone.reachable and "connect" in (gone.error or "")


async def test_a_peer_that_accepts_but_never_answers_times_out_as_unreachable():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)  # accepted by the kernel, never read: a worker busy with another client
    try:
        with trio.fail_after(10):
            reading = await read_worker(f"127.0.0.1:{sock.getsockname()[1]}", "7.0.0", timeout_s=0.5)
    finally:
        sock.close()
    assert not reading.reachable and "timed out" in (reading.error or "") and "busy" in (reading.error or "")


def test_the_tui_card_says_where_the_layers_are():
    from stoker.tui.widgets.backend_card import workers_lines

    placement = place((_ok("a:1", 1), WorkerReading("b:2", False, error="refused")), "7.0.0")
    from stoker.daemon.fallback.workers import confirm_placement

    plan = LR.LaunchPlan("cpu", "avx2", "/b", "/b/s", "/m", rpc=placement)
    ready = {"buffers": [{"kind": "model", "device": "RPC0[a:1]", "mib": 3.5}]}
    lines = workers_lines(confirm_placement(plan, ready))
    assert lines[0][:2] == ("worker", "a:1 (RPC0): 3.5 MiB of the model")
    assert lines[1][1] == "b:2: left out, rpc_worker_unreachable"
    before = workers_lines(confirm_placement(plan, None))
    assert before[0][1] == "a:1 (RPC0): planned on 1024 MiB free"
