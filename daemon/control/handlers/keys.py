"""Socket methods for the user's API keys: key.create, key.list, key.revoke, key.require.

The key itself exists only in key.create's reply: it is stored as its sha256 (store/keys.py),
never logged, and no other method returns it.
"""

from __future__ import annotations

from typing import Any, Mapping

from stoker.daemon.config.edit import write_require_keys
from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.handlers.config_writes import refuse_while_invalid, rewrite_config
from stoker.daemon.control.params import Kind, Param, method
from stoker.daemon.control.replies import ApiKey, CreatedApiKey, KeyList, KeyRequirement
from stoker.daemon.control.status import frontdoor_status
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


@method(
    "key.require",
    Param("off", Kind.BOOLEAN, "Stop requiring a key: loopback clients may call without one.", default=False),
    errors=(ReasonCode.CONFIG_INVALID,),
    result=KeyRequirement,
)
async def key_require(daemon: ControlledDaemon, params: Mapping[str, Any]) -> KeyRequirement:
    """Require a key of every front door client (`off`: of none on loopback): `[frontdoor]
    require_keys` written into the config file, applied at once.

    Refused while the config file is invalid (fix it first), and `off` while the front door
    listens beyond loopback (such a bind needs keys).
    Reply: {require_keys, changed, config_path, frontdoor (as status shows it)}.
    """
    required = not params["off"]
    refuse_while_invalid(daemon, "stoker key require")
    path = daemon.paths.config_file
    changed = daemon.config.frontdoor.require_keys is not required
    if changed:
        rewrite_config(
            daemon,
            lambda file: write_require_keys(file, required),
            "require_keys was written, but the config it makes was refused; the previous one stays in force: ",
        )
    return KeyRequirement(
        require_keys=daemon.config.frontdoor.require_keys,
        changed=changed,
        config_path=str(path),
        frontdoor=frontdoor_status(daemon),
    )
