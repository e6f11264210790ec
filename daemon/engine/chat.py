"""One chat completion against the server's OpenAI-compatible endpoint, for the CLI."""

from __future__ import annotations

import functools
import time
from typing import Any

import httpx
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.api import EngineClient
from stoker.states.reasons import ReasonCode


def chat_once(
    endpoint: str, api_key: str, prompt: str, *, max_tokens: int = 64, timeout: float = 300.0
) -> dict[str, Any]:
    """Ask one question; returns {content, tokens, seconds, model}. Blocking (the CLI's)."""
    return trio.run(functools.partial(chat, endpoint, api_key, prompt, max_tokens=max_tokens, timeout=timeout))


async def chat(
    endpoint: str, api_key: str, prompt: str, *, max_tokens: int = 64, timeout: float = 300.0
) -> dict[str, Any]:
    """`chat_once` on trio: greedy, so the same question gets the same answer."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    started = time.monotonic()
    try:
        async with EngineClient.open(endpoint, api_key, timeout=timeout) as engine:
            reply = await engine.chat_completion(body)
    except httpx.HTTPError as err:
        raise StokerError(
            ReasonCode.SERVER_CRASHED, f"The server did not answer: {err}", {"endpoint": endpoint}
        ) from err
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
