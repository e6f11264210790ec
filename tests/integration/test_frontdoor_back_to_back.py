"""Streamed requests sent back to back through the front door are each answered at once.

llama-server (b11434) closes its connection after every streamed answer while its headers still
say `Keep-Alive`. A front door that puts that connection back in its pool sends the next
request on it; the engine has closed it, the request fails before any answer, and the front
door took that for an engine that died: it waited up to 2 s for the supervisor to notice before
retrying (seen in tests/bench/frontdoor.py: 9 stalls of 2 s in one smoke run).
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.test_frontdoor import start

pytestmark = [pytest.mark.engine]

RETRY_LINE = "the engine was lost before it answered"


def test_back_to_back_streams_never_stall(daemon, model):
    base = start(daemon, model)
    daemon.wait_state("ready")
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    longest = 0.0
    with httpx.Client(base_url=base, trust_env=False, timeout=30) as client:
        for _ in range(80):
            started = time.perf_counter()
            with client.stream("POST", "/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                text = b"".join(reply.iter_raw())
            assert text.rstrip().endswith(b"data: [DONE]"), text[-200:]
            longest = max(longest, time.perf_counter() - started)
    retries = daemon.log_text().count(RETRY_LINE)
    # Each answer takes milliseconds; the stall was the 2 s wait for a crash that never came.
    assert longest < 1.5 and retries == 0, f"longest {longest:.2f} s, {retries} retries"
