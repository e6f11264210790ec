"""One llama-server process: spawn it, follow its log, wait until it is ready, stop it.

`serve_server` owns the child: start it with `await nursery.start(serve_server, spec, ...)`
and it hands back a `ServerHandle` once the process exists; it returns the `ExitReport` when
the process ends. `engine.ready.wait_ready(handle)` then waits for the model to load. Cancelling the owning scope stops the server (TERM to its process group,
grace, KILL) under a shielded, bounded scope, so a server never outlives its nursery.

The server writes its stdout and stderr straight into the log file (not through a pipe to
us), so that it survives a daemon killed with -9 and can be adopted; a reader task tails the
file for the lines that docs/engine-process.md lists.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

import attrs
import psutil
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.logfiles import LogRotation, files_unwritable, open_server_log, trim_server_log
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.process_group import KILL_WAIT, GroupLeader, signal_group, stop_group
from stoker.daemon.engine.exits import ExitReport, classify_exit, signal_name
from stoker.daemon.engine.identity import (
    ServerIdentity,
    cmdline_digest,
    exe_file,
    live_exe,
    read_identity,
    write_identity,
)
from stoker.daemon.engine.ready import ServerLog
from stoker.states.reasons import ReasonCode

DEFAULT_GRACE = 10.0
# How often the log is read: often early (a small model loads in ~0.1 s and time-to-ready
# counts), less while a big model loads, rarely once it serves. A read is one small pread.
_POLL_EARLY, _EARLY_FOR = 0.005, 2.0
_POLL_LOADING = 0.02
_POLL_SERVING = 0.25
# How often a serving server's log is measured against its size cap.
_TRIM_CHECK_S = 5.0


def _args(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _env_items(value: Mapping[str, str] | tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else (value or ())
    return tuple(sorted((str(k), str(v)) for k, v in items))


@attrs.frozen
class ServerSpec:
    """What to run: the engine binary, the model and the server settings of one launch."""

    server_path: Path = attrs.field(converter=Path)
    model_path: Path = attrs.field(converter=Path)
    host: str = "127.0.0.1"
    port: int = 0  # 0: the server binds a free port and the log names it
    ctx_size: int | None = None
    parallel: int | None = None
    threads: int | None = None
    backend_args: tuple[str, ...] = attrs.field(default=(), converter=_args)  # the backend plugin's: -ngl, --device
    flash_attn: str | None = None  # "on" | "off" | "auto"; None: the engine's default
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=_args)
    slot_save_path: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    env: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_env_items)


def server_argv(spec: ServerSpec, *, api_key_file: Path) -> list[str]:
    """The command line for a spec (the API key travels in a 0600 file, never in argv)."""
    argv = [
        str(spec.server_path),
        "-m",
        str(spec.model_path),
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--api-key-file",
        str(api_key_file),
        "-lv",
        "4",
        "--log-colors",
        "off",
    ]
    argv += _flags(("-c", spec.ctx_size), ("-np", spec.parallel), ("-t", spec.threads))
    argv += spec.backend_args
    argv += _flags(("-fa", spec.flash_attn), ("--slot-save-path", spec.slot_save_path))
    return argv + list(spec.extra_args)


def _flags(*pairs: tuple[str, object]) -> list[str]:
    """`flag value` for each setting that is set (None: the engine's default, no flag)."""
    return [part for flag, value in pairs if value is not None for part in (flag, str(value))]


PASS_THROUGH_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "GGML_VK_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
    # The Vulkan loader's choice of driver (an ICD outside the default folders).
    "VK_DRIVER_FILES",
    "VK_ICD_FILENAMES",
    "VK_ADD_DRIVER_FILES",
)


def server_env(spec: ServerSpec) -> dict[str, str]:
    """A minimal, explicit environment: nothing of the daemon's leaks in (no LLAMA_ARG_*)."""
    env = {"PATH": os.defpath, "LC_ALL": "C", "LANG": "C"}
    if "HOME" in os.environ:  # CUDA keeps its JIT cache under ~/.nv
        env["HOME"] = os.environ["HOME"]
    # No web UI: env instead of --no-webui so that a build without the option ignores it.
    env["LLAMA_ARG_UI"] = "0"  # this source's name for it
    env["LLAMA_ARG_NO_WEBUI"] = "1"  # older builds' name
    # Which GPUs the engine may use, and where the loader finds the toolkit libraries a
    # bundle declares but does not ship: the probes and `bundle verify` saw these, so the
    # server must see them too (else CUDA_VISIBLE_DEVICES="" hides the GPU from the probe
    # while the server still uses it).
    for name in PASS_THROUGH_ENV:
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(dict(spec.env))
    return env


