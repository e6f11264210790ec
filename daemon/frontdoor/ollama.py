"""Ollama's API on a listener of its own (`[ollama]`, 11434 by default): docs/ollama.md.

The tools that speak only Ollama's API (Open WebUI's Ollama connection, Continue, Home Assistant,
n8n, litellm's `ollama_chat/`, the `ollama` Python and JavaScript clients) reach the same models
as the OpenAI routes, through the same `FrontDoor` (daemon/frontdoor/app.py): its key check and
limits, its routing by `model`, its holding and loading on demand, its engine connections and
retries (`FrontDoor.forward`, the one relay path), its metrics and access log. A request is
translated into the engine's OpenAI-compatible one and the engine's answer, SSE event by event,
into Ollama's NDJSON lines as it arrives (daemon/frontdoor/ollama_shapes.py, pure). A request's
`options.num_ctx` larger than its model's server has relaunches that server with the larger
context before it is answered (`OllamaApi._num_ctx`; states/launch/context.py decides).

The catalog routes answer from the daemon: /api/tags lists what /v1/models lists, /api/ps the
models loaded now, /api/show a model's facts from the catalog, /api/pull drives Stoker's own pull
(`PullService`) with its progress as Ollama's progress objects, /api/delete removes a catalog
model. Errors are Ollama's `{"error": "..."}` with the reason code beside it as `code`. Any other
path (the OpenAI routes, which Ollama serves on its port too) goes to the front door's own routes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, AsyncGenerator, Awaitable, Callable, TypeVar

import httpx
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.wire import EngineAnswer
from stoker.daemon.fleet.remote import RemoteModel
from stoker.daemon.frontdoor.app import Answer, FrontDoor, json_answer, keep_alive, refused
from stoker.daemon.frontdoor.relay import Relay, pump
from stoker.daemon.frontdoor.hold import Refused
from stoker.daemon.frontdoor.http11 import Request
from stoker.daemon.frontdoor.limits import LimitExceeded, read_body
from stoker.daemon.frontdoor.ollama_shapes import (
    Answer as Translation,
    BadRequest,
    EventLines,
    chat_request,
    created_at,
    embed_answer,
    embed_request,
    error_code,
    error_line,
    error_message,
    generate_request,
    stream_of,
)
from stoker.daemon.frontdoor.routing import models_page, route, unknown_model
from stoker.daemon.models.pull import PROGRESS_TOPIC
from stoker.daemon.models.spec import parse_spec
from stoker.daemon.fallback.memory import trained_context
from stoker.states.frontdoor.catalog_answers import http_status
from stoker.states.launch import records as LR
from stoker.states.launch.context import context_for, num_ctx_of
from stoker.states.reasons import ReasonCode
from stoker.store.catalog import ModelRecord

log = logging.getLogger("stoker.frontdoor")

# The version /api/version reports: the Ollama API these routes follow (clients such as Open
# WebUI check it for what they may ask).
OLLAMA_API_VERSION = "0.13.0"
NDJSON = (b"content-type", b"application/x-ndjson")
RUNNING = b"Ollama is running"
READY = LR.LaunchState.READY

Handler = Callable[[Request], Awaitable[Answer | None]]
T = TypeVar("T")


def ollama_error(status: int, message: str, code: str | None = None) -> Answer:
    """An error in Ollama's shape, with Stoker's reason code beside it."""
    body: dict[str, Any] = {"error": message}
    if code:
        body["code"] = code
    return json_answer(body, status)


def engine_error(status: int, body: bytes) -> Answer:
    """An error answer in OpenAI's shape (the engine's, the front door's) in Ollama's."""
    return ollama_error(status, error_message(body), error_code(body))


def as_ollama(answer: Answer) -> Answer:
    """One of the front door's own answers (OpenAI's error shape) in Ollama's; its headers kept."""
    if answer.status < 400:
        return answer
    body = json.loads(engine_error(answer.status, answer.body).body)
    return Answer(answer.status, json.dumps(body, separators=(",", ":")).encode(), answer.headers)


def ollama_name(model: Any) -> Any:
    """A name as Ollama's clients may send it: `NAME:latest` is `NAME`."""
    return model.removesuffix(":latest") if isinstance(model, str) and model.endswith(":latest") else model


