"""Readiness of a llama-server launch: the facts its log states, and `wait_ready`.

The server answers HTTP before the model is loaded (503 on every route, /health included),
and with `--port 0` it names its port only after the load. So progress and readiness are read
from the log (any new output is progress; `model loaded` then `listening on http://H:P`), and
readiness is confirmed by `/health` 200. Lines and formats: docs/engine-process.md.

This module knows the log and the API, not the process: `wait_ready` reads what
`StartingServer` names, which engine.process's `ServerHandle` provides (process -> ready,
never back).
"""

from __future__ import annotations

import collections
import contextlib
import re
from pathlib import Path
from typing import Any, Protocol

import attrs
import httpx
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.exits import ExitReport
from stoker.states.reasons import ReasonCode

LOG_TAIL_LINES = 400
# Of a serving engine's new lines, the tail keeps at most the last this many bytes' worth (more
# than LOG_TAIL_LINES of its ~100-byte lines): what is older would leave the tail at once anyway.
LOG_TAIL_BYTES = 64 * 1024


@attrs.frozen
class BufferSize:
    kind: str  # "model" | "KV" | "compute" | ...
    device: str  # "CPU", "CUDA0", "CUDA_Host", ...
    mib: float


def on_device(buffer: BufferSize) -> bool:
    """A buffer in a device's memory (CUDA0, Vulkan0, RPC0[host:port]), not the host's (CPU,
    CPU_Mapped, CPU_REPACK, CUDA_Host: pinned host memory)."""
    return not buffer.device.startswith("CPU") and not buffer.device.endswith("_Host")


def device_offload(claimed: tuple[int, int] | None, buffers: list[BufferSize]) -> tuple[int, int] | None:
    """The engine's `offloaded N/M layers to GPU`, believed only where a device holds model weights.

    llama.cpp prints that line whenever it *could* offload: with the RPC backend built in
    (`llama_supports_rpc()`), a CPU-only engine with no `--rpc` says `offloaded 3/3 layers to GPU`
    while every buffer is CPU_Mapped. Without a model buffer on a device nothing is offloaded, and
    the figure is absent (None), as from an engine without any GPU backend.
    """
    if claimed is None or not any(b.kind == "model" and on_device(b) for b in buffers):
        return None
    return claimed


_LISTENING = re.compile(r"listening on (https?)://(\[[^\]]+\]|[^:\s]+):(\d+)")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output|RS) buffer size =\s*([\d.]+) MiB")
# `using device NAME (DESCRIPTION) (ID) - N MiB free`: the description may hold parentheses of
# its own (Vulkan's `llvmpipe (LLVM 15.0.6, 256 bits)`), the id never does.
_DEVICE = re.compile(r"using device (\S+) \((.*)\) \([^()]*\) - \d+ MiB free|using device (\S+) \((.*?)\)")
_DEVICE_FREE = re.compile(r" - (\d+) MiB free$")  # the free VRAM the engine saw on that device as it loaded
_META = re.compile(r"loaded meta data with \d+ key-value pairs and \d+ tensors from (.+?) \(version")
_N_CTX = re.compile(r"llama_context: n_ctx\s+= (\d+)")
# The engine's own line prefix: minutes.seconds.millis.micros since it started, and a level.
_STAMP = re.compile(r"^(\d+)\.(\d\d)\.(\d\d\d)\.(\d\d\d) [A-Z] ")
_MODEL_LOADED = re.compile(r"\bmodel loaded$")
# A word each fact's line holds: a line without any of them is only kept in the tail.
_FACT_WORDS = (
    "listening on",
    "model loaded",
    "layers to GPU",
    " buffer size =",
    "using device ",
    "loaded meta data",
    "llama_context: n_ctx",
)