@attrs.define(eq=False)
class ServerHandle:
    """A running llama-server child, owned by the `serve_server` task that started it."""

    spec: ServerSpec
    process: trio.Process
    api_key: str
    log: ServerLog
    log_path: Path
    launch_dir: Path
    argv: list[str]
    started_at: float  # wall clock
    started_clock: float  # trio clock, just after the spawn
    identity: ServerIdentity
    exit: ExitReport | None = None
    stop_requested: bool = False
    _oom_kills_at_start: int | None = None
    identity_path: Path | None = None
    log_rotation: LogRotation = LogRotation()
    log_start: int = 0  # where this launch's header line starts in the log
    _exited: trio.Event = attrs.field(factory=trio.Event)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def pgid(self) -> int:
        return self.identity.pgid

    @property
    def group(self) -> GroupLeader:
        """The server as the leader of its process group, for `stop_group`."""
        return GroupLeader.of_child(self.process, self.identity.create_time)

    @property
    def host(self) -> str:
        return self.log.listening[0] if self.log.listening else self.spec.host

    @property
    def port(self) -> int | None:
        """The real port: the spec's, or the one the log names when the spec said 0."""
        if self.log.listening:
            return self.log.listening[1]
        return self.spec.port or None

    @property
    def base_url(self) -> str | None:
        return f"http://{self.spec.host}:{self.port}" if self.port else None

    async def wait_exit(self) -> ExitReport:
        """Block until the process has ended and been classified."""
        await self._exited.wait()
        assert self.exit is not None
        return self.exit

    async def wait_changed(self) -> None:
        """Block until a new log line arrives or the process ends."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


async def serve_server(
    spec: ServerSpec,
    *,
    log_path: Path,
    grace: float = DEFAULT_GRACE,
    launch_root: Path | None = None,
    identity_path: Path | None = None,
    log_rotation: LogRotation = LogRotation(),
    task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED,
) -> ExitReport:
    """Run llama-server until it exits; `task_status.started(handle)` once it is spawned.

    With `identity_path`, the identity record is written there at spawn, rewritten once the
    log names the real port, and removed at exit if it is still this server's. The log is
    rotated before the launch when over `log_rotation`'s cap, and trimmed while it serves.
    A disk that refuses the launch files or the log is server_files_unwritable (not a spawn
    failure: the engine is fine).
    """
    log_path = Path(log_path).absolute()
    root = launch_root or StokerPaths.from_env().runtime_dir / "launch"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Per launch: an empty cwd (ggml loads backend libraries from the cwd) and the key file.
        launch_dir = Path(tempfile.mkdtemp(prefix="server-", dir=root))
    except OSError as exc:
        raise files_unwritable("server launch directory", root, exc) from exc
    what, where = "launch directory", launch_dir  # the file being written, until the spawn
    try:
        workdir = launch_dir / "cwd"
        workdir.mkdir(mode=0o700)
        api_key = secrets.token_urlsafe(32)
        key_file = launch_dir / "api-key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(api_key + "\n")
        argv = server_argv(spec, api_key_file=key_file)
        what, where = "log", log_path
        with open_server_log(log_path, log_rotation) as logf:
            header = f"==== stoker: launch {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {' '.join(argv)}\n".encode()
            logf.write(header)
            logf.flush()
            offset = logf.tell()
            what = ""
            oom_kills = _oom_kill_count()
            process = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=server_env(spec),
                start_new_session=True,
            )
    except OSError as exc:
        shutil.rmtree(launch_dir, ignore_errors=True)
        if what:
            raise files_unwritable(f"server {what}", where, exc) from exc
        raise StokerError(
            ReasonCode.SERVER_SPAWN_FAILED, evidence={"server_path": str(spec.server_path), "error": str(exc)}
        ) from exc
    except BaseException:  # cancelled before the spawn: nothing runs, nothing is left behind
        shutil.rmtree(launch_dir, ignore_errors=True)
        raise
    try:
        identity = _identity_of(process.pid, argv, spec, api_key, log_path, launch_dir)
    except BaseException:
        signal_group(GroupLeader.of_child(process), signal.SIGKILL)
        with trio.CancelScope(shield=True):
            await process.wait()
        shutil.rmtree(launch_dir, ignore_errors=True)
        raise
    handle = ServerHandle(
        spec=spec,
        process=process,
        api_key=api_key,
        log=ServerLog(log_path, offset, last_progress=trio.current_time()),
        log_path=log_path,
        launch_dir=launch_dir,
        argv=argv,
        started_at=identity.started_at,
        started_clock=trio.current_time(),
        identity=identity,
        oom_kills_at_start=oom_kills,
        identity_path=identity_path,
        log_rotation=log_rotation,
        log_start=offset - len(header),
    )
    try:
        _record_identity(handle)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow_log, handle)
            task_status.started(handle)
            await process.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + grace + 2 * KILL_WAIT):
            if process.returncode is None:  # cancelled or failed: we end it
                handle.stop_requested = True
            await stop_group(handle.group, grace)  # and what an engine that ended by itself left
            _finish(handle)
            shutil.rmtree(launch_dir, ignore_errors=True)
            _forget_identity(handle)
    assert handle.exit is not None
    return handle.exit


def _identity_of(
    pid: int, argv: list[str], spec: ServerSpec, api_key: str, log_path: Path, launch_dir: Path
) -> ServerIdentity:
    # Popen returns after exec (its error pipe closes on exec): exe and cmdline are the server's.
    proc = psutil.Process(pid)
    return ServerIdentity(
        pid=pid,
        pgid=os.getpgid(pid),
        create_time=proc.create_time(),
        exe=live_exe(proc) or str(Path(spec.server_path).resolve()),
        cmdline_sha256=cmdline_digest(argv),
        host=spec.host,
        port=spec.port or None,
        api_key=api_key,
        log_path=str(log_path),
        started_at=time.time(),
        launch_dir=str(launch_dir),
        exe_file=exe_file(pid),
    )


async def _follow_log(handle: ServerHandle) -> None:
    next_trim_check = trio.current_time() + _TRIM_CHECK_S
    while True:
        if handle.log.poll():
            if handle.port and handle.identity.port != handle.port:
                handle.identity = attrs.evolve(handle.identity, port=handle.port)
                _record_identity(handle)
            handle._notify()
        if trio.current_time() >= next_trim_check:
            next_trim_check = trio.current_time() + _TRIM_CHECK_S
            await _trim_log(handle)
        await trio.sleep(_poll_interval(handle))


async def _trim_log(handle: ServerHandle) -> None:
    """Keep a long-serving server's log under its cap (the facts of its launch are kept)."""
    if handle.log.offset < handle.log_rotation.max_bytes:
        return
    handle.log.poll()  # read what is there before it moves to .1
    size = await trio.to_thread.run_sync(trim_server_log, handle.log_path, handle.log_rotation, handle.log_start)
    if size is not None:
        handle.log.offset, handle.log_start = size, 0


