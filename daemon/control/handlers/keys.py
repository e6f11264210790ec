"""Socket methods for the user's API keys: key.create, key.list, key.revoke.

The key itself exists only in key.create's reply: it is stored as its sha256 (store/keys.py),
never logged, and no other method returns it.
"""

from __future__ import annotations

from typing import Any, Mapping

from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.params import Kind, Param, method
from stoker.daemon.control.replies import ApiKey, CreatedApiKey, KeyList
from stoker.states.reasons import ReasonCode


@method(
    "key.create", Param("name", Kind.STRING, "A name to tell the key apart (where it is used)."), result=CreatedApiKey
)
async def key_create(daemon: ControlledDaemon, params: Mapping[str, Any]) -> CreatedApiKey:
    """Make a new API key for the front door; the reply is the only time the key is shown.

    Reply: {id, name, prefix, created_at, last_used_at, revoked, revoked_at, key}.
    """
    return daemon.create_key(params["name"])


@method("key.list", result=KeyList)
async def key_list(daemon: ControlledDaemon, params: Mapping[str, Any]) -> KeyList:
    """Every API key (never the key itself): revoked ones too, marked so.

    Reply: {keys: [{id, name, prefix, created_at, last_used_at, revoked, revoked_at}]}.
    """
    return KeyList(tuple(daemon.list_keys()))


@method(
    "key.revoke",
    Param("id", Kind.STRING, "The key's id or its prefix, as key.list shows them.", required=True),
    errors=(ReasonCode.KEY_NOT_FOUND,),
    result=ApiKey,
)
async def key_revoke(daemon: ControlledDaemon, params: Mapping[str, Any]) -> ApiKey:
    """Revoke a key: requests that present it are refused from now on; its row stays, marked revoked.

    Reply: {id, name, prefix, created_at, last_used_at, revoked, revoked_at}.
    """
    return daemon.revoke_key(params["id"])
