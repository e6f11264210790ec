"""The smoke run: a greedy generation on the tiny model, the token-identical gate's input.

Used twice with the same spec: at build time to record the reference tokens in bundle.json,
and by `bundle verify --smoke` to compare. Greedy (temperature 0, top_k 1), one slot, a fixed
seed and thread count, and no prompt cache, so the same build on the same CPU family gives
the same ids. Blocking code: the daemon calls it through `trio.to_thread.run_sync`; the wait
for the server and the request run on a private trio loop in that thread, reading the log
with engine.ready's `ServerLog` and talking through engine.api's `EngineClient`.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import httpx
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.exits import classify_exit
from stoker.daemon.core.launch_records import LaunchRecord
from stoker.daemon.engine.ready import ServerLog
from stoker.states.reasons import ReasonCode

_POLL = 0.05


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an engine runs in: LLAMA_ARG_* would silently add arguments, so it is dropped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    env.pop("GGML_BACKEND_DIR", None)
    env.update(extra or {})
    return env


@attrs.frozen
class SmokeSpec:
    model: Mapping[str, Any] = attrs.field(
        factory=lambda: {"n_layer": 2, "n_embd": 128, "n_head": 2, "n_ctx": 256, "seed": 0, "vocab": "spm"}
    )
    prompt: str = "Once upon a time there was a"
    n_predict: int = 16
    threads: int = 2

    @classmethod
    def for_variant(cls, variant: str) -> "SmokeSpec":
        """The smoke spec a build records its reference with.

        `native` gets Q8_0 layer weights: only quantized matmuls reach the kernels that
        -march=native adds (AMX tiles), so only they make a lying CPU fault in the smoke run.
        The safe variants keep F32 weights (their cached references were recorded so).
        """
        spec = cls()
        if variant == "native":
            return attrs.evolve(spec, model={**spec.model, "weights": "q8_0"})
        return spec

    def write_model(self, directory: Path) -> Path:
        from stoker.daemon.bundles.tinymodel import write_tiny_model  # gguf and numpy: only when one is written

        return write_tiny_model(Path(directory) / "smoke.gguf", **dict(self.model))

    def to_dict(self) -> dict[str, Any]:
        return {"model": dict(self.model), "prompt": self.prompt, "n_predict": self.n_predict, "threads": self.threads}


def _tail(log: Path, limit: int = 8000) -> str:
    try:
        data = log.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace")


def _engine_failed(proc: subprocess.Popen, log: Path, what: str) -> StokerError:
    reason, evidence = classify_exit(proc.returncode, _tail(log).splitlines())
    if reason != ReasonCode.CPU_ILLEGAL_INSTRUCTION:
        reason = ReasonCode.BUNDLE_VERIFY_FAILED
    return StokerError(reason, evidence={"step": what, **evidence})


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def generate(
    server: Path,
    model: Path,
    prompt: str,
    n_predict: int,
    scratch: Path,
    *,
    threads: int = 2,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> tuple[int, ...]:
    """Start `server` on `model`, run one greedy completion, stop it; return the token ids.
    `env`: added to the engine's (the devices a backend's runtime may use); `args`: added to its
    command line."""
    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    log = scratch / "smoke-server.log"
    # Recorded before the spawn, so that whoever starts next ends it if this process dies
    # mid-run (daemon/core/launch_records.py); the key goes by file, never in the argv.
    record = LaunchRecord.create("smoke")
    key = record.write_key()
    cmd = [
        str(server),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "-c",
        "256",
        "-np",
        "1",
        "-t",
        str(threads),
        "--seed",
        "0",
        "--api-key-file",
        str(record.key_file),
        "--log-colors",
        "off",
        *args,
    ]
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "top_k": 1,
        "seed": 0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    deadline = time.monotonic() + timeout
    try:
        with open(log, "wb") as out:
            # An empty cwd: the engine may look for backend libraries in its working directory.
            proc = subprocess.Popen(
                cmd,
                cwd=record.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=record.env(engine_env(env)),
                start_new_session=True,
            )
    except OSError:
        record.remove()
        raise
    record.record_process(proc.pid)
    try:
        resp = trio.run(functools.partial(_complete, proc, log, key, body, deadline))
        if resp.status_code != 200 or not isinstance(resp.json().get("tokens"), list):
            raise StokerError(
                ReasonCode.BUNDLE_VERIFY_FAILED,
                "The smoke completion failed.",
                {"status": resp.status_code, "body": resp.text[:500]},
            )
        return tuple(int(t) for t in resp.json()["tokens"])
    except httpx.HTTPError as err:
        if proc.poll() is not None:
            raise _engine_failed(proc, log, "smoke: completion") from None
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            "The smoke server stopped answering.",
            {"error": str(err), "log_tail": _tail(log, 2000)},
        ) from None
    finally:
        _stop(proc)
        record.remove()


async def _complete(
    proc: subprocess.Popen, log: Path, key: str, body: dict[str, Any], deadline: float
) -> httpx.Response:
    """Wait for the log to name the port and /health to say 200, then ask for the completion."""
    server_log = ServerLog(log, 0)
    server_log.poll()
    while (listening := server_log.listening) is None:
        if proc.poll() is not None:
            raise _engine_failed(proc, log, "smoke: start")
        if time.monotonic() > deadline:
            raise StokerError(
                ReasonCode.BUNDLE_VERIFY_FAILED,
                "The smoke server did not start in time.",
                {"step": "smoke: start", "log_tail": _tail(log, 2000)},
            )
        await trio.sleep(_POLL)
        server_log.poll()
    host, port = listening
    async with EngineClient.open(f"http://{host}:{port}", key, timeout=max(5.0, deadline - time.monotonic())) as engine:
        while (await engine.health()).status_code != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise _engine_failed(proc, log, "smoke: load")
            await trio.sleep(_POLL)
        return await engine.completion(body)


def run_smoke(
    server: Path,
    spec: SmokeSpec,
    scratch: Path,
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> tuple[int, ...]:
    """Write the tiny model into `scratch` and return the greedy tokens `server` generates."""
    model = spec.write_model(scratch)
    return generate(
        server, model, spec.prompt, spec.n_predict, scratch, threads=spec.threads, timeout=timeout, env=env, args=args
    )
