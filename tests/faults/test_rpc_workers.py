"""RPC workers that fail: one lost mid-run (the head re-plans without it, with rpc_worker_lost
and its evidence), a worker's rpc-server killed (restarted with backoff) or its `stoker worker`
killed (the server is adopted by the next one, identity proven), and a LAN bind refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil

from tests.integration.daemon_harness import tiny_config, write_config
from tests.integration.rpc_workers import WorkerProcess, complete, workers_config


def _placed_on(addresses: list[str]):
    def check(status: dict) -> bool:
        placement = status.get("workers") or {}
        used = [u["address"] for u in placement.get("used", [])]
        return status["state"] == "ready" and placement.get("confirmed") is True and used == addresses

    return check


def test_a_worker_lost_mid_run_is_replanned_without_it(daemon, model, two_workers):
    first, second = two_workers
    write_config(daemon.paths, workers_config(tiny_config(model), first.address, second.address))
    daemon.start()
    status = daemon.wait_for(_placed_on([first.address, second.address]), 90, "the split over both")
    before = complete(status)

    # The second host goes away for good: its supervisor first (else it would restart the
    # server), then the server, while a long generation is running on both.
    streaming = threading.Thread(target=lambda: _swallow(complete, status, 400), daemon=True)
    streaming.start()
    second.proc.send_signal(signal.SIGKILL)
    second.proc.wait(10)
    os.kill(second.rpc_server_pid(), signal.SIGKILL)

    after = daemon.wait_for(_placed_on([first.address]), 120, "the re-plan on the first worker")
    streaming.join(30)
    assert complete(after) == before

    history = daemon.history(machine="launch")
    exits = [h for h in history if h["event"] == "ServerExited"]
    assert exits and exits[-1]["reason"] == "rpc_worker_lost"
    assert "RPC" in (exits[-1]["evidence"].get("line") or ""), exits[-1]["evidence"]
    (out,) = after["workers"]["left_out"]
    assert out["address"] == second.address and out["reason"] == "rpc_worker_lost"
    assert out["evidence"]["was_in_plan"] is True and out["evidence"]["reachable"] is False
    # The re-plan stayed on the CPU backend: a worker's failure is never the local backend's.
    assert after["backend"] == "cpu" and not any(f["reason"].endswith("startup_failed") for f in after["fallbacks"])


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the generation dies with the worker: that is the point
        pass


def test_stoker_worker_restarts_its_server_and_a_new_one_adopts_it(tmp_path, cpu_bundle):
    worker = WorkerProcess(tmp_path / "w", cpu_bundle).start()
    try:
        pid = worker.wait_serving()
        mark = len(worker.text())
        os.kill(pid, signal.SIGKILL)
        worker.wait_line(r"worker backoff .*\[server_crashed\]", 30, mark)
        restarted = worker.wait_serving(30, mark)
        assert restarted != pid

        # `stoker worker` itself killed: its server keeps serving, and the next one adopts it.
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(10)
        assert psutil.pid_exists(restarted)
        mark = len(worker.text())
        worker.start()
        assert worker.wait_serving(30, mark) == restarted
        history = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "worker", "status", "--json"],
            env=worker.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert '"state": "serving"' in history.stdout and f'"pid": {restarted}' in history.stdout
    finally:
        worker.stop()
    assert not psutil.pid_exists(restarted) or psutil.Process(restarted).status() == psutil.STATUS_ZOMBIE


def test_a_lan_bind_is_refused_without_saying_the_rpc_is_unauthenticated(tmp_path, cpu_bundle):
    worker = WorkerProcess(tmp_path / "w", cpu_bundle)
    result = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "worker", "run", "--host", "0.0.0.0"],
        env=worker.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1 and "allow_unauthenticated_rpc" in result.stderr
    assert worker.rpc_server_pid() is None
