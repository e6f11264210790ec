"""The front door's HTTP API: OpenAI's routes and Anthropic's /v1/messages, relayed as they arrive.

Each request is checked (JSON object, a `model` a configured model answers to: routing.py), held
until that model's server is ready, loaded on demand if it is not (daemon/frontdoor/hold.py),
then sent to its engine with its per-launch key; the engine's
answer is relayed chunk by chunk as it arrives (SSE included), never buffered. A request whose
engine is lost before the first byte of its answer is sent again to the next ready server, as
states/frontdoor/policy.py decides (each time, when the request cannot have caused the loss).
Errors use the called API's shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
or Anthropic's `{"type": "error", "error": {"type", "message"}}` on /v1/messages.

The HTTP server under these routes is daemon/frontdoor/http11.py (trio sockets, h11 parsing requests); the
engine is reached through `EngineClient.forward` over daemon/engine/wire.py. Both are lean on
purpose: each SSE event is one read from the engine and one write to the client.

A remote model (`[models.NAME] endpoint`, daemon/fleet/remote.py) is forwarded to its endpoint the
same way, with the key from the daemon's environment and `model` rewritten to the name the
endpoint serves; nothing is held (no server of Stoker's loads), and a failure is answered as
states/frontdoor/remote_endpoint.py judges it (503 or 502 with a reason code, never the endpoint's 401).
"""

from __future__ import annotations

import contextlib
import json
from urllib.parse import parse_qs, unquote
import logging
import time
from functools import partial
from typing import Any

import attrs
import httpx
import trio

from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.wire import EngineAnswer, EngineWire
from stoker.daemon.fleet.member import Member
from stoker.daemon.fleet.remote import RemoteModel, contact_of, endpoint_error_message
from stoker.daemon.frontdoor.chat_page import chat_page
from stoker.daemon.frontdoor.hold import Hold, Refused
from stoker.daemon.frontdoor.http11 import Request
from stoker.daemon.frontdoor.limits import LimitExceeded, check_head, read_body
from stoker.daemon.frontdoor.metrics import CONTENT_TYPE, FrontDoorMetrics
from stoker.daemon.frontdoor.ollama_shapes import OLLAMA_GENERATING, OLLAMA_ROUTES
from stoker.daemon.frontdoor.relay import Relay, first_bytes, relay
from stoker.daemon.frontdoor.rename import ModelRename
from stoker.daemon.frontdoor.cors import Origin, answer_headers, is_preflight, judge_origin, preflight_headers
from stoker.daemon.frontdoor.routes import (
    LABELS,
    WITH_FIGURES,
    Action,
    Route,
    allowed_methods,
    find_route,
    is_anthropic,
)
from stoker.daemon.frontdoor.routing import health_page, model_entry_of, models_page, route, unknown_model
from stoker.daemon.frontdoor.daemon_view import Authorize, FrontDoorDaemon
from stoker.states.reasons import ReasonCode, message_for
from stoker.states.fleet.idle_unload import keep_alive_seconds
from stoker.states.frontdoor.policy import READY, innocent, send_again
from stoker.states.frontdoor.remote_endpoint import Contact, Verdict, judge

log = logging.getLogger("stoker.frontdoor")

REMOTE_HEADERS = {"Content-Type": "application/json"}
JSON = (b"content-type", b"application/json")
# How much of a remote endpoint's refusal (its 401) is read for its words.
REFUSAL_BYTES = 16 * 1024


@attrs.frozen
class Answer:
    """A whole answer the front door gives itself (an error, the model list, /metrics)."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = (JSON,)

    async def send_to(self, request: Request) -> None:
        """Send this answer, whole, as the request's response."""
        await request.respond(self.status, list(self.headers), self.body)


