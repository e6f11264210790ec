"""llama-server's HTTP API: the one client every part of Stoker talks to an engine with.

Readiness (`/health`, `/props`), adoption's proof of the key, KV slots (`/slots` save,
restore, erase), telemetry (`/metrics`), the smoke completion (`/completion`) and a chat
(`/v1/chat/completions`) all go through `EngineClient`: the endpoints' paths and bodies are
written here once, and the per-launch key's `Authorization: Bearer` header is built here and
nowhere else. It sits on `core.http.loopback_client`, so no proxy from the environment ever
sees a request or the key, and no CA bundle is loaded for plain loopback HTTP; the front door's
forward path (`forward`) goes over the leaner `EngineWire` (daemon/engine/wire.py) instead.

Endpoints answer the engine's `httpx.Response`: what a status means is the caller's to say
(a 503 while the model loads, the 401 that proves a key is required, a slot the engine
refused). httpx's per-request `timeout` only guards a silent socket; a caller bounds a whole
operation with a cancel scope. Facts about the endpoints: docs/engine-process.md.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

import attrs
import httpx

from stoker.daemon.core.http import loopback_client
from stoker.daemon.engine.wire import EngineAnswer, EngineWire

# httpx's per-request guard when the caller names none: a loopback engine that says nothing
# for this long is not going to (a caller waiting on a slow slot passes None and a scope).
DEFAULT_TIMEOUT = 5.0


@attrs.define(eq=False)
class EngineClient:
    """One engine's API at `base_url`, authenticated with its per-launch `api_key`."""

    base_url: str
    api_key: str | None
    _http: httpx.AsyncClient
    wire: EngineWire | None = None  # the forward path's connections (the front door's, shared)
    _auth: dict[str, str] = attrs.field(init=False)
    _auth_header: list[tuple[bytes, bytes]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._auth_header = [(b"authorization", f"Bearer {self.api_key}".encode())] if self.api_key else []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, base_url: str, api_key: str | None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> AsyncIterator["EngineClient"]:
        """A client for one engine, its connections closed on leaving the block."""
        async with loopback_client(base_url=base_url, timeout=timeout) as http:
            yield cls(base_url, api_key, http)

    # --- liveness and identity -----------------------------------------------------------

    async def health(self) -> httpx.Response:
        """GET /health: public by design, 503 while the model loads, 200 once it serves."""
        return await self._http.get("/health")

    async def healthy(self) -> bool:
        """True when /health answers 200; a refused or dropped connection is just False."""
        try:
            return (await self.health()).status_code == 200
        except httpx.HTTPError:
            return False

    async def props(self, *, with_key: bool = True) -> httpx.Response:
        """GET /props (slots, context, model path, build). `with_key=False` asks without the
        key: a server that holds the key answers 401, which is how adoption proves it."""
        return await self._http.get("/props", headers=self._auth if with_key else {})

    # --- KV slots ------------------------------------------------------------------------

    async def slots(self) -> httpx.Response:
        """GET /slots: every slot with its id and `n_prompt_tokens`."""
        return await self._http.get("/slots", headers=self._auth)

    async def save_slot(self, slot: int, filename: str) -> httpx.Response:
        """Write slot `slot`'s KV cache to `filename` inside the server's --slot-save-path."""
        return await self._slot_action(slot, "save", {"filename": filename})

    async def restore_slot(self, slot: int, filename: str) -> httpx.Response:
        """Load `filename` (inside --slot-save-path) into slot `slot`."""
        return await self._slot_action(slot, "restore", {"filename": filename})

    async def erase_slot(self, slot: int) -> httpx.Response:
        """Empty slot `slot` (what the engine also does after a refused restore)."""
        return await self._slot_action(slot, "erase", None)

    async def _slot_action(self, slot: int, action: str, body: dict[str, Any] | None) -> httpx.Response:
        return await self._http.post(f"/slots/{slot}", params={"action": action}, json=body, headers=self._auth)

    # --- serving -------------------------------------------------------------------------

    async def metrics(self) -> httpx.Response:
        """GET /metrics, Prometheus text (the server runs with --metrics)."""
        return await self._http.get("/metrics", headers=self._auth)

    async def completion(self, body: dict[str, Any]) -> httpx.Response:
        """POST /completion: the engine's own completion API (token ids in and out)."""
        return await self._http.post("/completion", json=body, headers=self._auth)

    async def chat_completion(self, body: dict[str, Any]) -> httpx.Response:
        """POST /v1/chat/completions: the OpenAI-compatible chat API."""
        return await self._http.post("/v1/chat/completions", json=body, headers=self._auth)

    @contextlib.asynccontextmanager
    async def forward(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        streamed: bool = False,
    ) -> AsyncIterator[EngineAnswer]:
        """Send a client's request on to the engine with the per-launch key, the answer's body
        left unread: the caller streams it (`aiter_raw`) as it arrives, never buffered. The path
        is absolute on `base_url`, so one shared `wire` serves every launch (the front door).

        The forward path is the front door's data path, so it goes over `EngineWire` (its own
        lean HTTP/1.1 on a trio socket: daemon/engine/wire.py) rather than httpx; its failures are httpx's
        exceptions all the same. `streamed`: the client asked for a streamed (SSE) answer.
        llama-server closes its connection after every streamed answer though its headers say
        keep-alive; such a connection kept for the next request would carry it into a closed
        socket, a failure that looks like a dead engine: it goes with `Connection: close`."""
        answer = await self.send(method, path, content=content, headers=headers, streamed=streamed)
        try:
            yield answer
        finally:
            await answer.aclose()

    async def send(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: list[tuple[bytes, bytes]] | dict[str, str] | None = None,
        streamed: bool = False,
    ) -> EngineAnswer:
        """`forward` without its context: the answer, which the caller closes (`aclose`) once
        done with it. The front door's own path (daemon/frontdoor/app.py), which closes it in
        its own `finally` rather than through one more context manager per request. `headers`
        as bytes pairs, lower case, are sent as they are."""
        # Without the front door's shared wire (a one-off caller), nothing is kept for later.
        wire = self.wire if self.wire is not None else EngineWire()
        if isinstance(headers, dict):
            sent = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        else:
            sent = list(headers or ())
        sent += self._auth_header
        return await wire.send(self.base_url, method, path, sent, content, keep=not streamed and wire is self.wire)


def error_message(reply: httpx.Response, limit: int = 300) -> str:
    """The engine's own words for a refused request (`{"error": {"message": ...}}`), else the body."""
    try:
        return str(reply.json().get("error", {}).get("message") or reply.text)[:limit]
    except (ValueError, AttributeError):
        return reply.text[:limit]
