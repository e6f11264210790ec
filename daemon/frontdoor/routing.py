"""Routing by the request's `model`: which configured model answers it, and what `/v1/models` lists.

A request goes to the model whose NAME it gives; "default" (or no `model` at all) goes to the
default model; any other name a model answers to (its file name or stem, the model as the config
names it, the id its engine's own /v1/models reports) reaches it too (daemon/fleet/member.py,
`Member.names`). A name no model answers to gets 404 listing what is served. `/v1/models` lists
every configured model, loaded or not, in OpenAI's shape, each with a `stoker` object saying its
state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from states import launch_records as LR

if TYPE_CHECKING:
    from daemon.fleet.fleet import Fleet
    from daemon.fleet.member import Member


def route(fleet: Fleet, model: Any) -> Member | None:
    """The member that answers a request whose body says `model` (None: not served)."""
    if model is not None and not isinstance(model, str):
        return None
    return fleet.lookup(model)


def unknown_model(fleet: Fleet, model: Any) -> str:
    """The 404's sentence: the model asked for, and what is served."""
    served = ", ".join(m.served.public_id for m in fleet.serving())
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
        },
    }


def models_page(fleet: Fleet, started_at: float | None = None) -> dict[str, Any]:
    """GET /v1/models: every configured model, loaded or not."""
    created = int(started_at if started_at is not None else time.time())
    return {"object": "list", "data": [model_entry(m, created) for m in fleet.serving()]}