class OllamaApi:
    """Ollama's routes over one `FrontDoor`."""

    def __init__(self, front: FrontDoor) -> None:
        self.front = front
        self.daemon = front.daemon
        self.routes: dict[str, tuple[tuple[str, ...], Handler]] = {
            "/api/chat": (("POST",), self.chat),
            "/api/generate": (("POST",), self.generate),
            "/api/embed": (("POST",), self.embed),
            "/api/embeddings": (("POST",), self.embeddings),
            "/api/tags": (("GET",), self.tags),
            "/api/ps": (("GET",), self.ps),
            "/api/show": (("POST",), self.show),
            "/api/pull": (("POST",), self.pull),
            "/api/delete": (("DELETE",), self.delete),
            "/api/version": (("GET",), self.version),
        }

    async def handle(self, request: Request) -> None:
        """Route one request (daemon/frontdoor/http11.py calls this for each)."""
        path, method = request.path, request.method
        if path == "/" and method in ("GET", "HEAD"):  # what clients probe before anything else
            body = b"" if method == "HEAD" else RUNNING
            await request.respond(200, [(b"content-type", b"text/plain; charset=utf-8")], body)
            return
        if not path.startswith("/api/"):
            await self.front.handle(request)  # OpenAI's routes, as Ollama serves them on its port too
            return
        found = self.routes.get(path)
        if found is None:
            answer: Answer | None = ollama_error(404, f"No route {path} in Stoker's Ollama API.", None)
        elif method not in found[0]:
            allowed = ", ".join(found[0])
            answer = ollama_error(405, f"{path} takes {allowed}.", None)
            answer = Answer(405, answer.body, (*answer.headers, (b"allow", allowed.encode())))
        elif path != "/api/version" and (denied := self.front.admit(request)) is not None:
            answer = as_ollama(denied)
        else:
            answer = await found[1](request)
        if answer is not None:
            await answer.send_to(request)

    # --- the request's body and model ------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any] | Answer:
        try:
            content = await read_body(request, self.daemon.config.frontdoor)
        except LimitExceeded as exc:
            return ollama_error(exc.status, str(exc), exc.reason.value)
        try:
            body = json.loads(content or b"{}")
        except ValueError as exc:
            return ollama_error(400, f"The request body is not valid JSON: {exc}", "bad_request")
        if not isinstance(body, dict):
            return ollama_error(400, "The request body must be a JSON object.", "bad_request")
        return body

    def _model(self, request: Request, body: dict[str, Any]) -> Any:
        """The member (or remote model) that answers `body`'s model, or the 404 to send."""
        asked = body.get("model", body.get("name"))
        request.model = asked
        member = route(self.daemon.fleet, asked)
        if member is None and ollama_name(asked) != asked:
            member = route(self.daemon.fleet, ollama_name(asked))
        if member is None:
            return ollama_error(404, unknown_model(self.daemon.fleet, asked), ReasonCode.MODEL_NOT_FOUND.value)
        request.instance = member.name
        if (problem := keep_alive(member, body)) is not None:
            return ollama_error(400, problem, "bad_request")
        return member

    async def _asked(
        self, request: Request, translate: Callable[[dict[str, Any]], T]
    ) -> tuple[dict[str, Any], Any, T] | Answer:
        """The request's body, the member (or remote model) that answers it, and the body as
        `translate` makes it for the engine (BadRequest: what it cannot take); or the error to send."""
        body = await self._body(request)
        if isinstance(body, Answer):
            return body
        member = self._model(request, body)
        if isinstance(member, Answer):
            return member
        if (problem := await self._num_ctx(request, member, body)) is not None:
            return problem
        try:
            return body, member, translate(body)
        except BadRequest as exc:
            return ollama_error(400, str(exc), "bad_request")

    async def _num_ctx(self, request: Request, member: Any, body: dict[str, Any]) -> Answer | None:
        """A request's `options.num_ctx` (as `keep_alive` is a request's own, but it needs a
        server): larger than its model's server has, the server is relaunched with it as
        states/launch/context.py decides (the request then held as for any restart); the error
        to send, if any."""
        if isinstance(member, RemoteModel):
            return None
        try:
            num_ctx = num_ctx_of(body.get("options"))
        except ValueError as exc:
            return ollama_error(400, str(exc), "bad_request")
        if num_ctx is None:
            return None
        if member.data.plan is None:
            # Never planned: its file, and the context it was trained on, are known once it is loaded.
            async with request.watching():
                try:
                    await self.front.hold.until_ready(member)
                except Refused as exc:
                    return as_ollama(refused(request.path, exc))
        plan, server = member.data.plan, member.served.config.server
        if plan is None:
            return None
        try:
            trained = await trio.to_thread.run_sync(trained_context, plan.model_path)
        except (OSError, ValueError):  # the file is gone or unreadable: its next plan fails and says so
            trained = None
        ask = context_for(
            num_ctx,
            state=member.state,
            data=member.data,
            ctx_size=server.ctx_size,
            parallel=server.parallel,
            trained=trained,
            loads=member.loads_on_demand,
        )
        if ask.ctx_size is not None:
            log.info("%s: relaunched with -c %d for a request's num_ctx: %s", member.name, ask.ctx_size, ask.evidence)
            member.supervisor.offer(LR.ContextRequested(ask.ctx_size, ask.evidence))
        return None

    # --- generation: the engine through the front door's relay path ------------------------

    async def chat(self, request: Request) -> Answer | None:
        return await self._generate(request, chat=True)

    async def generate(self, request: Request) -> Answer | None:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool) -> Answer | None:
        """/api/chat (`chat`) or /api/generate, translated to the engine's OpenAI routes; an
        empty chat or prompt is Ollama's way to load a model."""
        started = time.perf_counter()
        asked = await self._asked(
            request, lambda body: ("/v1/chat/completions", chat_request(body)) if chat else generate_request(body)
        )
        if isinstance(asked, Answer):
            return asked
        body, member, (path, engine_body) = asked
        loading = not engine_body["messages"] if chat else not (body.get("prompt") or body.get("images"))
        if loading:  # an empty chat or prompt: Ollama's way to load a model
            return await self._load(request, member, body, chat=chat, started=started)
        translation = Translation(chat, str(body.get("model")), started)
        return await self._send(request, member, path, engine_body, translation)

    async def _load(self, request: Request, member: Any, body: dict[str, Any], *, chat: bool, started: float) -> Answer:
        """An empty chat or prompt: the model loaded (held as any request is), answered `done`."""
        if not isinstance(member, RemoteModel):
            async with request.watching():
                try:
                    await self.front.hold.until_ready(member)
                except Refused as exc:
                    return as_ollama(refused(request.path, exc))
        done: dict[str, Any] = {"model": body.get("model"), "created_at": created_at()}
        done |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        done |= {"done": True, "done_reason": "load", "total_duration": int((time.perf_counter() - started) * 1e9)}
        return json_answer(done)

    async def _send(
        self, request: Request, member: Any, path: str, engine_body: dict[str, Any], translation: Translation
    ) -> Answer | None:
        sse = bool(engine_body.get("stream"))
        held_from = time.perf_counter() if not isinstance(member, RemoteModel) and member.state is not READY else None

        async def translated(
            request: Request, response: EngineAnswer, sse: bool, first: bytes, chunks: AsyncGenerator[bytes, None]
        ) -> None:
            if held_from is not None:
                translation.load_s = time.perf_counter() - held_from
            await self._relay(request, response, sse, first, chunks, translation)

        return await self._forward(request, member, path, engine_body, sse, translated)

    async def _forward(
        self, request: Request, member: Any, path: str, engine_body: dict[str, Any], sse: bool, relay_with: Relay
    ) -> Answer | None:
        """POST `engine_body` to the member's engine (or the remote model's endpoint) at `path`, its
        answer relayed by `relay_with`; an answer the front door gives itself, in Ollama's shape."""
        async with request.watching():  # a client that leaves cancels the wait, or closes the engine's answer
            if isinstance(member, RemoteModel):
                answer = await self.front.forward_remote(
                    request, member, engine_body, sse=sse, path=path, relay_with=relay_with
                )
            else:
                content = json.dumps(engine_body, separators=(",", ":")).encode()
                answer = await self.front.forward(
                    request, member, "POST", path, content, sse=sse, relay_with=relay_with
                )
        return None if answer is None else as_ollama(answer)

    async def _relay(
        self,
        request: Request,
        response: EngineAnswer,
        sse: bool,
        first: bytes,
        chunks: AsyncGenerator[bytes, None],
        translation: Translation,
    ) -> None:
        """The engine's answer as Ollama's: one object, or NDJSON lines as its events arrive."""
        if response.status_code != 200 or not sse:
            body = first + b"".join([piece async for piece in chunks])
            if response.status_code != 200:
                await engine_error(response.status_code, body).send_to(request)
                return
            await json_answer(translation.whole(json.loads(body), time.perf_counter())).send_to(request)
            return
        stream = EventLines(translation)
        await request.start(200, [NDJSON], stream.feed(first))
        last = b""
        try:
            if not stream.over and response.pumpable() and request.pumpable():
                # As the OpenAI routes' streams: relayed by the relay loop, each of the engine's
                # reads translated there (a token's event: no trio pass).
                await chunks.aclose()
                last = stream.feed(await pump(request, response, stream.feed))
            else:
                async for piece in chunks:
                    if lines := stream.feed(piece):
                        await request.send(lines)
                    if stream.over:
                        break
        except httpx.TransportError as exc:
            log.warning("the engine's stream was cut midway: %s", exc)
            await request.end(error_line(f"the engine's stream was cut midway ({exc})", "engine_stream_cut"))
            return
        # The `done` line leaves with the body's end: a client that stops at it finds it counted.
        await request.end(last + translation.final_line(time.perf_counter()))

    # --- embeddings ---------------------------------------------------------------------------

    async def embed(self, request: Request) -> Answer | None:
        return await self._embed(request, legacy=False)

    async def embeddings(self, request: Request) -> Answer | None:
        return await self._embed(request, legacy=True)

    async def _embed(self, request: Request, legacy: bool) -> Answer | None:
        started = time.perf_counter()
        asked = await self._asked(request, lambda body: embed_request(body, legacy))
        if isinstance(asked, Answer):
            return asked
        body, member, engine_body = asked
        model = str(body.get("model"))

        async def translated(
            request: Request, response: EngineAnswer, sse: bool, first: bytes, chunks: AsyncGenerator[bytes, None]
        ) -> None:
            whole = first + b"".join([piece async for piece in chunks])
            if response.status_code != 200:
                await engine_error(response.status_code, whole).send_to(request)
                return
            answer = embed_answer(json.loads(whole), model, legacy, time.perf_counter() - started)
            await json_answer(answer).send_to(request)

        return await self._forward(request, member, "/v1/embeddings", engine_body, False, translated)

    # --- the catalog ----------------------------------------------------------------------------

    def _record(self, member: Any) -> ModelRecord | None:
        if isinstance(member, RemoteModel):
            return None
        return next((r for r in self.daemon.pulls.models() if member.serves(r)), None)

    def _entry(self, member: Any) -> dict[str, Any]:
        """One model as /api/tags lists it: the id /v1/models gives it, the catalog's facts."""
        if isinstance(member, RemoteModel):
            name = member.name
            details = {"parent_model": "", "format": "remote", "family": "", "families": None}
            return {
                "name": name,
                "model": name,
                "modified_at": created_at(0),
                "size": 0,
                "digest": "",
                "details": details,
            }
        record = self._record(member)
        path = record.path if record else (member.data.plan.model_path if member.data.plan else member.served.spec)
        try:
            stat = os.stat(path)
            size, modified = stat.st_size, stat.st_mtime
        except OSError:
            size, modified = 0, 0.0
        return _local_entry(member.served.public_id, record, size=size, modified=modified)

    async def tags(self, request: Request) -> Answer:
        """Every model /v1/models lists (configured, loaded or not; remote ones too), by the same
        ids: what that list gains, this one does."""
        fleet, models = self.daemon.fleet, []
        for listed in models_page(fleet)["data"]:
            member = route(fleet, listed["id"])
            entry = self._entry(member) if member is not None else self._catalog_entry(listed["id"])
            models.append(entry | {"name": listed["id"], "model": listed["id"]})
        return json_answer({"models": models})

    def _catalog_entry(self, name: str) -> dict[str, Any]:
        """A listed model no member answers yet: its catalog row's facts, if it has one."""
        return _local_entry(name, self.daemon.pulls.catalog.find(name))

    async def ps(self, request: Request) -> Answer:
        """The models loaded now (their server ready), with where they compute."""
        models = []
        for member in self.daemon.fleet.serving():
            if member.state is not READY:
                continue
            entry = self._entry(member)
            ttl = member.served.idle_ttl_s
            expires = created_at(time.time() + ttl - member.idle_s()) if ttl else "2318-01-01T00:00:00.000000000Z"
            accelerated = member.effective_backend() not in (None, "cpu")
            entry |= {"expires_at": expires, "size_vram": entry["size"] if accelerated else 0}
            # The context one conversation may use, as Ollama's num_ctx counts it: the server's per slot.
            ready = member.supervisor.ready_evidence or {}
            entry["context_length"] = ready.get("slot_n_ctx") or ready.get("n_ctx")
            models.append({k: v for k, v in entry.items() if v is not None})
        return json_answer({"models": models})

    async def show(self, request: Request) -> Answer:
        asked = await self._asked(request, lambda body: None)  # nothing goes to the engine
        if isinstance(asked, Answer):
            return asked
        _, member, _ = asked
        entry = self._entry(member)
        record = self._record(member)
        info: dict[str, Any] = {}
        arch = entry["details"]["family"]
        if arch:
            info["general.architecture"] = arch
        if record and record.parameters:
            info["general.parameter_count"] = record.parameters
        if record and record.context_length and arch:
            info[f"{arch}.context_length"] = record.context_length
        capabilities = ["completion"]
        if record and record.facts.get("vision"):
            capabilities.append("vision")
        return json_answer(
            {
                "modelfile": f"# Served by Stoker\nFROM {entry['name']}\n",
                "parameters": "",
                "template": "",
                "details": entry["details"],
                "model_info": info,
                "capabilities": capabilities,
                "modified_at": entry["modified_at"],
            }
        )

    async def version(self, request: Request) -> Answer:
        return json_answer({"version": OLLAMA_API_VERSION})

    async def delete(self, request: Request) -> Answer:
        """Remove a catalog model (its file too when Stoker downloaded it), as `stoker rm` does."""
        body = await self._body(request)
        if isinstance(body, Answer):
            return body
        name = ollama_name(body.get("model", body.get("name")))
        request.model = name
        if not isinstance(name, str) or not name:
            return ollama_error(400, "`model` names the catalog model to delete.", "bad_request")
        try:
            known = self.daemon.pulls.catalog.find(name) is not None
            await self.daemon.pulls.remove(name if known else _catalog_name(name))
        except StokerError as err:
            return ollama_error(http_status(err.reason), err.message, err.reason.value)
        return Answer(200, b"", ())

    async def pull(self, request: Request) -> Answer | None:
        """Stoker's own pull of `model` (a spec `stoker pull` takes: `hf.co/ORG/REPO:QUANT`, a
        catalog name, ...), its progress streamed as Ollama's progress objects."""
        body = await self._body(request)
        if isinstance(body, Answer):
            return body
        spec = body.get("model", body.get("name"))
        request.model = spec
        if not isinstance(spec, str) or not spec:
            return ollama_error(400, "`model` names what to pull.", "bad_request")
        try:
            name = parse_spec(spec).name
        except StokerError as err:
            return ollama_error(400, err.message, err.reason.value)
        if not stream_of(body):
            try:
                await self.daemon.pulls.pull(spec)
            except StokerError as err:
                return ollama_error(http_status(err.reason), err.message, err.reason.value)
            return json_answer({"status": "success"})
        await request.start(200, [NDJSON], b'{"status":"pulling manifest"}\n')
        send, receive = trio.open_memory_channel[dict[str, Any] | None](64)

        async def run_pull() -> None:
            try:
                record = await self.daemon.pulls.pull(spec)
                await send.send({"status": "verifying sha256 digest", "digest": f"sha256:{record.sha256}"})
                await send.send({"status": "writing manifest"})
                await send.send({"status": "success"})
            except StokerError as err:
                await send.send({"error": err.message, "code": err.reason.value})
            finally:
                await send.send(None)

        async def progress(events: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
            async for event in events:
                if event.get("topic") == PROGRESS_TOPIC and event.get("name") == name:
                    await send.send(
                        {
                            "status": f"pulling {name}",
                            "digest": name,
                            "total": event.get("total"),
                            "completed": event.get("bytes_done"),
                        }
                    )

        async with request.watching():
            with self.daemon.bus.subscribe() as events:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(progress, events)
                    nursery.start_soon(run_pull)
                    async for line in receive:
                        if line is None:
                            break
                        await request.send(json.dumps(line).encode() + b"\n")
                    nursery.cancel_scope.cancel()
        await request.end()
        return None


def _local_entry(name: str, record: ModelRecord | None, *, size: int = 0, modified: float = 0.0) -> dict[str, Any]:
    """A GGUF model as /api/tags lists it: its catalog row's facts where it has one, else the
    file's size and time (`size`, `modified`) and no facts."""
    family = (record.architecture or "") if record else ""
    return {
        "name": name,
        "model": name,
        "modified_at": created_at(record.pulled_at if record and record.pulled_at else modified),
        "size": record.size if record else size,
        "digest": record.sha256 if record else "",
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family] if family else None,
            "parameter_size": parameter_size(record.parameters if record else None),
            "quantization_level": (record.quantization or "") if record else "",
        },
    }


def _catalog_name(name: str) -> str:
    """The catalog's name for what `name` pulled (`hf.co/ORG/REPO:QUANT` is `ORG/REPO:QUANT`)."""
    try:
        return parse_spec(name).name
    except StokerError:
        return name


def parameter_size(count: int | None) -> str:
    """135000000 -> "135M", 7615616512 -> "7.6B", as Ollama writes it."""
    if not count:
        return ""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= div:
            value = count / div
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(count)
