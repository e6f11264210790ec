"""Remote models: `[models.NAME]` sections served by an external OpenAI-compatible endpoint.

A remote model has no server of Stoker's: it is never planned, placed, evicted, unloaded for
idleness or snapshotted, so it is not a `Member` and nothing in the fleet's placement sees it.
What Stoker keeps for it: its config (daemon/config/remote.py), its requests in flight (`Usage`),
and two readings of its endpoint, each judged by states/frontdoor/remote_endpoint.py: the last
reachability check (GET <endpoint>/models with its key, under `CHECK_TIMEOUT_S`, every
`check_interval_s`: its latency, HTTP status and error) and the last request the front door
forwarded to it. `stoker status` (`remotes`), the TUI's Models view and /metrics show them.

The key is read from the daemon's environment (`api_key_env`) at each use, and never kept:
not in a reading, a status, a log line or the store. An endpoint's own words that reach a
reading are cut short and have the key masked, in case an endpoint echoes what it was sent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import attrs
import httpx
import trio

from stoker.daemon.config.model import Config
from stoker.daemon.config.remote import RemoteModelConfig
from stoker.daemon.core.http import loopback_client
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.wire import EngineWire, WireTimeouts
from stoker.daemon.fleet.remote_status import RemoteStatus
from stoker.daemon.fleet.usage import Usage
from stoker.states.reasons import ReasonCode, message_for
from stoker.states.frontdoor.remote_endpoint import Contact, Verdict, judge

log = logging.getLogger(__name__)

# The reachability check's whole budget: connect, send, the answer's head and its (small) body.
CHECK_TIMEOUT_S = 3.0
# How much of an endpoint's error body a reading keeps.
ERROR_CHARS = 300


def contact_of(exc: httpx.TransportError) -> Contact:
    """How far a request got before the wire failed: a connection never made, or lost after."""
    return Contact.NOT_CONNECTED if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)) else Contact.LOST


@attrs.frozen
class Reading:
    """One contact with the endpoint, as judged (the figures of that contact, never the key)."""

    at: float  # Unix time
    reachable: bool | None
    reason: ReasonCode | None
    http_status: int | None = None
    latency_ms: float | None = None  # the check's: from sending to the answer read whole
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "reachable": self.reachable,
            "reason": None if self.reason is None else str(self.reason),
            "message": None if self.reason is None else message_for(self.reason),
            "http_status": self.http_status,
            "latency_ms": self.latency_ms,
            "error": self.error,
        }


@attrs.define(eq=False)
class RemoteModel:
    """One remote model: its section, its use at the front door, its endpoint's readings."""

    config: RemoteModelConfig
    usage: Usage = attrs.field(factory=Usage)
    check: Reading | None = None
    last_request: Reading | None = None
    next_check: float = -math.inf  # trio time of its next check

    @property
    def name(self) -> str:
        return self.config.name

    def names(self) -> frozenset[str]:
        """What a request's `model` may say to reach it: its NAME, the endpoint's model name, and
        "default" when it is the default."""
        names = {self.name, self.config.upstream_model}
        if self.config.default:
            names.add("default")
        return frozenset(names)

    def key(self) -> str | None:
        """The endpoint's key from the daemon's environment now (None: none configured or set)."""
        env = self.config.api_key_env
        return (os.environ.get(env) or None) if env else None

    @property
    def key_missing(self) -> bool:
        """A key is configured and the daemon's environment does not have it."""
        return self.config.api_key_env is not None and self.key() is None

    def target(self, path: str) -> str:
        """The endpoint's path for a front door route: `/v1/chat/completions` under its base."""
        return self.config.base_path + path.removeprefix("/v1")

    def body(self, body: dict[str, Any]) -> bytes:
        """The request's body for the endpoint: `model` is the name the endpoint serves."""
        return json.dumps({**body, "model": self.config.upstream_model}, ensure_ascii=False).encode()

    def error_text(self, text: str) -> str:
        """An endpoint's or the wire's error, fit for a reading: cut short, the key masked."""
        return self.masked(text)[:ERROR_CHARS]

    def masked(self, text: str) -> str:
        """`text` with the key masked, in case an endpoint echoed what it was sent."""
        key = self.key()
        return text.replace(key, "***") if key else text

    def reading(self, verdict: Verdict, *, status: int | None = None, error: str | None = None) -> Reading:
        """A reading of a contact now, by its verdict."""
        return Reading(time.time(), verdict.reachable, verdict.reason, status, None, error)

    def status(self) -> RemoteStatus:
        readings = [r for r in (self.check, self.last_request) if r is not None]
        latest = max(readings, key=lambda r: r.at, default=None)
        env = self.config.api_key_env
        return RemoteStatus(
            name=self.name,
            endpoint=self.config.endpoint,
            remote_model=self.config.upstream_model,
            default=self.config.default,
            api_key_env=env,
            key_set=None if env is None else not self.key_missing,
            reachable=None if latest is None else latest.reachable,
            reason=None if latest is None or latest.reason is None else str(latest.reason),
            message=None if latest is None or latest.reason is None else message_for(latest.reason),
            check=None if self.check is None else self.check.to_json(),
            last_request=None if self.last_request is None else self.last_request.to_json(),
            in_flight=self.usage.in_flight,
            check_interval_s=self.config.check_interval_s,
        )


