"""One chat completion against the server's OpenAI-compatible endpoint."""

from __future__ import annotations

import time
from typing import Any

import httpx

from daemon.core.errors import StokerError
from states.reasons import ReasonCode


def chat_once(endpoint: str, api_key: str, prompt: str, *, max_tokens: int = 64, timeout: float = 300.0) -> dict[str, Any]:
    """Ask one question; returns {content, tokens, seconds, model}."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    started = time.monotonic()
    try:
        reply = httpx.post(
            f"{endpoint}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )
    except httpx.HTTPError as err:
        raise StokerError(ReasonCode.SERVER_CRASHED, f"The server did not answer: {err}", {"endpoint": endpoint}) from err
    if reply.status_code != 200:
        raise StokerError(
            ReasonCode.SERVER_CRASHED,
            f"The server answered {reply.status_code}.",
            {"endpoint": endpoint, "body": reply.text[:500]},
        )
    data = reply.json()
    return {
        "content": data["choices"][0]["message"]["content"],
        "tokens": data.get("usage", {}).get("completion_tokens"),
        "seconds": round(time.monotonic() - started, 3),
        "model": data.get("model"),
    }
