"""A real `stoker daemon` in a subprocess, on a tmp STOKER_HOME, driven over its socket."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import psutil

from stoker.daemon.control.client import ControlClient
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from tests.waits import wait_until


def write_config(paths: StokerPaths, text: str) -> None:
    """Write the daemon's config; Ollama's API off unless the text has an `[ollama]` section
    (its default port, 11434, is one for the whole machine: see `tiny_config`)."""
    if "[ollama]" not in text:
        text = text + ("" if text.endswith("\n") or not text else "\n") + "[ollama]\nenabled = false\n"
    paths.config_dir.mkdir(parents=True, exist_ok=True)
    tmp = paths.config_file.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, paths.config_file)


def tiny_config(
    model: Path, *, snapshots: bool | dict[str, Any] = False, ollama_port: int | None = None, **extra_server: Any
) -> str:
    """A fast config for `model`; `snapshots`: True, or a dict of [snapshots] keys, turns them on.
    Ollama's API is off unless `ollama_port` is given: its default port is Ollama's own 11434,
    which daemons of tests run at the same time must not fight over."""
    server = {"model": str(model), "ctx_size": 256, "stall_timeout_s": 30.0, "ready_timeout_s": 60.0, **extra_server}
    lines = ["[server]"]
    for key, value in server.items():
        lines.append(f"{key} = {_toml(value)}")
    lines += [
        "[supervisor]",
        "backoff_initial_s = 0.1",
        "backoff_max_s = 0.4",
        "max_restarts = 3",
        "stable_after_s = 30",
        "stop_grace_s = 3",
        "[snapshots]",
    ]
    snap = {"enabled": bool(snapshots), **(snapshots if isinstance(snapshots, dict) else {})}
    lines += [f"{key} = {_toml(value)}" for key, value in snap.items()]
    lines += ["[ollama]", "enabled = false"] if ollama_port is None else ["[ollama]", f"port = {ollama_port}"]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


class DaemonProcess:
    """One daemon subprocess; `stop()` shuts it down and checks that no server is left."""

    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.env = {**os.environ, "STOKER_HOME": str(home), **(env or {})}
        self.paths = StokerPaths.from_env(self.env)
        self.proc: subprocess.Popen | None = None
        self.output = self.paths.data_dir / "daemon-test.log"

    def start(self, wait: bool = True) -> "DaemonProcess":
        self.paths.data_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.output, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stoker.daemon", "daemon", "--log-level", "debug"],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        out.close()
        if wait:
            self.wait_socket()
        return self

    def client(self, timeout: float = 30.0) -> ControlClient:
        return ControlClient(self.paths.socket_path, timeout=timeout)

    def call(self, method: str, **params: Any) -> Any:
        with self.client() as c:
            return c.call(method, **params)

    def wait_socket(self, timeout: float = 30.0) -> None:
        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                return bool(self.call("ping"))
            except StokerError:
                return False

        wait_until(answers, timeout=timeout, what="the daemon's socket to answer", detail=self.log_text)

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float = 60.0, what: str = "condition") -> dict:
        status: dict = {}

        def reached() -> dict | None:
            nonlocal status
            status = self.call("status")
            return status if predicate(status) else None

        return wait_until(
            reached, timeout=timeout, what=what, detail=lambda: f"last status: {status}\n{self.log_text()[-4000:]}"
        )

    def wait_state(self, state: str, timeout: float = 60.0) -> dict:
        return self.wait_for(lambda s: s["state"] == state, timeout, f"state {state}")

    def history(self, **params: Any) -> list[dict]:
        return self.call("history", **params)

    def log_text(self) -> str:
        try:
            return self.output.read_text(errors="replace")
        except OSError:
            return ""

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.call("shutdown")
        except StokerError:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def servers_for(model: Path) -> list[psutil.Process]:
    """Every llama-server process on this machine that serves `model`."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
        except psutil.Error:
            continue
        if cmd and cmd[0].endswith("llama-server") and str(model) in cmd:
            found.append(proc)
    return found


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: a port the kernel hands out
    (`bind` to 0, every outgoing connection, every engine's `--port 0`) could be taken by
    another test process between this check and the daemon's own bind (a front door then found
    its port in use); one below that range is only ever taken by an explicit bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_with_frontdoor(daemon: "DaemonProcess", model: Path, **frontdoor: Any) -> str:
    """Start `daemon` with its front door on a free port; the front door's /v1 URL."""
    port = free_port()
    lines = [f"port = {port}", *(f"{key} = {value}" for key, value in frontdoor.items())]
    write_config(daemon.paths, tiny_config(model) + "[frontdoor]\n" + "\n".join(lines) + "\n")
    daemon.start()
    return f"http://127.0.0.1:{port}/v1"