def json_answer(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Answer:
    """JSON as Starlette's JSONResponse wrote it (compact, UTF-8)."""
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    extra = tuple((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items())
    return Answer(status, body, (JSON, *extra))


# Anthropic's error `type` for each status the front door answers itself.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    431: "invalid_request_error",
}


def api_error(
    path: str, status: int, message: str, kind: str, code: str | None, headers: dict[str, str] | None = None
) -> Answer:
    """An error in the shape of the API the client called: OpenAI's, or Anthropic's on /v1/messages
    and /v1/messages/count_tokens (which carries the reason code too, as `code`)."""
    if is_anthropic(path):
        kind = ANTHROPIC_TYPES.get(status, "overloaded_error" if status == 503 else "api_error")
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message, "code": code}}
    else:
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json_answer(body, status, headers)


def refused(path: str, exc: Refused) -> Answer:
    return api_error(
        path, 503, str(exc), "server_error", exc.reason.value, headers={"Retry-After": str(exc.retry_after_s)}
    )


def over_limit(path: str, exc: LimitExceeded) -> Answer:
    # The rest of the request is not read: the connection cannot carry another one.
    return api_error(path, exc.status, str(exc), "invalid_request_error", exc.reason.value, {"Connection": "close"})


def query_model(request: Request) -> str | None:
    """The `model` of a GET's query (`/props?model=chat`); None: the default model."""
    query = request.target.partition(b"?")[2].decode("latin-1")
    values = parse_qs(query).get("model")
    return values[0] if values else None


