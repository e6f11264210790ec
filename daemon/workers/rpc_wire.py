"""The few messages of ggml's RPC protocol Stoker speaks itself, to check a worker before a plan.

ggml-rpc (ggml/src/ggml-rpc/ggml-rpc.cpp) frames a request as `| cmd: u8 | size: u64 | data |`
and an answer as `| size: u64 | data |`, little-endian. A connection must open with HELLO
(cmd 14, fixed forever), whose answer is the server's protocol version (major, minor, patch,
a padding byte) and its transport capabilities (24 bytes; all zero from us: plain TCP, no
RDMA upgrade). After it, DEVICE_COUNT (15) and GET_DEVICE_MEMORY (11, a u32 device index ->
free and total bytes) are what the engine itself asks to size its split: the head reads
exactly what llama-server will read.

The server serves one connection at a time (its accept loop runs each client to the end), so
a worker in use by a llama-server answers nothing until that one lets go: every read here is
under a deadline, and a worker that accepts but stays silent is `busy or hung`, not RPC-less.
"""

from __future__ import annotations

import struct
import time

import attrs
import trio

from stoker.states.fleet.rpc_placement import RemoteDevice, WorkerReading

CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14
CMD_DEVICE_COUNT = 15
CONN_CAPS_SIZE = 24  # ggml-rpc/transport.h RPC_CONN_CAPS_SIZE
HELLO_ANSWER = 4 + CONN_CAPS_SIZE
MAX_DEVICES = 64  # far more than any host has; a larger count is not an RPC server speaking
DEFAULT_TIMEOUT_S = 3.0


class RpcWireError(Exception):
    """The peer is not an RPC server we can talk to (closed early, wrong sizes)."""


@attrs.frozen
class HelloAnswer:
    major: int
    minor: int
    patch: int

    @property
    def version(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (an IPv6 host in brackets) -> (host, port); ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def request(cmd: int, payload: bytes = b"") -> bytes:
    """One framed request."""
    return struct.pack("<BQ", cmd, len(payload)) + payload


async def _read_exactly(stream: trio.SocketStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise RpcWireError(f"the peer closed the connection after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


async def _answer(stream: trio.SocketStream, expected: int) -> bytes:
    (size,) = struct.unpack("<Q", await _read_exactly(stream, 8))
    if size != expected:
        raise RpcWireError(f"an answer of {size} bytes where the protocol has {expected}")
    return await _read_exactly(stream, size)


async def hello(stream: trio.SocketStream) -> HelloAnswer:
    """HELLO: the server's protocol version."""
    await stream.send_all(request(CMD_HELLO, bytes(CONN_CAPS_SIZE)))
    major, minor, patch, _pad = struct.unpack("<BBBB", (await _answer(stream, HELLO_ANSWER))[:4])
    return HelloAnswer(major, minor, patch)


async def device_memory(stream: trio.SocketStream) -> tuple[RemoteDevice, ...]:
    """DEVICE_COUNT, then GET_DEVICE_MEMORY for each device."""
    await stream.send_all(request(CMD_DEVICE_COUNT))
    (count,) = struct.unpack("<I", await _answer(stream, 4))
    if count > MAX_DEVICES:
        raise RpcWireError(f"a device count of {count}")
    devices = []
    for index in range(count):
        await stream.send_all(request(CMD_GET_DEVICE_MEMORY, struct.pack("<I", index)))
        free, total = struct.unpack("<QQ", await _answer(stream, 16))
        devices.append(RemoteDevice(index, free, total))
    return tuple(devices)


async def read_worker(address: str, protocol: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerReading:
    """Check one worker now: connect, HELLO, and (only when it speaks `protocol`, the
    bundle's: another version's messages may differ) its devices' free memory. Never
    raises: what went wrong is the reading's `error`."""
    started = time.monotonic()

    def elapsed() -> float:
        return (time.monotonic() - started) * 1000.0

    try:
        host, port = split_address(address)
    except ValueError as err:
        return WorkerReading(address, False, error=str(err))
    stage = "connect"
    answer: HelloAnswer | None = None
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                stage = "hello"
                answer = await hello(stream)
                if answer.version != protocol:
                    return WorkerReading(address, True, answer.version, (), elapsed_ms=elapsed())
                stage = "device memory"
                devices = await device_memory(stream)
    except trio.TooSlowError:
        why = "busy serving another client, or hung" if stage != "connect" else "no answer"
        return _failed(address, answer, f"{stage}: timed out after {timeout_s:g} s ({why})", elapsed())
    except (OSError, RpcWireError, struct.error) as err:
        return _failed(address, answer, f"{stage}: {err}", elapsed())
    return WorkerReading(address, True, answer.version, devices, elapsed_ms=elapsed())


def _failed(address: str, answer: HelloAnswer | None, error: str, elapsed_ms: float) -> WorkerReading:
    """A reading that failed; a peer that said HELLO with another version is still reachable
    (the version is what matters), one that failed before it is not."""
    if answer is not None:
        return WorkerReading(address, True, answer.version, (), error=error, elapsed_ms=elapsed_ms)
    return WorkerReading(address, False, error=error, elapsed_ms=elapsed_ms)


async def read_workers(
    addresses: tuple[str, ...], protocol: str | None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[WorkerReading, ...]:
    """Every worker checked at once, the readings in config order."""
    readings: dict[str, WorkerReading] = {}

    async def one(address: str) -> None:
        readings[address] = await read_worker(address, protocol, timeout_s)

    async with trio.open_nursery() as nursery:
        for address in addresses:
            nursery.start_soon(one, address)
    return tuple(readings[a] for a in addresses)
