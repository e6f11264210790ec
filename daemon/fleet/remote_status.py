"""A remote model as `status` shows it (`remotes[]`): a record of its own, so that the clients
that read the status reply (the CLI, the TUI) do not import the remote models' HTTP side."""

# No `from __future__ import annotations`: the field types are real types when the class is made,
# so the converter need not compile every annotation from its string at its first `status` (~25 ms
# of each `stoker status` and `stoker ps`).

from typing import Any

import attrs


@attrs.frozen
class RemoteStatus:
    """One remote model in `stoker status` (`remotes[]`)."""

    name: str
    endpoint: str
    remote_model: str  # the `model` the endpoint is sent
    default: bool
    api_key_env: str | None  # the variable's name, never its value
    key_set: bool | None  # whether the daemon's environment has it (None: no key configured)
    reachable: bool | None  # by the latest of the two readings (None: not checked yet)
    reason: str | None
    message: str | None
    check: dict[str, Any] | None  # the last reachability check (GET <endpoint>/models)
    last_request: dict[str, Any] | None  # the last request forwarded to it
    in_flight: int
    check_interval_s: float
    backend: str = "remote"
    # Stoker runs nothing for it, so it cannot prove where the endpoint computes: never claimed.
    accelerated: str = "unknown"