def presented_key(request: Request) -> str | None:
    auth = (request.header(b"authorization") or b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return (request.header(b"x-api-key") or b"").decode("latin-1") or None


def keep_alive(member: Member | RemoteModel, body: dict[str, Any]) -> str | None:
    """A request's own `keep_alive` (as Ollama's clients send it) becomes how long its model stays
    loaded once idle, over `[models.NAME] idle_ttl_s`; what is wrong with it, if anything."""
    if "keep_alive" not in body or isinstance(member, RemoteModel):
        return None
    try:
        member.usage.keep_alive_s = keep_alive_seconds(body["keep_alive"])
    except ValueError as exc:
        return str(exc)
    member.usage.on_change()  # the idle unload looks again
    return None


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
        self.metrics = FrontDoorMetrics(
            daemon, self.hold, (*LABELS, *OLLAMA_ROUTES), (*WITH_FIGURES, *OLLAMA_GENERATING)
        )

    async def handle(self, request: Request) -> None:
        """Route one request (daemon/frontdoor/http11.py calls this for each) by the table of
        daemon/frontdoor/routes.py; a web page's origin is judged first (daemon/frontdoor/cors.py)."""
        answer = self.cors(request)
        if answer is None:
            answer = await self.route(request)
        if answer is not None:
            await answer.send_to(request)

    def admit(self, request: Request) -> Answer | None:
        """The limits on the request's head and its key checked: None, or the refusal to send."""
        return self._unauthorized(request)

    def cors(self, request: Request) -> Answer | None:
        """A request from a web page: refused when its origin may not call, answered when it is a
        preflight; else the Access-Control-* headers its answer will carry, and None."""
        origin, path = request.header(b"origin"), request.path
        settings = self.daemon.config.frontdoor
        keyless = request.loopback and not settings.require_keys
        verdict = judge_origin(settings.cors_origins, origin, request.header(b"host"), keyless=keyless)
        if verdict is Origin.REFUSED:
            shown = (origin or b"").decode("latin-1")[:200]
            message = (
                f"Web pages on {shown} may not call this server: [frontdoor] cors_origins does not list that origin."
            )
            return api_error(path, 403, message, "invalid_request_error", ReasonCode.FRONTDOOR_ORIGIN_REFUSED.value)
        request.added_headers = answer_headers(verdict, origin)
        if request.method != "OPTIONS":
            return None
        methods = allowed_methods(find_route(path))
        if is_preflight(request.method, origin, request.header(b"access-control-request-method")):
            private = request.header(b"access-control-request-private-network") == b"true"
            asked = request.header(b"access-control-request-headers")
            request.added_headers += preflight_headers(methods, asked, private and verdict is not Origin.SAME)
            request.added_headers.append((b"vary", b"Access-Control-Request-Method, Access-Control-Request-Headers"))
        return Answer(204, b"", ((b"allow", methods.encode("latin-1")),))

    async def route(self, request: Request) -> Answer | None:
        path, method = request.path, request.method
        found = find_route(path)
        if found is None:
            return api_error(path, 404, f"No route {path} here.", "invalid_request_error", None)
        action = found.methods.get(method)
        if action is None:
            allowed = allowed_methods(found)
            message = f"{found.label} takes {allowed.removesuffix(', OPTIONS')}."
            return api_error(path, 405, message, "invalid_request_error", None, {"Allow": allowed})
        if action is Action.FORWARD:
            return await self.post(request, found)
        if action is Action.FORWARD_QUERY:
            return await self.get_forwarded(request, found)
        if action is Action.MODELS:
            return self.models(request)
        if action is Action.MODEL:
            return self.model(request)
        if action is Action.HEALTH:
            return self.health(request)
        if action is Action.METRICS:
            return await self.metrics_page(request)
        if action is Action.PAGE:
            page = chat_page()  # static, no secret in it: served without a key (chat_page.py)
            return Answer(200, page.body, page.headers)
        return self.refused_route(request, found)

    def refused_route(self, request: Request, found: Route) -> Answer:
        """A route that would break a guarantee: 403 with why, in the API's shape (after the key
        check, so a client without a key learns nothing of the engine)."""
        denied = self._unauthorized(request)
        message = f"{request.method} {request.path} is not served through the front door. {found.why}"
        return denied or api_error(
            request.path, 403, message, "invalid_request_error", ReasonCode.FRONTDOOR_ROUTE_REFUSED.value
        )

    def _unauthorized(self, request: Request) -> Answer | None:
        try:
            check_head(request, self.daemon.config.frontdoor)
        except LimitExceeded as exc:
            return over_limit(request.path, exc)
        request.caller = self.authorize(presented_key(request), request.loopback)
        if request.caller is not None:
            return None
        return api_error(request.path, 401, "A valid API key is required.", "invalid_request_error", "invalid_api_key")

    async def metrics_page(self, request: Request) -> Answer:
        """Prometheus' text format (docs/frontdoor.md, "Metrics"); the same access rule as the API."""
        denied = self._unauthorized(request)
        return denied or Answer(200, await self.metrics.scrape(), ((b"content-type", CONTENT_TYPE.encode()),))

    def models(self, request: Request) -> Answer:
        # Every configured model, loaded or not (daemon/frontdoor/routing.py), not one engine's list.
        return self._unauthorized(request) or json_answer(models_page(self.daemon.fleet))

    def model(self, request: Request) -> Answer:
        """GET /v1/models/{id}: one model as the list shows it, by any name it answers to."""
        if (denied := self._unauthorized(request)) is not None:
            return denied
        request.model = name = unquote(request.path.removeprefix("/v1/models/"))
        entry = model_entry_of(self.daemon.fleet, name)
        if entry is None:
            return api_error(
                request.path, 404, unknown_model(self.daemon.fleet, name), "invalid_request_error", "model_not_found"
            )
        return json_answer(entry)

    def health(self, request: Request) -> Answer:
        """The front door's own /health: `{"status": "ok"}` to anyone (it serves); with a key (or
        from loopback without keys required), each model's state and whether it is ready; with
        `?model=`, that model's, 503 while it is not ready."""
        try:
            check_head(request, self.daemon.config.frontdoor)
        except LimitExceeded as exc:
            return over_limit(request.path, exc)
        request.caller = self.authorize(presented_key(request), request.loopback)
        if request.caller is None:
            return json_answer({"status": "ok"})
        asked = query_model(request)
        page = health_page(self.daemon.fleet, asked)
        if page is None:
            return api_error(
                request.path, 404, unknown_model(self.daemon.fleet, asked), "invalid_request_error", "model_not_found"
            )
        request.model = asked
        return json_answer(page, 200 if page["status"] == "ok" else 503)

    async def post(self, request: Request, found: Route) -> Answer | None:
        """Check and forward one API request with its JSON body; None once the answer was given (relayed)."""
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            content = await read_body(request, self.daemon.config.frontdoor)
        except LimitExceeded as exc:
            return over_limit(request.path, exc)
        try:
            body = json.loads(content)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested past the stack
            return api_error(
                request.path, 400, f"The request body is not valid JSON: {exc}", "invalid_request_error", None
            )
        if not isinstance(body, dict):
            return api_error(
                request.path, 400, "The request body must be a JSON object.", "invalid_request_error", None
            )
        request.model = model = body.get("model")
        member = route(self.daemon.fleet, model)  # which model answers it
        if member is None:
            return api_error(
                request.path, 404, unknown_model(self.daemon.fleet, model), "invalid_request_error", "model_not_found"
            )
        request.instance = member.name
        if isinstance(member, RemoteModel) and not found.remote:
            return self.not_remote(request, member)
        if (problem := keep_alive(member, body)) is not None:
            return api_error(request.path, 400, problem, "invalid_request_error", None)
        async with request.watching():  # a client that leaves cancels the wait, or closes the engine's answer
            if isinstance(member, RemoteModel):
                return await self.forward_remote(request, member, body, sse=bool(body.get("stream")))
            sse = bool(body.get("stream"))
            rename = ModelRename.of(member.served.engine_alias, model, sse)
            return await self.forward(request, member, "POST", request.path, content, sse=sse, rename=rename)

    async def get_forwarded(self, request: Request, found: Route) -> Answer | None:
        """A GET the engine answers (GET /props): `?model=` picks the model, else the default."""
        if (denied := self._unauthorized(request)) is not None:
            return denied
        request.model = model = query_model(request)
        member = route(self.daemon.fleet, model)
        if member is None:
            return api_error(
                request.path, 404, unknown_model(self.daemon.fleet, model), "invalid_request_error", "model_not_found"
            )
        request.instance = member.name
        if isinstance(member, RemoteModel):
            return self.not_remote(request, member)
        async with request.watching():
            return await self.forward(request, member, "GET", request.path, None, sse=False)

    def not_remote(self, request: Request, remote: RemoteModel) -> Answer:
        message = (
            f"{request.path} is a llama-server route, served for local models only; {remote.name} is served by "
            f"{remote.config.endpoint}, reached through the OpenAI-compatible routes."
        )
        return api_error(request.path, 400, message, "invalid_request_error", ReasonCode.REMOTE_ROUTE_UNSUPPORTED.value)

    async def forward_remote(
        self,
        request: Request,
        remote: RemoteModel,
        body: dict[str, Any],
        *,
        sse: bool,
        path: str | None = None,
        relay_with: Relay = relay,
    ) -> Answer | None:
        """Send a remote model's request to its endpoint (at `path`, the request's own by default)
        and relay the answer as it arrives; sent once (the endpoint is a cluster of its own:
        Stoker holds nothing for it)."""
        path, config = path or request.path, remote.config
        if remote.key_missing:
            detail = f"${config.api_key_env} is not set in the daemon's environment"
            return self._remote_refused(request, remote, judge(Contact.KEY_MISSING), detail)
        stack = contextlib.AsyncExitStack()
        stack.callback(remote.usage.sent())  # in flight until its answer is over (or failed)
        try:
            engine = EngineClient(config.endpoint, remote.key(), self.http, wire=self.wire)
            response = await stack.enter_async_context(
                engine.forward(
                    "POST", remote.target(path), content=remote.body(body), headers=REMOTE_HEADERS, streamed=sse
                )
            )
            verdict = judge(Contact.ANSWERED, response.status_code)
            if not verdict.relayed:  # its 401: the key Stoker sent, never passed on as the client's
                refusal = b""
                async for piece in response.aiter_raw():
                    refusal += piece
                    if len(refusal) > REFUSAL_BYTES:
                        break
                with trio.CancelScope(shield=True):
                    await stack.aclose()
                return self._remote_refused(
                    request, remote, verdict, endpoint_error_message(refusal), response.status_code
                )
            first, chunks = await first_bytes(response, sse)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await stack.aclose()  # cancelled (the client left): the endpoint's connection closed
            if not isinstance(exc, httpx.TransportError):
                raise
            log.warning(
                "remote model %s: %s did not answer: %s", remote.name, config.endpoint, remote.error_text(str(exc))
            )
            return self._remote_refused(request, remote, judge(contact_of(exc)), remote.error_text(str(exc)))
        remote.last_request = remote.reading(verdict, status=response.status_code)
        try:
            await relay_with(request, response, sse and response.status_code == 200, first, chunks)
        finally:
            with trio.CancelScope(shield=True):
                await stack.aclose()  # the connection pooled, or closed if the answer was cut
        return None

    def _remote_refused(
        self, request: Request, remote: RemoteModel, verdict: Verdict, detail: str, status: int | None = None
    ) -> Answer:
        """The front door's answer in place of the endpoint's, recorded as the model's last request."""
        remote.last_request = remote.reading(verdict, status=status, error=remote.error_text(detail))
        assert verdict.status is not None and verdict.reason is not None
        config = remote.config
        if verdict.reason is ReasonCode.REMOTE_KEY_REJECTED:
            sent = f"the key in ${config.api_key_env}" if config.api_key_env else "no key (api_key_env is not set)"
            message = (
                f"The endpoint of {remote.name} ({config.endpoint}) refused {sent} with HTTP {status}: {detail}. "
                f"The upstream key is wrong, not your front door key."
            )
        else:
            message = f"{remote.name} at {config.endpoint}: {detail}. {message_for(verdict.reason)}"
        retry = {"Retry-After": str(verdict.retry_after_s)} if verdict.retry_after_s is not None else None
        return api_error(
            request.path, verdict.status, remote.masked(message), "server_error", verdict.reason.value, retry
        )

    async def forward(
        self,
        request: Request,
        member: Member,
        method: str,
        path: str,
        content: bytes | None,
        *,
        sse: bool,
        relay_with: Relay = relay,
        rename: ModelRename | None = None,
    ) -> Answer | None:
        """Hold until ready, send, relay. An engine lost before the first byte of its answer:
        sent again to the next ready server when states/frontdoor/policy.py says so."""
        headers = [JSON] if content is not None else []
        sends = suspect = 0
        while True:
            held = member.state is not READY
            try:
                base_url, api_key = await self.hold.until_ready(member)  # loaded first if it is not
            except Refused as exc:
                return refused(path, exc)
            sends += 1
            member.usage.on_drained = partial(self.wire.forget, base_url)  # before its planned stop
            over = self.hold.sent(member)  # in flight until its answer is over (or failed)
            response: EngineAnswer | None = None
            try:
                engine = EngineClient(base_url, api_key, self.http, wire=self.wire)
                response = await engine.send(method, path, content=content, headers=headers, streamed=sse)
                # An answer the engine began and lost before its first bytes is still no answer.
                first, chunks = await first_bytes(response, sse)
                if request.exchange is not None and sends == 1 and not held:  # what the front door added
                    request.exchange.engine_s = time.perf_counter() - response.sent_at
            except BaseException as exc:
                # `EngineAnswer.aclose` cannot be cancelled (it only pools or closes): no shield needed.
                if response is not None:
                    await response.aclose()  # cancelled (the client left): the engine's connection closed, it stops
                over()
                if not isinstance(exc, httpx.TransportError):
                    raise
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
            try:
                if rename is not None:  # the client named the model otherwise than its engine does
                    await relay(request, response, sse and response.status_code == 200, first, chunks, rename)
                else:
                    await relay_with(request, response, sse and response.status_code == 200, first, chunks)
            finally:
                await response.aclose()  # the engine's connection pooled, or closed if the answer was cut
                over()
            return None