def _poll_interval(handle: ServerHandle) -> float:
    if handle.log.listening:
        return _POLL_SERVING
    early = trio.current_time() - handle.started_clock < _EARLY_FOR
    return _POLL_EARLY if early else _POLL_LOADING


def _record_identity(handle: ServerHandle) -> None:
    if handle.identity_path is not None:
        write_identity(handle.identity_path, handle.identity)


def _forget_identity(handle: ServerHandle) -> None:
    # Only our own record: a newer launch may already have written its own there.
    if handle.identity_path is not None:
        recorded = read_identity(handle.identity_path)
        if recorded is not None and (recorded.pid, recorded.create_time) == (handle.pid, handle.identity.create_time):
            handle.identity_path.unlink(missing_ok=True)


def _finish(handle: ServerHandle) -> None:
    handle.log.poll(final=True)
    rc = handle.process.returncode
    oom_after = _oom_kill_count()
    oom = handle._oom_kills_at_start is not None and oom_after is not None and oom_after > handle._oom_kills_at_start
    reason, evidence = classify_exit(rc, list(handle.log.tail), oom_killed=oom)
    evidence["log_path"] = str(handle.log_path)
    handle.exit = ExitReport(rc, signal_name(rc), reason, evidence, handle.stop_requested, handle.log_path)
    handle._exited.set()
    handle._notify()


def _oom_kill_count() -> int | None:
    """The kernel OOM killer's count for our memory cgroup; the child starts in the same one.

    cgroup v2: `memory.events`; v1: `memory.oom_control`. In a container the cgroup path
    named in /proc/self/cgroup may not be mounted, so the mount root is tried as well.
    """
    try:
        entries = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for entry in entries:
        parts = entry.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1], parts[2].lstrip("/")
        if controllers == "":
            candidates += [Path("/sys/fs/cgroup", rel, "memory.events"), Path("/sys/fs/cgroup/memory.events")]
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            candidates += [base / rel / "memory.oom_control", base / "memory.oom_control"]
    for path in candidates:
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


async def stop_server(handle: ServerHandle, grace: float = DEFAULT_GRACE) -> ExitReport:
    """TERM to the process group, `grace` seconds, then KILL; returns the exit report."""
    handle.stop_requested = True
    with trio.CancelScope(shield=True, deadline=trio.current_time() + grace + 2 * KILL_WAIT):
        if handle.exit is None:
            await stop_group(handle.group, grace)
            await handle.wait_exit()
    assert handle.exit is not None, "server did not exit after SIGKILL"
    return handle.exit
