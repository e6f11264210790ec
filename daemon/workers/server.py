"""ggml-rpc-server as a process: which bundle's, its command line, its log, its identity, its end.

The worker runs the `rpc_server` tool of an installed bundle (bundle.json `tools`), built from
the same source as its llama-server, so its RPC protocol is the bundle's `rpc_protocol`. It is
started in its own process group and session (a `stoker worker` killed with -9 leaves it
serving, and the next one adopts it once its identity is proven), in an empty working
directory (ggml loads backend libraries from the cwd), with a minimal environment, stdout and
stderr appended to logs/rpc-server.log. Its start-up lines (the version, the endpoint, each
device's name and memory) are printed with printf and only flushed when a client connects, so
the process runs line-buffered under `stdbuf -oL` where coreutils has it: the log then names
the devices at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import attrs
import psutil
import trio

from stoker.daemon.bundles.installed import InstalledBundle, list_installed
from stoker.daemon.config.workers import WorkerConfig
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.process_group import GroupLeader, live_process, stop_group
from stoker.daemon.engine.exits import classify_exit
from stoker.daemon.engine.identity import cmdline_digest
from stoker.daemon.engine.process import PASS_THROUGH_ENV
from stoker.states.convert import structure
from stoker.states.reasons import ReasonCode

RPC_TOOL = "rpc_server"
_DEVICE_LINE = re.compile(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$")
_VERSION_LINE = re.compile(r"Starting RPC server v(\d+\.\d+\.\d+)")


def choose_bundle(paths: StokerPaths, worker: WorkerConfig, backend_order: Sequence[str]) -> InstalledBundle:
    """The installed bundle whose rpc-server the worker runs: `[worker] backend`'s, or ("auto")
    the first in the backends' try order (GPUs before the CPU) that carries one."""
    carrying = [b for b in list_installed(paths) if RPC_TOOL in b.meta.tools]
    if worker.backend != "auto":
        carrying = [b for b in carrying if b.meta.backend == worker.backend]
    rank = {name: i for i, name in enumerate(backend_order)}
    carrying.sort(key=lambda b: (rank.get(b.meta.backend, len(rank)), b.meta.variant))
    if not carrying:
        wanted = "" if worker.backend == "auto" else f" {worker.backend}"
        raise StokerError(
            ReasonCode.BUNDLE_MISSING,
            f"No installed{wanted} engine bundle carries ggml-rpc-server (bundle.json tools.rpc_server): install "
            f"one built with GGML_RPC=ON (`stoker install`, or `stoker bundle build`).",
            {"bundles_dir": str(paths.bundles_dir), "backend": worker.backend},
        )
    return carrying[0]


def worker_argv(bundle: InstalledBundle, worker: WorkerConfig) -> list[str]:
    """ggml-rpc-server's command line for the config."""
    argv = [str(bundle.root / bundle.meta.tools[RPC_TOOL]), "--host", worker.host, "--port", str(worker.port)]
    if worker.devices:
        argv += ["--device", ",".join(worker.devices)]
    if worker.threads:
        argv += ["--threads", str(worker.threads)]
    if worker.cache:
        argv.append("--cache")
    return argv


def worker_env(bundle: InstalledBundle) -> dict[str, str]:
    """A minimal environment: nothing of the shell leaks in but the device selectors."""
    env = {"PATH": os.defpath, "LC_ALL": "C", "LANG": "C"}
    if "HOME" in os.environ:
        env["HOME"] = os.environ["HOME"]
    for name in PASS_THROUGH_ENV:
        if name in os.environ:
            env[name] = os.environ[name]
    return env


@attrs.frozen
class WorkerIdentity:
    """What `stoker worker` records about the rpc-server it started (runtime/rpc-worker.json)."""

    pid: int
    create_time: float
    exe: str
    cmdline_sha256: str
    address: str
    protocol: str | None
    log_path: str

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=".rpc-worker-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(attrs.asdict(self), f, sort_keys=True)
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> WorkerIdentity | None:
        try:
            return structure(json.loads(path.read_text()), cls)
        except (OSError, ValueError):  # MissingFields is a ValueError
            return None


