"""The HTTP client for bundle downloads: httpx with 1 MiB socket reads.

httpcore reads the socket 64 KiB at a time, and each read is a trip through the event loop
and h11: on loopback that alone halves the throughput (about 190 against 420 MB/s on the
2-core development machine). httpcore's public network-backend hook lets one client read
wider without touching anyone else's.
"""

from __future__ import annotations

import functools
import ssl
import urllib.request
from typing import Any

import httpcore
import httpx
import trio

READ_BYTES = 1024 * 1024


def loopback_client(**kwargs: Any) -> httpx.AsyncClient:
    """A client for the engine on 127.0.0.1: plain HTTP only, so no CA bundle is loaded (an
    httpx client that loads one costs ~40 ms of CPU: half of what the daemon spent on a whole
    `up` -> ready, profiled with py-spy), and no proxy from the environment ever gets a
    loopback request or the per-launch API key."""
    return httpx.AsyncClient(trust_env=False, verify=False, **kwargs)


def download_client() -> httpx.AsyncClient:
    """An httpx client for bundle downloads: 1 MiB socket reads, proxies from the environment.

    httpcore reads the socket 64 KiB at a time, and each read is a trip through the event loop
    and h11: on loopback that alone halves the throughput (about 190 against 420 MB/s on the
    2-core development machine). httpcore's public network-backend hook lets one client read
    wider without touching anyone else's. Behind a proxy (HTTP(S)_PROXY/ALL_PROXY) the stock
    transport is used, since a custom transport turns httpx's environment proxies off.
    """
    timeout = httpx.Timeout(30.0, connect=10.0)
    env = {k.lower() for k, v in urllib.request.getproxies().items() if v and k.lower() != "no"}
    transport = _wide_read_transport() if not env else None
    return httpx.AsyncClient(timeout=timeout, verify=_tls_context(), transport=transport)


class _WideReadStream(httpcore.AsyncNetworkStream):
    """A network stream that reads up to READ_BYTES whatever httpcore asks for."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max(max_bytes, READ_BYTES), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        return _WideReadStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _WideReadBackend(httpcore.AsyncNetworkBackend):
    """httpcore's trio (or anyio) backend, with wide reads."""

    def _inner(self) -> httpcore.AsyncNetworkBackend:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:  # not on trio (asyncio through anyio)
            return httpcore.AnyIOBackend()
        return httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner().connect_tcp(host, port, timeout, local_address, socket_options)
        return _WideReadStream(stream)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        return _WideReadStream(await self._inner().connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner().sleep(seconds)


def _wide_read_transport() -> httpx.AsyncHTTPTransport | None:
    """httpx's own transport over a wide-read connection pool; None if httpx changed shape."""
    transport = httpx.AsyncHTTPTransport(verify=_tls_context())
    if not isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool):
        return None  # a future httpx: fall back to the stock transport (slower, still right)
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=_tls_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_WideReadBackend(),
    )
    return transport


def tls_context() -> ssl.SSLContext:
    """The process's verifying TLS context, made once: httpx's own (the CA bundle it ships with,
    or SSL_CERT_FILE / SSL_CERT_DIR from the environment)."""
    return _tls_context()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process: loading the CA bundle costs ~0.1 s each time."""
    return httpx.create_ssl_context()
