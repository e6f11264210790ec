"""Routing by the request's `model`: which configured model answers it, and what `/v1/models` lists.

A request goes to the model whose NAME it gives; "default" (or no `model` at all) goes to the
default model; any other name a model answers to (its file name or stem, the model as the config
names it, the id its engine's own /v1/models reports) reaches it too (daemon/fleet/member.py,
`Member.names`). A name no model answers to gets 404 listing what is served. `/v1/models` lists
every configured model, loaded or not, in OpenAI's shape, each with a `stoker` object saying its
state, why (its reason code) and its use now (the chat page's model picker reads it: chat_page.py).
A remote model (`[models.NAME] endpoint`, daemon/fleet/remote.py) is routed the same way: by its
NAME, as the default when it is marked so, or by the name its endpoint serves it under.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from stoker.daemon.fleet.member import reason_message
from stoker.daemon.fleet.remote import RemoteModel
from stoker.states.launch import records as LR

if TYPE_CHECKING:
    from stoker.daemon.fleet.fleet import Fleet
    from stoker.daemon.fleet.member import Member


def route(fleet: Fleet, model: Any) -> Member | RemoteModel | None:
    """The member (or remote model) that answers a request whose body says `model` (None: not
    served). A NAME first, local or remote; then the default; then any other name."""
    if model is not None and not isinstance(model, str):
        return None
    remotes = fleet.remotes
    if model is not None:
        exact = next((m for m in fleet.serving() if m.name == model), None) or remotes.get(model)
        if exact is not None:
            return exact
    if model in (None, "default") and (remote := remotes.default()) is not None:
        return remote
    found = fleet.lookup(model)
    return found if found is not None or model is None else remotes.named(model)


def unknown_model(fleet: Fleet, model: Any) -> str:
    """The 404's sentence: the model asked for, and what is served."""
    served = ", ".join([m.served.public_id for m in fleet.serving()] + [r.name for r in fleet.remotes.serving()])
    return f"The model {model!r} does not exist here; this server serves {served}."


def model_entry(member: Member, created: int) -> dict[str, Any]:
    """One model as OpenAI lists it, with what only Stoker knows under `stoker`."""
    plan = member.data.plan
    state = member.state
    return {
        "id": member.served.public_id,
        "object": "model",
        "created": created,
        "owned_by": "stoker",
        "stoker": {
            "name": member.name,
            "state": state.value,
            "loaded": state is LR.LaunchState.READY,
            "loads_on_demand": member.loads_on_demand,
            "default": member.served.default,
            "pinned": member.served.pinned,
            "model": member.served.spec,
            "path": plan.model_path if plan is not None else None,
            "backend": member.effective_backend() if state is LR.LaunchState.READY else None,
            "aliases": sorted(member.names() - {member.served.public_id}),
            # Why it is where it is, and its use now: what `stoker status` says of it (the chat page shows it).
            "reason": str(member.data.reason) if member.data.reason else None,
            "message": reason_message(member.data),
            "down_cause": str(member.data.down_cause) if member.data.down_cause else None,
            "in_flight": member.usage.in_flight,
            "waiting": member.usage.waiting,
            "idle_s": round(member.idle_s(), 1) if state is LR.LaunchState.READY else None,
        },
    }


def remote_entry(remote: RemoteModel, created: int) -> dict[str, Any]:
    """A remote model as OpenAI lists it: served by its endpoint, whose last reading says if it answers."""
    status = remote.status()
    return {
        "id": remote.name,
        "object": "model",
        "created": created,
        "owned_by": "stoker",
        "stoker": {
            "name": remote.name,
            "remote": True,
            "endpoint": status.endpoint,
            "remote_model": status.remote_model,
            "reachable": status.reachable,
            "reason": status.reason,
            "default": status.default,
            "backend": status.backend,
            "accelerated": status.accelerated,
            "aliases": sorted(remote.names() - {remote.name}),
        },
    }


def models_page(fleet: Fleet, started_at: float | None = None) -> dict[str, Any]:
    """GET /v1/models: every configured model, loaded or not, then the remote ones."""
    created = int(started_at if started_at is not None else time.time())
    data = [model_entry(m, created) for m in fleet.serving()]
    return {"object": "list", "data": data + [remote_entry(r, created) for r in fleet.remotes.serving()]}


def model_entry_of(fleet: Fleet, name: str, started_at: float | None = None) -> dict[str, Any] | None:
    """GET /v1/models/{id}: the entry of the model `name` reaches (any name it answers to, or
    "default"), as the list shows it; None when no model answers to it."""
    created = int(started_at if started_at is not None else time.time())
    found = route(fleet, name)
    if found is None:
        return None
    return remote_entry(found, created) if isinstance(found, RemoteModel) else model_entry(found, created)


def model_health(found: Member | RemoteModel) -> dict[str, Any]:
    """One model in /health: its state and whether a request would be answered without waiting."""
    if isinstance(found, RemoteModel):
        reachable = found.status().reachable
        return {"name": found.name, "state": "remote", "ready": reachable is True, "remote": True}
    state = found.state
    return {
        "name": found.name,
        "state": state.value,
        "ready": state is LR.LaunchState.READY,
        "loads_on_demand": found.loads_on_demand,
        "default": found.served.default,
    }


def health_page(fleet: Fleet, model: str | None) -> dict[str, Any] | None:
    """The front door's /health, for a caller that passed the key check: every model (`model`
    None), or the one `model` names (`status` "ok" only when it is ready); None when no model
    answers to that name."""
    if model is None:
        members: list[Member | RemoteModel] = [*fleet.serving(), *fleet.remotes.serving()]
        return {"status": "ok", "models": [model_health(m) for m in members]}
    found = route(fleet, model)
    if found is None:
        return None
    entry = model_health(found)
    return {"status": "ok" if entry["ready"] else "not_ready", "model": entry}
