"""The front door's HTTP API: OpenAI's routes and Anthropic's /v1/messages, relayed as they arrive.

Each request is checked (JSON object, a `model` a configured model answers to: routing.py), held
until that model's server is ready, loaded on demand if it is not (daemon/frontdoor/hold.py),
then sent to its engine with its per-launch key; the engine's
answer is relayed chunk by chunk as it arrives (SSE included), never buffered. A request whose
engine is lost before the first byte of its answer is sent again to the next ready server, as
states/frontdoor_policy.py decides (each time, when the request cannot have caused the loss).
Errors use the called API's shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
or Anthropic's `{"type": "error", "error": {"type", "message"}}` on /v1/messages.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
from typing import Any, AsyncIterator

import httpx
import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from daemon.engine.api import EngineClient
from daemon.engine.wire import EngineAnswer, EngineWire
from daemon.fleet.member import Member
from daemon.frontdoor.hold import Hold, Refused
from daemon.frontdoor.limits import LimitExceeded, check_head, read_body
from daemon.frontdoor.metrics import CONTENT_TYPE, FrontDoorMetrics, RequestWatch
from daemon.frontdoor.routing import models_page, route, unknown_model
from daemon.frontdoor.served import Authorize, FrontDoorDaemon
from states.frontdoor_policy import innocent, send_again

log = logging.getLogger("stoker.frontdoor")

# The routes forwarded with their JSON body (OpenAI's, and Anthropic's /v1/messages).
POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages")


# Anthropic's error `type` for each status the front door answers itself.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    431: "invalid_request_error",
}
ANTHROPIC_PATH = "/v1/messages"


def api_error(
    path: str, status: int, message: str, kind: str, code: str | None, headers: dict[str, str] | None = None
) -> Response:
    """An error in the shape of the API the client called: OpenAI's, or Anthropic's on /v1/messages
    (which carries the reason code too, as `code`)."""
    if path == ANTHROPIC_PATH:
        kind = ANTHROPIC_TYPES.get(status, "overloaded_error" if status == 503 else "api_error")
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message, "code": code}}
    else:
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def refused(path: str, exc: Refused) -> Response:
    return api_error(
        path, 503, str(exc), "server_error", exc.reason.value, headers={"Retry-After": str(exc.retry_after_s)}
    )


def over_limit(path: str, exc: LimitExceeded) -> Response:
    # The rest of the request is not read: the connection cannot carry another one.
    return api_error(path, exc.status, str(exc), "invalid_request_error", exc.reason.value, {"Connection": "close"})


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def is_loopback(request: Request) -> bool:
    try:
        return request.client is not None and ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return False


class EngineStream(StreamingResponse):
    """A streaming response that closes the engine's response however the client leaves."""

    def __init__(self, content: AsyncIterator[bytes], closer: contextlib.AsyncExitStack, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._closer = closer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with trio.CancelScope(shield=True):
                await self._closer.aclose()


async def relay(
    response: httpx.Response | EngineAnswer, sse: bool, first: bytes = b"", chunks: AsyncIterator[bytes] | None = None
) -> AsyncIterator[bytes]:
    """The engine's body, chunk by chunk as it arrives (`first`, already read, then the rest of
    `chunks`); a cut SSE stream ends with an error event."""
    try:
        if first:
            yield first
        async for chunk in chunks if chunks is not None else response.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        if not sse:
            raise  # the client's connection is aborted: a truncated JSON body never looks complete
        log.warning("the engine's stream was cut midway: %s", exc)
        error = {"message": f"the engine's stream was cut midway ({exc})", "type": "server_error"}
        yield (
            b"data: " + json.dumps({"error": {**error, "param": None, "code": "engine_stream_cut"}}).encode() + b"\n\n"
        )


class FrontDoor:
    """The routes, bound to the daemon, one shared loopback HTTP client and the key check."""

    def __init__(
        self,
        daemon: FrontDoorDaemon,
        http: httpx.AsyncClient,
        authorize: Authorize,
        hold: Hold | None = None,
        wire: EngineWire | None = None,
    ) -> None:
        self.daemon = daemon
        self.http = http
        self.wire = wire or EngineWire()  # the forward path's engine connections (daemon/engine/wire.py)
        self.authorize = authorize
        self.hold = hold or Hold(daemon)  # the daemon's own, whose drain its supervisor waits for
        self.metrics = FrontDoorMetrics(daemon, self.hold, (*POST_ROUTES, "/v1/models"), POST_ROUTES)

    def app(self) -> Starlette:
        routes = [Route(path, self.post, methods=["POST"]) for path in POST_ROUTES]
        routes.append(Route("/v1/models", self.models, methods=["GET"]))
        routes.append(Route("/metrics", self.metrics_page, methods=["GET"]))
        return Starlette(routes=routes, middleware=[Middleware(RequestWatch, figures=self.metrics.requests)])

    def _unauthorized(self, request: Request) -> Response | None:
        try:
            check_head(request, self.daemon.config.frontdoor)
        except LimitExceeded as exc:
            return over_limit(request.url.path, exc)
        if self.authorize(presented_key(request), is_loopback(request)):
            return None
        return api_error(
            request.url.path, 401, "A valid API key is required.", "invalid_request_error", "invalid_api_key"
        )

    async def metrics_page(self, request: Request) -> Response:
        """Prometheus' text format (docs/frontdoor.md, "Metrics"); the same access rule as the API."""
        denied = self._unauthorized(request)
        return denied or Response(await self.metrics.scrape(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: Request) -> Response:
        # Every configured model, loaded or not (daemon/frontdoor/routing.py), not one engine's list.
        return self._unauthorized(request) or JSONResponse(models_page(self.daemon.fleet))

    async def post(self, request: Request) -> Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            content = await read_body(request, self.daemon.config.frontdoor)
        except LimitExceeded as exc:
            return over_limit(request.url.path, exc)
        try:
            body = json.loads(content)
        except ValueError as exc:
            return api_error(
                request.url.path, 400, f"The request body is not valid JSON: {exc}", "invalid_request_error", None
            )
        if not isinstance(body, dict):
            return api_error(
                request.url.path, 400, "The request body must be a JSON object.", "invalid_request_error", None
            )
        member = route(self.daemon.fleet, model := body.get("model"))  # which model answers it
        if member is None:
            return api_error(
                request.url.path,
                404,
                unknown_model(self.daemon.fleet, model),
                "invalid_request_error",
                "model_not_found",
            )
        return await self.forward(member, "POST", request.url.path, content, sse=bool(body.get("stream")))

    async def forward(self, member: Member, method: str, path: str, content: bytes | None, *, sse: bool) -> Response:
        """Hold until ready, send, relay. An engine lost before the first byte of its answer:
        sent again to the next ready server when states/frontdoor_policy.py says so."""
        headers = {"Content-Type": "application/json"} if content is not None else {}
        sends = suspect = 0
        while True:
            try:
                base_url, api_key = await self.hold.until_ready(member)  # loaded first if it is not
            except Refused as exc:
                return refused(path, exc)
            sends += 1
            stack = contextlib.AsyncExitStack()
            stack.callback(self.hold.sent(member))  # in flight until its answer is over (or failed)
            try:
                engine = EngineClient(base_url, api_key, self.http, wire=self.wire)
                response = await stack.enter_async_context(
                    engine.forward(method, path, content=content, headers=headers, streamed=sse)
                )
                # Nothing reaches the client before the answer's first bytes (a stream's first whole
                # event): an answer the engine began and lost before them is still no answer.
                chunks = response.aiter_raw()
                first = await anext(chunks, b"")
                while sse and first and b"\n\n" not in first and (more := await anext(chunks, b"")):
                    first += more
            except httpx.TransportError as exc:
                await stack.aclose()
                reached = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                loss = await self.hold.notice_loss(member, base_url, reached)
                suspect += not innocent(loss)
                again = send_again(loss, sends, suspect)
                log.warning(
                    "the engine was lost before it answered (send %d; server %s, %s, signal %s): %s; %s",
                    sends,
                    "gone" if loss.gone else "still serving",
                    loss.state.value,
                    loss.signal,
                    exc,
                    "sending it again" if again else "giving up",
                )
                if again:
                    continue
                return api_error(
                    path,
                    502,
                    f"The engine was lost {sends} times before it answered ({exc}).",
                    "server_error",
                    "engine_unreachable",
                )
            kept = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "cache-control")}
            return EngineStream(
                relay(response, sse and response.status_code == 200, first, chunks),
                stack,
                status_code=response.status_code,
                headers=kept,
            )