def proven_process(ident: WorkerIdentity, argv: Sequence[str]) -> psutil.Process | None:
    """The live process the record names if pid, start time, executable and command line (the
    one this config would run) all match; else None: nothing is adopted or signalled."""
    proc = live_process(ident.pid, ident.create_time)
    if proc is None:
        return None
    try:
        exe = (proc.exe() or "").removesuffix(" (deleted)")
        cmdline = proc.cmdline()
    except (psutil.Error, OSError):
        return None
    if (
        exe != ident.exe
        or cmdline_digest(cmdline) != ident.cmdline_sha256
        or cmdline_digest(argv) != ident.cmdline_sha256
    ):
        return None
    return proc


def device_lines(log_path: Path, offset: int) -> tuple[str | None, list[dict[str, Any]]]:
    """(the version it printed, its devices: name, description, total and free MiB) from the
    log written since `offset`."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read(256 * 1024).decode("utf-8", "replace")
    except OSError:
        return None, []
    version, devices = None, []
    for line in text.splitlines():
        if (m := _VERSION_LINE.search(line)) is not None:
            version = m.group(1)
        elif (m := _DEVICE_LINE.match(line)) is not None:
            devices.append(
                {
                    "name": m.group(1),
                    "description": m.group(2),
                    "total_mib": int(m.group(3)),
                    "free_mib": int(m.group(4)),
                }
            )
    return version, devices


def log_tail(log_path: Path, offset: int, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - max_bytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


@attrs.define(eq=False)
class RunningWorker:
    """A spawned rpc-server: the process, where its log starts, its identity."""

    process: trio.Process
    identity: WorkerIdentity
    log_offset: int
    stop_requested: bool = False


async def spawn(
    paths: StokerPaths, bundle: InstalledBundle, worker: WorkerConfig, log_path: Path, identity_path: Path
) -> RunningWorker:
    """Start the rpc-server and record its identity; OSError when it cannot be executed."""
    argv = worker_argv(bundle, worker)
    prefix = [stdbuf, "-oL"] if (stdbuf := shutil.which("stdbuf")) else []
    cwd = paths.runtime_dir / "rpc-worker-cwd"
    cwd.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(log_path, "ab") as logf:
        os.chmod(log_path, 0o600)
        logf.write(f"==== stoker worker: launch {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {' '.join(argv)}\n".encode())
        logf.flush()
        offset = logf.tell()
        process = await trio.lowlevel.open_process(
            prefix + argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            cwd=str(cwd),
            env=worker_env(bundle),
            start_new_session=True,
        )
    create_time = 0.0
    for _ in range(50):  # stdbuf execs the server: the identity is the server's, not stdbuf's
        try:
            proc = psutil.Process(process.pid)
            if proc.cmdline() == argv:
                create_time = proc.create_time()
                break
        except (psutil.Error, OSError):
            break
        await trio.sleep(0.01)
    exe = os.path.realpath(argv[0])  # what psutil reads back from /proc/PID/exe
    identity = WorkerIdentity(
        process.pid, create_time, exe, cmdline_digest(argv), worker.address, bundle.meta.rpc_protocol, str(log_path)
    )
    identity.write(identity_path)
    return RunningWorker(process, identity, offset)


def classify(returncode: int | None, log_path: Path, offset: int) -> tuple[ReasonCode, dict[str, Any]]:
    """Why the rpc-server ended: the one exit classifier, on its log since the launch."""
    return classify_exit(returncode, log_tail(log_path, offset))


async def terminate(running: RunningWorker, grace: float) -> int | None:
    """TERM to its group, `grace` seconds, then KILL; the exit status."""
    running.stop_requested = True
    await stop_group(GroupLeader.of_child(running.process, running.identity.create_time or None), grace)
    return running.process.returncode


async def terminate_adopted(proc: psutil.Process, grace: float) -> None:
    """The same for a proven server another `stoker worker` started (not our child)."""
    await stop_group(GroupLeader.of_process(proc), grace)