@attrs.define(eq=False)
class Remotes:
    """The remote models by NAME (config order), and the task that checks their endpoints."""

    models: dict[str, RemoteModel] = attrs.field(factory=dict)
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _http: httpx.AsyncClient | None = None

    def serving(self) -> list[RemoteModel]:
        return list(self.models.values())

    def get(self, name: str | None) -> RemoteModel | None:
        return None if name is None else self.models.get(name)

    def default(self) -> RemoteModel | None:
        """The remote model marked `default = true`, if one is."""
        return next((r for r in self.models.values() if r.config.default), None)

    def named(self, model: str) -> RemoteModel | None:
        """The remote model that answers to `model` by another name than its NAME."""
        return next((r for r in self.models.values() if model in r.names()), None)

    def apply(self, config: Config) -> None:
        """Put the config's remote sections in force: a changed endpoint is checked again at once;
        a model's use survives a change of its section."""
        models = {}
        for section in config.remotes:
            known = self.models.get(section.name)
            if known is None:
                models[section.name] = RemoteModel(section)
                continue
            if known.config != section:
                known.config, known.check, known.last_request = section, None, None
                known.next_check = -math.inf
            models[section.name] = known
        self.models = models
        self._changed.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check each endpoint when due, until cancelled."""
        async with loopback_client(timeout=None) as http:
            self._http = http
            task_status.started()
            while True:
                now = trio.current_time()
                due = [r for r in self.models.values() if r.next_check <= now]
                if due:
                    async with trio.open_nursery() as nursery:
                        for remote in due:
                            nursery.start_soon(self.check, remote)
                next_at = min((r.next_check for r in self.models.values()), default=math.inf)
                with trio.move_on_at(next_at):
                    await self._changed.wait()
                if self._changed.is_set():
                    self._changed = trio.Event()

    async def check(self, remote: RemoteModel) -> Reading:
        """GET <endpoint>/models with its key, within CHECK_TIMEOUT_S: reachable, latency, error."""
        remote.next_check = trio.current_time() + remote.config.check_interval_s
        reading = await self._contact(remote)
        if remote.check is None or reading.reachable != remote.check.reachable:
            log.info(
                "remote model %s: %s %s%s",
                remote.name,
                remote.config.endpoint,
                {True: "reachable", False: "unreachable", None: "not checked"}[reading.reachable],
                f" ({reading.reason}: {reading.error})" if reading.reason else "",
            )
        remote.check = reading
        return reading

    async def _contact(self, remote: RemoteModel) -> Reading:
        if remote.key_missing:
            return remote.reading(judge(Contact.KEY_MISSING), error=f"${remote.config.api_key_env} is not set")
        assert self._http is not None, "the remote checks are not serving"
        wire = EngineWire(WireTimeouts(connect=CHECK_TIMEOUT_S, read=CHECK_TIMEOUT_S, write=CHECK_TIMEOUT_S))
        engine = EngineClient(remote.config.endpoint, remote.key(), self._http, wire=wire)
        started = time.perf_counter()
        connected = False
        try:
            with trio.move_on_after(CHECK_TIMEOUT_S) as scope:
                async with engine.forward("GET", remote.target("/v1/models")) as answer:
                    connected = True
                    body = b"".join([chunk async for chunk in answer.aiter_raw()])
        except httpx.TransportError as exc:
            return remote.reading(judge(contact_of(exc)), error=remote.error_text(str(exc)))
        finally:
            await wire.__aexit__()
        if scope.cancelled_caught:
            contact = Contact.LOST if connected else Contact.NOT_CONNECTED
            return remote.reading(judge(contact), error=f"no answer within {CHECK_TIMEOUT_S:g} s")
        latency = round((time.perf_counter() - started) * 1000, 1)
        verdict = judge(Contact.ANSWERED, answer.status_code)
        error = None
        if not 200 <= answer.status_code < 300:
            error = remote.error_text(
                f"GET {remote.target('/v1/models')} answered {answer.status_code}: " + endpoint_error_message(body)
            )
        return Reading(time.time(), verdict.reachable, verdict.reason, answer.status_code, latency, error)


def endpoint_error_message(body: bytes) -> str:
    """An endpoint's error body in its own words: OpenAI's `error.message`, else the text."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)
    except (ValueError, AttributeError):
        pass
    return body.decode("utf-8", "replace").strip() or "(no body)"
