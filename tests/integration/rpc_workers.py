"""Real RPC workers for the tests: `stoker worker` subprocesses, each on its own STOKER_HOME with
the CPU bundle installed and `[worker] port` free, and the engine's answers read directly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from stoker.daemon.bundles.installed import install_bundle
from stoker.daemon.core.paths import StokerPaths
from tests.integration.daemon_harness import free_port, write_config

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


class WorkerProcess:
    """One `stoker worker` (its own home, bundle and port); its stdout has a line per transition."""

    def __init__(self, home: Path, bundle_zip: Path, port: int | None = None, extra: str = "") -> None:
        self.home = home
        self.port = port or free_port()
        self.env = {**os.environ, "STOKER_HOME": str(home)}
        self.paths = StokerPaths.from_env(self.env)
        if not self.paths.bundles_dir.exists():
            install_bundle(bundle_zip, self.paths)
        write_config(self.paths, f"[worker]\nport = {self.port}\nthreads = 1\n{extra}")
        self.out = home / "worker-test.log"
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "WorkerProcess":
        out = open(self.out, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stoker.daemon", "worker"],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        out.close()
        return self

    def text(self) -> str:
        try:
            return self.out.read_text(errors="replace")
        except OSError:
            return ""

    def wait_line(self, pattern: str, timeout: float = 60.0, after: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (m := re.search(pattern, self.text()[after:])) is not None:
                return m
            if (
                self.proc is not None
                and self.proc.poll() is not None
                and re.search(pattern, self.text()[after:]) is None
            ):
                raise AssertionError(f"stoker worker exited {self.proc.returncode}:\n{self.text()}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} from the worker:\n{self.text()}")

    def wait_serving(self, timeout: float = 60.0, after: int = 0) -> int:
        """The pid of the rpc-server once the worker says it serves."""
        return int(self.wait_line(r"worker serving\s+\S+\s+pid (\d+)", timeout, after).group(1))

    def rpc_server_pid(self) -> int | None:
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if cmd and cmd[0].endswith("ggml-rpc-server") and str(self.port) in cmd and str(self.home) in cmd[0]:
                return proc.pid
        return None

    def stop(self) -> None:
        """Ctrl-C for the worker (it stops its server), then anything left is killed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        pid = self.rpc_server_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)


def complete(status: dict[str, Any], n: int = 24, prompt: str = PROMPT, timeout: float = 120) -> list[int]:
    """Greedy tokens from the ready engine itself (endpoint and key from status)."""
    reply = httpx.post(
        f"{status['endpoint']}/completion",
        headers={"Authorization": f"Bearer {status['api_key']}"},
        json={
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0,
            "seed": 1,
            "cache_prompt": False,
            "return_tokens": True,
        },
        trust_env=False,
        timeout=timeout,
    )
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]
    assert len(tokens) == n
    return tokens


def workers_config(base: str, *addresses: str) -> str:
    return base + "".join(f'[[workers]]\naddress = "{a}"\n' for a in addresses)
