"""server_process without the engine: argv and env, log parsing, and the two fake-server cases.

A fake server (a Python script) stands in for llama-server only where the real one cannot
be made to misbehave on demand: a stall while loading and a SIGILL. Everything else runs
against the real engine in tests/integration/test_server_process.py.
"""

from __future__ import annotations

import functools
import os
import sys
import textwrap

import psutil
import pytest
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.process import ServerSpec, serve_server, server_argv, server_env, stop_server
from stoker.daemon.engine.ready import ServerLog, engine_seconds, wait_ready
from stoker.states.reasons import ReasonCode
from tests.waits import until

# Recorded from the CPU build (-lv 4 --log-colors off), abridged.
RECORDED_LOAD = textwrap.dedent(
    """\
    llama_model_loader: loaded meta data with 27 key-value pairs and 21 tensors from /m/tiny.gguf (version GGUF V3 (latest))
    load_tensors: offloaded 3/3 layers to GPU
    load_tensors:   CPU_Mapped model buffer size =     1.52 MiB
    load_tensors:        CUDA0 model buffer size =     0.58 MiB
    llama_context: n_ctx                 = 512
    llama_kv_cache:      CUDA0 KV buffer size =     0.50 MiB
    llama_prepare_model_devices: using device CUDA0 (NVIDIA H200) (0000:00:00.0) - 142629 MiB free
    srv    load_model: initializing slots, n_slots = 1
    srv  llama_server: model loaded
    srv  llama_server: listening on http://127.0.0.1:41235
    """
)


def _fake_server(tmp_path, body: str):
    script = tmp_path / "fake-llama-server"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return ServerSpec(server_path=script, model_path=tmp_path / "model.gguf")


def test_argv_carries_the_settings_but_never_the_key(tmp_path):
    spec = ServerSpec(
        server_path="/b/llama-server",
        model_path="/m.gguf",
        port=0,
        ctx_size=2048,
        parallel=2,
        threads=4,
        backend_args=["-ngl", "99"],
        flash_attn="off",
        slot_save_path=tmp_path,
        extra_args=["--swa-full"],
    )
    argv = server_argv(spec, api_key_file=tmp_path / "key")
    joined = " ".join(argv)
    for part in (
        "-m /m.gguf",
        "--host 127.0.0.1",
        "--port 0",
        "-lv 4",
        "--log-colors off",
        "-c 2048",
        "-np 2",
        "-t 4",
        "-ngl 99",
        "-fa off",
        f"--slot-save-path {tmp_path}",
        f"--api-key-file {tmp_path / 'key'}",
    ):
        assert part in joined
    assert argv[-1] == "--swa-full" and "--api-key" not in argv


def test_env_is_minimal_and_explicit(monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_MODEL", "/somewhere/else.gguf")
    monkeypatch.setenv("GGML_BACKEND_DIR", "/tmp/evil")
    env = server_env(ServerSpec(server_path="/s", model_path="/m", env={"CUDA_VISIBLE_DEVICES": "0"}))
    assert "LLAMA_ARG_MODEL" not in env and "GGML_BACKEND_DIR" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["LLAMA_ARG_UI"] == "0"


async def test_log_facts_are_parsed(tmp_path):
    path = tmp_path / "server.log"
    path.write_text(RECORDED_LOAD[:60])  # a partial line is progress but not yet a line
    log = ServerLog(path, 0)
    assert log.poll() and not log.tail
    path.write_text(RECORDED_LOAD)
    assert log.poll()
    assert log.model_path == "/m/tiny.gguf"
    assert log.offloaded == (3, 3)
    assert log.n_ctx == 512
    assert [(b.kind, b.device, b.mib) for b in log.buffers] == [
        ("model", "CPU_Mapped", 1.52),
        ("model", "CUDA0", 0.58),
        ("KV", "CUDA0", 0.5),
    ]
    assert log.devices == ["CUDA0 (NVIDIA H200)"]
    assert log.model_loaded and log.listening == ("127.0.0.1", 41235)
    assert not log.poll()  # nothing new


async def test_log_facts_among_serving_lines_and_split_reads(tmp_path):
    path = tmp_path / "server.log"
    serving = "0.00.351.883 I slot get_availabl: id  3 | task -1 |  - skipping, slot is empty\n" * 500
    text = serving + RECORDED_LOAD.replace("\n", "\r\n") + serving + "srv  log: caf\u00e9 done\n"
    raw = text.encode()
    cut = raw.index("\u00e9".encode()) + 1  # a read that ends inside a two-byte character
    path.write_bytes(raw[:cut])
    log = ServerLog(path, 0)
    assert log.poll()
    assert log.offloaded == (3, 3) and log.n_ctx == 512 and log.listening == ("127.0.0.1", 41235)
    assert log.tail[-1].endswith("skipping, slot is empty")  # no CR kept, the unfinished line not yet
    path.write_bytes(raw)
    assert log.poll()
    assert log.tail[-1] == "srv  log: caf\u00e9 done" and len(log.tail) == 400
    assert len(log.buffers) == 3 and log.devices == ["CUDA0 (NVIDIA H200)"]


def test_engine_timestamps():
    assert engine_seconds("0.07.699.316 I srv  llama_server: model loaded") == 7.699316
    assert engine_seconds("2.03.000.001 I x") == 123.000001
    assert engine_seconds("error: invalid argument: --x") is None


async def test_a_stalled_load_is_server_stalled_and_stop_ends_it(tmp_path):
    spec = _fake_server(
        tmp_path,
        """\
        import time
        print("llama_model_loader: loading...", flush=True)
        time.sleep(120)
    """,
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "s.log"))
            with pytest.raises(StokerError) as err:
                await wait_ready(handle, stall_timeout=1.0, ready_timeout=20)
            assert err.value.reason == ReasonCode.SERVER_STALLED
            assert err.value.evidence["last_line"] == "llama_model_loader: loading..."
            report = await stop_server(handle, grace=2)
    assert report.expected and report.signal == "SIGTERM"
    with pytest.raises(ProcessLookupError):
        os.killpg(handle.pgid, 0)
    assert not handle.launch_dir.exists()


