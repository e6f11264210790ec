"""The httpx client for the engine on loopback, the process's one verifying TLS context, and
the http.client connection for a URL through the environment's proxy (downloads read through
it: daemon/core/download.py)."""

from __future__ import annotations

import base64
import functools
import http.client
import ssl
import urllib.request
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx


def loopback_client(**kwargs: Any) -> httpx.AsyncClient:
    """A client for the engine on 127.0.0.1: plain HTTP only, so no CA bundle is loaded (an
    httpx client that loads one costs ~40 ms of CPU: half of what the daemon spent on a whole
    `up` -> ready, profiled with py-spy), and no proxy from the environment ever gets a
    loopback request or the per-launch API key."""
    return httpx.AsyncClient(trust_env=False, verify=False, **kwargs)


def tls_context() -> ssl.SSLContext:
    """The process's verifying TLS context, made once: httpx's own (the CA bundle it ships with,
    or SSL_CERT_FILE / SSL_CERT_DIR from the environment)."""
    return _tls_context()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process: loading the CA bundle costs ~0.1 s each time."""
    return httpx.create_ssl_context()


def proxy_for(url: str) -> str | None:
    """The environment's proxy for `url`, None where NO_PROXY exempts it or none is set."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def open_connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """A connection for `url` (through the environment's proxy where one applies), the request
    target to send and the headers the proxy needs."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise http.client.InvalidURL(f"not an http(s) URL: {url}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    proxy = proxy_for(url)
    if proxy is None:
        if parts.scheme == "https":
            return (
                http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout, context=tls_context()),
                target,
                {},
            )
        return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout), target, {}
    via = urlsplit(proxy)
    auth = {}
    if via.username:
        secret = f"{unquote(via.username)}:{unquote(via.password or '')}".encode()
        auth["Proxy-Authorization"] = "Basic " + base64.b64encode(secret).decode()
    if parts.scheme == "https":  # a CONNECT tunnel: the proxy sees only the host
        conn = http.client.HTTPSConnection(via.hostname or "", via.port or 80, timeout=timeout, context=tls_context())
        conn.set_tunnel(parts.hostname or "", parts.port or 443, headers=auth)
        return conn, target, {}
    return http.client.HTTPConnection(via.hostname or "", via.port or 80, timeout=timeout), url, auth
