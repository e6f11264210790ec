"""server_process and server_identity against the real llama-server and the tiny model."""

from __future__ import annotations

import functools
import os
import signal
import socket
import stat
import subprocess
import sys

import attrs
import psutil
import pytest
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.identity import adopt, read_identity, stop_orphan, verify_identity, write_identity
from stoker.daemon.engine.process import ServerSpec, serve_server, stop_server
from stoker.daemon.engine.ready import wait_ready
from stoker.states.reasons import ReasonCode
from tests.waits import until

pytestmark = pytest.mark.engine

TIMEOUT = 60


@pytest.fixture
def spec(installed_cpu_bundle, tiny_model):
    return ServerSpec(
        server_path=installed_cpu_bundle.server, model_path=tiny_model, ctx_size=512, parallel=1, threads=1
    )


def _group_alive(pgid: int) -> bool:
    """A live (non-zombie) process in the group: an orphan's zombie waits for init to reap it."""
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


async def test_start_ready_serve_with_the_key_stop(spec, tmp_path):
    log_path = tmp_path / "server.log"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=log_path))
            report = await wait_ready(handle, stall_timeout=20, ready_timeout=TIMEOUT)
            assert report.port == handle.port and report.port > 0
            assert report.base_url == f"http://127.0.0.1:{report.port}"
            assert f"listening on http://127.0.0.1:{report.port}" in report.evidence_lines["listening"]
            assert report.offloaded_layers is None  # CPU only: the line is absent
            assert report.model_path == str(spec.model_path)
            assert report.total_slots == 1 and report.n_ctx == 512
            assert any(b.kind == "model" for b in report.buffers)
            assert report.build_info and 0 < report.load_seconds <= report.ready_seconds
            assert report.engine_load_seconds is not None and report.engine_load_seconds > 0

            body = {"prompt": "hello", "n_predict": 4}
            async with EngineClient.open(report.base_url, handle.api_key, timeout=20) as engine:
                ok = await engine.completion(body)
                assert ok.status_code == 200 and "content" in ok.json()
                assert (await engine.props()).json()["ui"] is False
                assert (await engine.props(with_key=False)).status_code == 401
            async with EngineClient.open(report.base_url, None, timeout=20) as keyless:
                assert (await keyless.completion(body)).status_code == 401
                assert await keyless.healthy()  # public in llama-server
            async with EngineClient.open(report.base_url, "nope", timeout=20) as wrong:
                assert (await wrong.completion(body)).status_code == 401

            assert handle.api_key not in " ".join(psutil.Process(handle.pid).cmdline())
            assert handle.process.returncode is None
            exit_report = await stop_server(handle, grace=10)
    assert exit_report.expected and exit_report.returncode is not None
    assert not _group_alive(handle.pgid)
    assert not handle.launch_dir.exists()
    assert "listening on" in log_path.read_text()  # the log is kept


async def test_kill_9_is_a_crash_with_sigkill_evidence(spec, tmp_path):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "server.log"))
            await wait_ready(handle, stall_timeout=20, ready_timeout=TIMEOUT)
            os.kill(handle.pid, signal.SIGKILL)
            report = await handle.wait_exit()
    assert report.reason == ReasonCode.SERVER_CRASHED and not report.expected
    assert report.returncode == -9 and report.signal == "SIGKILL"
    assert report.evidence["signal"] == "SIGKILL" and report.evidence["log_tail"]
    assert not _group_alive(handle.pgid)


async def test_missing_model_is_model_missing(spec, tmp_path):
    spec = attrs.evolve(spec, model_path=tmp_path / "absent.gguf")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "server.log"))
            with pytest.raises(StokerError) as err:
                await wait_ready(handle, stall_timeout=20, ready_timeout=TIMEOUT)
    assert err.value.reason == ReasonCode.MODEL_MISSING
    assert "failed to open GGUF file" in err.value.evidence["line"]
    assert handle.exit is not None and handle.exit.returncode == 1


@pytest.mark.parametrize("kind", ["directory", "/dev/zero"])
async def test_a_model_path_that_is_not_a_file_is_not_model_missing(spec, tmp_path, kind):
    """The engine opens a directory or /dev/zero and cannot read a GGUF header from it: a model
    it cannot load (the file is there), never "does not exist"."""
    spec = attrs.evolve(spec, model_path=tmp_path if kind == "directory" else kind)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "server.log"))
            report = await handle.wait_exit()
    assert report.reason == ReasonCode.MODEL_LOAD_FAILED and report.returncode == 1
    assert "No such file" not in "\n".join(report.evidence["log_tail"])


async def test_a_taken_port_is_port_in_use(spec, tmp_path):
    with socket.socket() as taken, trio.fail_after(TIMEOUT):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = attrs.evolve(spec, port=taken.getsockname()[1])
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "server.log"))
            with pytest.raises(StokerError) as err:
                await wait_ready(handle, stall_timeout=20, ready_timeout=TIMEOUT)
    assert err.value.reason == ReasonCode.PORT_IN_USE
    assert f"port: {spec.port}" in err.value.evidence["line"]