@attrs.define(eq=False)
class ServerLog:
    """Follows one launch's log file from an offset and keeps the facts the engine states."""

    path: Path
    offset: int
    tail: collections.deque[str] = attrs.field(factory=lambda: collections.deque(maxlen=LOG_TAIL_LINES))
    last_progress: float = 0.0  # trio clock of the last new line
    model_loaded: bool = False
    loaded_at: float | None = None
    listening: tuple[str, int] | None = None
    offloaded: tuple[int, int] | None = None
    devices: list[str] = attrs.field(factory=list)
    device_free_mib: dict[str, int] = attrs.field(factory=dict)  # "CUDA0" -> MiB, from the device lines
    buffers: list[BufferSize] = attrs.field(factory=list)
    model_path: str | None = None
    n_ctx: int | None = None
    evidence: dict[str, str] = attrs.field(factory=dict)  # fact -> the line that stated it
    _partial: bytes = b""

    def poll(self, *, final: bool = False) -> bool:
        """Read what the server wrote since the last poll; True if it wrote anything (progress)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return False
        if not data and not (final and self._partial):
            return False
        self.offset += len(data)
        data = self._partial + data
        # Whole lines only; an unfinished one waits for the next poll (bytes: a UTF-8
        # character split between two reads is decoded whole).
        end = len(data) if final else data.rfind(b"\n") + 1
        self._partial = data[end:]
        if end and self.listening is None:
            self._read_lines(data[:end].decode("utf-8", "replace"))
        elif end:
            self._keep_tail(data[:end])
        self.last_progress = trio.current_time()
        return True

    def _keep_tail(self, data: bytes) -> None:
        """A serving engine's new lines: its facts were all stated before it listened, so only the
        tail is kept. At -lv 4 it writes ~150 lines per request with 64 slots, ~200 KiB between two
        polls of a busy server; reading them all on the daemon's one thread held it ~1.3 ms, a
        wait for every answer the front door was relaying then. Only the last LOG_TAIL_BYTES are
        decoded and split (docs/frontdoor.md, "The time to first token the front door adds")."""
        if len(data) > LOG_TAIL_BYTES:
            data = data[data.index(b"\n", len(data) - LOG_TAIL_BYTES) + 1 :]
            self.tail.clear()  # the lines skipped are newer than those it holds: no gap in it
        self._keep(data.decode("utf-8", "replace").split("\n"))

    def _keep(self, lines: list[str]) -> None:
        lines = lines[-LOG_TAIL_LINES - 1 :]
        if any("\r" in line for line in lines):
            lines = [line.rstrip("\r") for line in lines]
        self.tail.extend(line for line in lines if line)

    def _read_lines(self, text: str) -> None:
        # A loading engine's lines: one decode and one split per read, and the facts' patterns
        # only on a line that holds one of their words (9.6 -> 0.45 µs a line).
        lines = text.split("\n")
        if "\r" in text:
            lines = [line.rstrip("\r") for line in lines]
        self._keep(lines)
        if any(word in text for word in _FACT_WORDS):
            for line in lines:
                if any(word in line for word in _FACT_WORDS):
                    self._parse(line)

    def _parse(self, line: str) -> None:
        if m := _LISTENING.search(line):
            self.listening = (m.group(2).strip("[]"), int(m.group(3)))
            self.evidence["listening"] = line
        elif _MODEL_LOADED.search(line):
            self.model_loaded = True
            self.loaded_at = trio.current_time()
            self.evidence["model_loaded"] = line
        elif m := _OFFLOADED.search(line):
            self.offloaded = (int(m.group(1)), int(m.group(2)))
            self.evidence["offloaded"] = line
        elif m := _BUFFER.search(line):
            self.buffers.append(BufferSize(m.group(2), m.group(1), float(m.group(3))))
        elif m := _DEVICE.search(line):
            name, description = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            self.devices.append(f"{name} ({description})")
            if free := _DEVICE_FREE.search(line):
                self.device_free_mib[name] = int(free.group(1))
            self.evidence.setdefault("device", line)
        elif m := _META.search(line):
            self.model_path = m.group(1)
        elif m := _N_CTX.search(line):
            self.n_ctx = int(m.group(1))


def engine_seconds(line: str) -> float | None:
    """Seconds since the engine started, from its log-line prefix (`0.07.699.316 I ...`)."""
    m = _STAMP.match(line)
    if m is None:
        return None
    minutes, secs, millis, micros = (int(g) for g in m.groups())
    return round(minutes * 60 + secs + millis / 1e3 + micros / 1e6, 6)


@attrs.frozen
class ReadyReport:
    """Evidence that a server is ready, from its log and its own endpoints."""

    pid: int
    host: str
    port: int
    base_url: str
    model_path: str | None
    n_ctx: int | None  # the context the server allocated (all slots)
    slot_n_ctx: int | None  # per slot, from /props
    total_slots: int | None
    offloaded_layers: int | None  # None: no GPU device, the line is absent
    total_layers: int | None
    devices: tuple[str, ...]
    buffers: tuple[BufferSize, ...]
    build_info: str | None
    load_seconds: float  # spawn to reading "model loaded" (our clock)
    engine_load_seconds: float | None  # the engine's own timestamp on "model loaded"
    ready_seconds: float  # spawn to the first /health 200
    log_path: Path
    evidence_lines: dict[str, str]
    device_free_mib: dict[str, int] = attrs.field(factory=dict)  # what the engine saw free per device

    def to_evidence(self) -> dict[str, Any]:
        """A JSON-ready dict for the transition history."""
        out = attrs.asdict(self, recurse=True)
        out["log_path"] = str(self.log_path)
        out["devices"] = list(self.devices)
        out["buffers"] = [attrs.asdict(b) for b in self.buffers]
        return out


class StartingServer(Protocol):
    """What `wait_ready` reads of the server it waits for (engine.process's ServerHandle)."""

    log: ServerLog
    log_path: Path
    api_key: str
    started_clock: float  # trio clock, just after the spawn
    exit: ExitReport | None

    @property
    def pid(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int | None: ...

    @property
    def base_url(self) -> str | None: ...

    async def wait_changed(self) -> None:
        """Block until a new log line arrives or the process ends."""


async def wait_ready(
    handle: StartingServer, *, stall_timeout: float = 60.0, ready_timeout: float = 600.0
) -> ReadyReport:
    """Block until /health is 200 and the log says the model loaded; raise a reason-coded error.

    Any new log line counts as progress; `stall_timeout` seconds without one raise
    `server_stalled`, `ready_timeout` in all raises `server_start_timeout`, an exit raises its
    classified reason. The server is left running either way: stopping it is the caller's call.
    """
    deadline = handle.started_clock + ready_timeout
    async with contextlib.AsyncExitStack() as stack:
        engine: EngineClient | None = None
        while True:
            if handle.exit is not None:
                raise StokerError(handle.exit.reason, evidence=handle.exit.evidence)
            now = trio.current_time()
            if handle.log.model_loaded and handle.base_url:
                if engine is None:  # the URL is known once the log names the port
                    engine = await stack.enter_async_context(EngineClient.open(handle.base_url, handle.api_key))
                if await engine.healthy():
                    return await _ready_report(engine, handle, trio.current_time())
            idle = now - handle.log.last_progress
            if idle > stall_timeout:
                raise StokerError(
                    ReasonCode.SERVER_STALLED,
                    evidence=_wait_evidence(handle, stall_timeout=stall_timeout, idle_seconds=round(idle, 3)),
                )
            if now > deadline:
                raise StokerError(
                    ReasonCode.SERVER_START_TIMEOUT, evidence=_wait_evidence(handle, ready_timeout=ready_timeout)
                )
            wake = min(deadline, handle.log.last_progress + stall_timeout) - now
            if handle.log.model_loaded:
                wake = min(wake, 0.05)  # loaded but /health not yet 200: poll it
            with trio.move_on_after(max(wake, 0.0) + 0.001):
                await handle.wait_changed()


def _wait_evidence(handle: StartingServer, **extra: Any) -> dict[str, Any]:
    tail = list(handle.log.tail)
    return {
        **extra,
        "pid": handle.pid,
        "last_line": tail[-1] if tail else None,
        "log_tail": tail[-20:],
        "log_path": str(handle.log_path),
    }


async def _ready_report(engine: EngineClient, handle: StartingServer, ready_clock: float) -> ReadyReport:
    props: dict[str, Any] = {}
    try:
        resp = await engine.props()
        if resp.status_code == 200:
            props = resp.json()
    except (httpx.HTTPError, ValueError):
        pass
    log = handle.log
    assert handle.port is not None
    offload = device_offload(log.offloaded, log.buffers)
    return ReadyReport(
        pid=handle.pid,
        host=handle.host,
        port=handle.port,
        base_url=handle.base_url or "",
        model_path=props.get("model_path") or log.model_path,
        n_ctx=log.n_ctx,
        slot_n_ctx=(props.get("default_generation_settings") or {}).get("n_ctx"),
        total_slots=props.get("total_slots"),
        offloaded_layers=offload[0] if offload else None,
        total_layers=offload[1] if offload else None,
        devices=tuple(log.devices),
        buffers=tuple(log.buffers),
        build_info=props.get("build_info"),
        load_seconds=round((log.loaded_at or ready_clock) - handle.started_clock, 4),
        engine_load_seconds=engine_seconds(log.evidence.get("model_loaded", "")),
        ready_seconds=round(ready_clock - handle.started_clock, 4),
        log_path=handle.log_path,
        evidence_lines=dict(log.evidence),
        device_free_mib=dict(log.device_free_mib),
    )
