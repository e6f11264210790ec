"""The httpx client for the engine on loopback, and the process's one verifying TLS context
(downloads read through http.client: daemon/core/download.py)."""

from __future__ import annotations

import functools
import ssl
from typing import Any

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