async def test_cancelling_the_owner_stops_the_server(spec, tmp_path):
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(
                functools.partial(serve_server, spec, log_path=tmp_path / "server.log", grace=5)
            )
            await wait_ready(handle, stall_timeout=20, ready_timeout=TIMEOUT)
            nursery.cancel_scope.cancel()
    assert handle.exit is not None and handle.exit.expected
    assert not _group_alive(handle.pgid)


async def test_identity_proves_ours_and_refuses_a_reused_pid(spec, tmp_path):
    ident_path = tmp_path / "run" / "server.json"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(
                functools.partial(serve_server, spec, log_path=tmp_path / "server.log", identity_path=ident_path)
            )
            report = await wait_ready(handle, stall_timeout=20, ready_timeout=TIMEOUT)
            ident = handle.identity
            assert ident.port == report.port and ident.pid == handle.pid == ident.pgid
            assert stat.S_IMODE(ident_path.stat().st_mode) == 0o600
            assert read_identity(ident_path) == ident  # rewritten with the real port
            copy = tmp_path / "copy" / "server.json"
            write_identity(copy, ident)
            assert read_identity(copy) == ident and stat.S_IMODE(copy.stat().st_mode) == 0o600
            assert read_identity(tmp_path / "nothing.json") is None

            assert await verify_identity(ident)
            assert not await verify_identity(attrs.evolve(ident, api_key="not-the-key"))
            assert not await verify_identity(attrs.evolve(ident, create_time=ident.create_time + 100))

            # A pid that now belongs to another process: forged identity with a wrong start time.
            with subprocess.Popen(["sleep", "60"]) as sleeper:
                try:
                    forged = attrs.evolve(ident, pid=sleeper.pid, pgid=sleeper.pid, create_time=ident.create_time)
                    assert not await verify_identity(forged)
                    assert await adopt(forged) is None
                    assert not await stop_orphan(forged, grace=1)
                    # Right start time but another executable: still not ours.
                    same_time = attrs.evolve(forged, create_time=psutil.Process(sleeper.pid).create_time())
                    assert not await stop_orphan(same_time, grace=1)
                    assert sleeper.poll() is None  # never signalled
                finally:
                    sleeper.kill()

            adopted = await adopt(read_identity(ident_path))
            assert adopted is not None and adopted.is_running()
            async with EngineClient.open(adopted.base_url, adopted.api_key, timeout=20) as engine:
                resp = await engine.completion({"prompt": "hi", "n_predict": 2})
                assert resp.status_code == 200

            # Stopping it as an orphan (as the next daemon would) ends our child too.
            assert await stop_orphan(ident, grace=10)
            report = await handle.wait_exit()
    assert not _group_alive(handle.pgid)
    assert not adopted.is_running()
    assert not await verify_identity(ident)
    assert not ident_path.exists()  # removed at exit: it was still this server's


async def test_a_rejected_command_line_is_server_bad_arguments(spec, tmp_path):
    spec = attrs.evolve(spec, extra_args=("--no-such-option",))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "server.log"))
            report = await handle.wait_exit()
    assert report.reason == ReasonCode.SERVER_BAD_ARGUMENTS and report.returncode == 1
    assert report.evidence["line"] == "error: invalid argument: --no-such-option"


_DAEMON = """
import sys, trio
from stoker.daemon.engine.process import ServerSpec, serve_server
spec = ServerSpec(server_path=sys.argv[1], model_path=sys.argv[2], ctx_size=512, parallel=1, threads=1)
trio.run(lambda: serve_server(spec, log_path=sys.argv[3], identity_path=sys.argv[4]))
"""


async def test_a_server_outlives_its_killed_daemon_and_is_adopted(spec, tmp_path):
    ident_path = tmp_path / "run" / "server.json"
    log_path = tmp_path / "server.log"
    argv = [sys.executable, "-c", _DAEMON, str(spec.server_path), str(spec.model_path), str(log_path), str(ident_path)]
    with trio.fail_after(TIMEOUT):
        daemon = await trio.lowlevel.open_process(argv)
        try:
            ident = await until(
                lambda: (found := read_identity(ident_path)) is not None and found.port is not None and found,
                timeout=TIMEOUT / 2,
                what=f"the server's identity with its port in {ident_path}",
            )
        finally:
            daemon.kill()  # the daemon dies with -9: no cleanup runs
            await daemon.wait()
        adopted = None
        while adopted is None:  # listening is logged a moment before /health says 200
            adopted = await adopt(ident)
            await trio.sleep(0.05)
        async with EngineClient.open(adopted.base_url, adopted.api_key, timeout=20) as engine:
            resp = await engine.completion({"prompt": "hi", "n_predict": 2})
            assert resp.status_code == 200
        assert await adopted.stop(grace=10)
        reason, evidence = await adopted.wait_exit()
    assert not _group_alive(ident.pgid)
    assert not os.path.exists(ident.launch_dir)
    assert reason == ReasonCode.SERVER_CRASHED and evidence["returncode"] is None  # not our child