async def test_sigill_is_cpu_illegal_instruction(tmp_path):
    spec = _fake_server(
        tmp_path,
        """\
        import os, signal
        print("graph_compute: warming up", flush=True)
        os.kill(os.getpid(), signal.SIGILL)
    """,
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "s.log"))
            with pytest.raises(StokerError) as err:
                await wait_ready(handle, stall_timeout=10, ready_timeout=20)
    assert err.value.reason == ReasonCode.CPU_ILLEGAL_INSTRUCTION
    assert err.value.evidence["signal"] == "SIGILL"
    assert handle.exit is not None and not handle.exit.expected


async def test_cancelling_the_owner_kills_a_server_that_ignores_sigterm(tmp_path):
    spec = _fake_server(
        tmp_path,
        """\
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stubborn", flush=True)
        time.sleep(120)
    """,
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "s.log", grace=0.5))
            while not handle.log.tail:
                await handle.wait_changed()
            nursery.cancel_scope.cancel()
    assert handle.exit is not None and handle.exit.expected
    assert handle.exit.signal == "SIGKILL"
    with pytest.raises(ProcessLookupError):
        os.killpg(handle.pgid, 0)


async def test_a_missing_binary_is_server_spawn_failed(tmp_path):
    spec = ServerSpec(server_path=tmp_path / "nope", model_path=tmp_path / "m.gguf")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            with pytest.raises(StokerError) as err:
                await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "s.log"))
    assert err.value.reason == ReasonCode.SERVER_SPAWN_FAILED


async def test_a_leader_that_exits_leaves_no_survivor_in_its_group(tmp_path):
    spec = _fake_server(
        tmp_path,
        """\
        import subprocess, sys
        child = subprocess.Popen(["sleep", "60"])
        print(f"child {child.pid}", flush=True)
        sys.exit(3)
    """,
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(functools.partial(serve_server, spec, log_path=tmp_path / "s.log"))
            report = await handle.wait_exit()
        assert report.returncode == 3 and report.reason == ReasonCode.SERVER_CRASHED
        child = int(report.evidence["log_tail"][-1].split()[1])

        def dead() -> bool:  # killed; init reaps the orphan in its own time
            try:
                return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        await until(dead, timeout=10, what=f"the group's survivor {child} to be killed")


def test_env_passes_gpu_selection_and_loader_path(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/cuda/lib64")
    monkeypatch.setenv("SOME_SECRET", "x")
    env = server_env(ServerSpec(server_path="/s", model_path="/m"))
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64"
    assert "SOME_SECRET" not in env


async def test_an_offload_claim_without_weights_on_a_device_is_not_believed(tmp_path):
    # b11434 with the RPC backend built in, CPU only, no --rpc (recorded on this machine): the
    # engine says it offloaded every layer while every weight is in host memory.
    from stoker.daemon.engine.ready import device_offload

    path = tmp_path / "server.log"
    path.write_text(
        "0.00.009.077 I load_tensors: offloaded 3/3 layers to GPU\n"
        "0.00.009.078 I load_tensors:   CPU_Mapped model buffer size =     1.57 MiB\n"
    )
    log = ServerLog(path, 0)
    log.poll()
    assert log.offloaded == (3, 3)  # what the engine said
    assert device_offload(log.offloaded, log.buffers) is None  # what is true: nothing offloaded
    cuda = tmp_path / "cuda.log"
    cuda.write_text(RECORDED_LOAD)
    log = ServerLog(cuda, 0)
    log.poll()
    assert device_offload(log.offloaded, log.buffers) == (3, 3)  # CUDA0 holds weights: believed
    rpc = tmp_path / "rpc.log"
    rpc.write_text(
        "0.00.100.000 I load_tensors: offloaded 3/3 layers to GPU\n"
        "0.00.100.001 I load_tensors:   CPU_Mapped model buffer size =     0.20 MiB\n"
        "0.00.100.002 I load_tensors: RPC0[127.0.0.1:50052] model buffer size =     0.70 MiB\n"
    )
    log = ServerLog(rpc, 0)
    log.poll()
    assert device_offload(log.offloaded, log.buffers) == (3, 3)  # a worker's device holds them


async def test_a_serving_engines_burst_of_lines_leaves_its_last_lines_in_the_tail_without_a_gap(tmp_path):
    path = tmp_path / "server.log"
    path.write_text(RECORDED_LOAD)
    log = ServerLog(path, 0)
    assert log.poll() and log.listening is not None
    with open(path, "a") as f:
        f.write("".join(f"slot get_availabl: id {i % 64} | task {i} | checking sim\n" for i in range(50)))
    assert log.poll()
    assert log.tail[-1].endswith("task 49 | checking sim") and "model loaded" in "\n".join(log.tail)
    with open(path, "a") as f:  # ~600 KB between two polls of a busy server with 64 slots
        f.write("".join(f"slot get_availabl: id {i % 64} | task {i} | checking sim\n" for i in range(50, 12050)))
    assert log.poll()
    tail = list(log.tail)
    assert len(tail) == 400 and tail == [
        f"slot get_availabl: id {i % 64} | task {i} | checking sim" for i in range(12050 - 400, 12050)
    ]
