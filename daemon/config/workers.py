"""`[worker]` (this host as an RPC worker, `stoker worker`) and `[[workers]]` (the head's workers).

The engine's RPC (ggml-rpc) has no authentication and no encryption: whoever reaches the port
can allocate memory and run graphs on the worker's devices. So the worker binds 127.0.0.1 by
default, and any other address is refused unless `allow_unauthenticated_rpc = true` says, in
its name, what that bind exposes (`worker_bind_problems`). Documented in docs/scale-out.md.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Mapping

import attrs

from stoker.daemon.config.checks import Invalid, boolean, describe, integer, ip_address, setting

RPC_PORT = 50052  # ggml-rpc-server's own default
_DEVICE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_host = ip_address("an IP address: 127.0.0.1 (this machine only), or a private LAN or tunnel address")


def _devices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and _DEVICE.match(v) for v in value):
        raise Invalid(f'must be a list of engine device names such as ["CUDA0"], got {describe(value)}')
    return tuple(value)


def _backend(value: Any) -> str:
    if not isinstance(value, str) or not re.match(r"^[a-z][a-z0-9_]*$", value):
        raise Invalid(f'must be "auto" or a backend name such as "cpu" or "cuda", got {describe(value)}')
    return value


@attrs.frozen
class WorkerConfig:
    # This host as an RPC worker: `stoker worker` supervises ggml-rpc-server from the bundle of
    # `backend` ("auto": the first installed bundle that carries it, GPUs before the CPU).
    host: str = setting("127.0.0.1", _host)
    port: int = setting(RPC_PORT, integer(1, 65535))
    backend: str = setting("auto", _backend)
    devices: tuple[str, ...] = setting((), _devices)  # -d: empty exposes every accelerator, else the CPU
    threads: int = setting(0, integer(0, 4096))  # -t for the CPU device; 0: the engine's default
    cache: bool = setting(False, boolean)  # -c: a local tensor cache (LLAMA_CACHE/rpc)
    # The engine's RPC has no authentication: a non-loopback host needs this set to true.
    allow_unauthenticated_rpc: bool = setting(False, boolean)

    @property
    def loopback_only(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def worker_bind_problems(worker: WorkerConfig) -> list[str]:
    """A worker other machines can reach must say it knows the RPC is unauthenticated."""
    if worker.loopback_only or worker.allow_unauthenticated_rpc:
        return []
    return [
        f"worker.host: {worker.host} is reachable from other machines and the engine's RPC has no "
        f"authentication (anyone who reaches the port can use this host's devices); set "
        f"allow_unauthenticated_rpc = true in [worker] only on a private network or tunnel, or bind "
        f'host = "127.0.0.1"'
    ]


@attrs.frozen
class WorkerEndpoint:
    """One `[[workers]]` entry: an RPC worker the head may place layers on."""

    address: str  # host:port of its ggml-rpc-server


def _address(value: Any) -> str:
    hint = 'must be "host:port" of a worker\'s RPC server, such as "10.0.0.2:50052"'
    if not isinstance(value, str):
        raise Invalid(f"{hint}, got {describe(value)}")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in value):
        raise Invalid(f"{hint}, got {value!r}")
    return value


def parse_workers(value: Any, problems: list[str]) -> tuple[WorkerEndpoint, ...]:
    """`[[workers]]` as endpoints, in file order; every problem appended to `problems`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        problems.append(
            f'workers: must be an array of tables ([[workers]] address = "host:port"), got {describe(value)}'
        )
        return ()
    endpoints: list[WorkerEndpoint] = []
    for i, table in enumerate(value):
        where = f"workers[{i}]"
        if not isinstance(table, Mapping):
            problems.append(f"{where}: must be a table, got {describe(table)}")
            continue
        unknown = sorted(set(table) - {"address"})
        if unknown:
            problems.append(f"{where}.{unknown[0]}: unknown key (known: address)")
        try:
            address = _address(table.get("address"))
        except Invalid as err:
            problems.append(f"{where}.address: {err}")
            continue
        if any(e.address == address for e in endpoints):
            problems.append(f"{where}.address: {address} is listed twice")
            continue
        endpoints.append(WorkerEndpoint(address))
    return tuple(endpoints)


def workers_to_dict(workers: tuple[WorkerEndpoint, ...]) -> dict[str, dict[str, Any]]:
    """{address: {key: value}}: how config_diff sees the list (a change re-plans the servers)."""
    return {w.address: attrs.asdict(w) for w in workers}
