"""The socket methods: one explicit map from a method's name to its declaration and handler.

A new method is written in the handler module of its concern (`@method(...)` declares it and
registers nothing) and listed here; that is the whole of adding one. `subscribe` is not in the
map: the control server answers it itself, because it turns the connection into an event stream.
docs/protocol-methods.md is generated from this map (python docs/protocol_methods.py).
"""

from __future__ import annotations

from typing import Any, Mapping

from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.handlers import backends, engine, keys, models, snapshots, telemetry
from stoker.daemon.control.handlers import lifecycle
from stoker.daemon.control.params import Method
from stoker.daemon.control.protocol import SUBSCRIBE
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode


def _by_name(*methods: Method) -> dict[str, Method]:
    table: dict[str, Method] = {}
    for declared in methods:
        if declared.name in table or declared.name == SUBSCRIBE:
            raise ValueError(f"the socket method {declared.name!r} is declared twice")
        table[declared.name] = declared
    return table


METHODS: Mapping[str, Method] = _by_name(
    lifecycle.status,
    lifecycle.status_text,
    lifecycle.up,
    lifecycle.down,
    lifecycle.restart,
    lifecycle.shutdown,
    lifecycle.history,
    lifecycle.ping,
    backends.probe,
    backends.use,
    backends.install,
    backends.bundle_install,
    engine.engine_update,
    engine.engine_rollback,
    engine.engine_status,
    snapshots.snapshot_list,
    snapshots.snapshot_save,
    snapshots.snapshot_restore,
    snapshots.snapshot_rm,
    telemetry.telemetry,
    keys.key_create,
    keys.key_list,
    keys.key_revoke,
    keys.key_require,
    models.pull,
    models.model_list,
    models.model_rm,
)


async def dispatch(daemon: ControlledDaemon, name: str, params: Mapping[str, Any]) -> Any:
    """Run the method `name` on `params`: unknown_method, bad_request, or the handler's reply."""
    declared = METHODS.get(name)
    if declared is None:
        raise StokerError(
            ReasonCode.UNKNOWN_METHOD,
            f"Unknown method {name!r}; the daemon knows {', '.join(sorted([*METHODS, SUBSCRIBE]))}.",
            {"known": sorted(METHODS)},
        )
    return await declared(daemon, params)
