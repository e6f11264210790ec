"""A client of the front door, for the CLI: one chat turn sent to the stable address, streamed.

`stoker chat` and `stoker run` talk to the server only through the front door, never to the
engine's own port with its per-launch key: what they show is what every client of the address
gets, and a request sent while the server restarts is held, not failed. Every failure becomes a
reason-coded `StokerError` whose sentence says what to do: a 401 names `stoker key create`, a
503 carries the front door's own reason (the server is down, the hold timed out, the queue is
full) and its Retry-After, a stream cut midway says so.

Blocking (httpx's sync client), like the control socket's client: the CLI has no event loop.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs
import httpx

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

API_KEY_ENV = "STOKER_API_KEY"


@attrs.frozen
class ChatAnswer:
    """One answer: its text, how many tokens, how long it took (to the first token, and in all)."""

    content: str
    tokens: int | None
    seconds: float
    first_token_s: float | None
    model: str | None
    url: str

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _error_of(body: bytes) -> tuple[str | None, str | None]:
    """The `code` and `message` of an error body in OpenAI's shape (or the engine's own)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, body.decode(errors="replace")[:500] or None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None, None
    code = error.get("code")
    message = error.get("message")
    return (code if isinstance(code, str) else None), (message if isinstance(message, str) else None)


def _reason(code: str | None) -> ReasonCode | None:
    try:
        return ReasonCode(code) if code else None
    except ValueError:
        return None


def refusal(status: int, body: bytes, *, url: str, key_given: bool, retry_after: str | None = None) -> StokerError:
    """The front door's (or, relayed, the engine's) error answer as a reason-coded error."""
    code, message = _error_of(body)
    evidence: dict[str, Any] = {"url": url, "status": status}
    if retry_after:
        evidence["retry_after_s"] = retry_after
    if status == 401:
        if key_given:
            text = (
                "The front door refused the API key given (--key or $STOKER_API_KEY): it is wrong or revoked. "
                "`stoker key list` shows your keys; `stoker key create` makes a new one."
            )
        else:
            text = (
                "The front door requires an API key ([frontdoor] require_keys = true): create one with "
                "`stoker key create` and pass it with --key or $STOKER_API_KEY."
            )
        return StokerError(ReasonCode.INVALID_API_KEY, text, evidence)
    reason = _reason(code)
    if reason is None:
        reason = ReasonCode.MODEL_NOT_FOUND if status == 404 else ReasonCode.ENGINE_REFUSED_REQUEST
        if code:
            evidence["code"] = code
    return StokerError(reason, message, evidence)


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(field, payload) of each `data:` (or the engine's `error:`) line of an SSE stream."""
    for line in lines:
        field, sep, payload = line.partition(":")
        if sep and field in ("data", "error"):
            yield field, payload.strip()


class FrontDoorClient:
    """Chat turns through the front door at `url` (its /v1 base), with a user key if given."""

    def __init__(self, url: str, key: str | None = None, *, timeout: float = 900.0) -> None:
        self.url = url.rstrip("/")
        self.key = key or None
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        # A held request waits up to [frontdoor] hold_timeout_s before the first byte: the read
        # timeout covers that and the longest pause between two tokens.
        self._http = httpx.Client(
            headers=headers, timeout=httpx.Timeout(connect=5.0, read=timeout, write=60.0, pool=5.0), trust_env=False
        )
        self.timeout = timeout

    def __enter__(self) -> FrontDoorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        model: str = "default",
        max_tokens: int | None = None,
        temperature: float | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> ChatAnswer:
        """Send one chat completion, streamed: `on_text` gets each piece of the answer as it
        arrives; returns the whole answer. Raises a reason-coded StokerError."""
        body: dict[str, Any] = {
            "model": model,
            "messages": list(messages),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        started = time.monotonic()
        try:
            with self._http.stream("POST", f"{self.url}/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise refusal(
                        response.status_code,
                        response.read(),
                        url=self.url,
                        key_given=self.key is not None,
                        retry_after=response.headers.get("retry-after"),
                    )
                return self._read_stream(response, started, on_text)
        except httpx.TransportError as exc:
            raise self._transport_failure(exc) from exc

    def _transport_failure(self, exc: httpx.TransportError) -> StokerError:
        """What a failed exchange means: nothing listens, no answer in time, or the answer was cut."""
        if isinstance(exc, httpx.ConnectError):
            reason, said = (
                ReasonCode.FRONTDOOR_UNAVAILABLE,
                f"Nothing answers at the front door's address {self.url} ({exc}); `stoker status` says whether "
                f"the daemon runs and where its front door listens.",
            )
        elif isinstance(exc, httpx.TimeoutException):
            reason, said = (
                ReasonCode.ENGINE_UNREACHABLE,
                f"No answer through the front door within {self.timeout:g} s; a long answer on a slow machine "
                f"needs a larger --timeout (`stoker status` says what the server is doing).",
            )
        else:
            reason, said = (
                ReasonCode.ENGINE_STREAM_CUT,
                f"The answer was cut midway: the connection to the front door failed ({exc}).",
            )
        return StokerError(reason, said, {"url": self.url})

    def _read_stream(
        self, response: httpx.Response, started: float, on_text: Callable[[str], None] | None
    ) -> ChatAnswer:
        pieces: list[str] = []
        first: float | None = None
        tokens: int | None = None
        counted = 0
        model: str | None = None
        done = False
        # Read to the end of the body, past [DONE]: a client that leaves before the stream's last
        # chunk is counted as gone (access log, /metrics), its answer as cut.
        for field, payload in _sse_events(response.iter_lines()):
            if done or payload == "[DONE]":
                done = True
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if field == "error" or "error" in event:
                error = event if "error" in event else {"error": event}  # the engine's own `error:` event
                raise refusal(200, json.dumps(error).encode(), url=self.url, key_given=self.key is not None)
            model = event.get("model") or model
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                tokens = usage["completion_tokens"]
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if first is None:
                        first = time.monotonic() - started
                    counted += 1
                    pieces.append(text)
                    if on_text is not None:
                        on_text(text)
        return ChatAnswer(
            content="".join(pieces),
            tokens=tokens if tokens is not None else counted,
            seconds=round(time.monotonic() - started, 3),
            first_token_s=None if first is None else round(first, 3),
            model=model,
            url=self.url,
        )
