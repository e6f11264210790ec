"""`[models.NAME]` sections served by an external OpenAI-compatible endpoint (a remote model).

A section with `endpoint = "http://10.0.0.5:8000/v1"` is not run by Stoker: no llama-server,
no plan, no placement, no idle unload, no snapshot. The front door forwards its requests to the
endpoint (a vLLM with Ray, llm-d or KubeAI cluster, another llama-server), with the key read
from the daemon's environment variable `api_key_env` at each request (never stored in the
config, the store or a log), and `model` in the body rewritten to `remote_model` (the name the
endpoint serves it under; the NAME by default).

Refused here, with what to do: a section with both a model source (`model`) and an
`endpoint`; an endpoint that is not an http(s) URL with a host, or carries a user or password
(the key goes in `api_key_env`), a query or a fragment; plain http to a host other than
loopback unless `allow_insecure = true` says the prompts and the key cross the network in
clear; the keys of a model Stoker runs itself (ctx_size, prefer, pinned, idle_ttl_s, ...), which
mean nothing for an endpoint. Documented in docs/frontdoor.md ("Remote models") and
docs/scale-out.md.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Mapping
from urllib.parse import urlsplit

import attrs

from stoker.daemon.config.checks import Invalid, boolean, checked_values, describe, optional, seconds, setting
from stoker.daemon.config.placement import MODEL_NAME, NAME_RULE

ENDPOINT_KEY = "endpoint"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a URL's hostname) is this machine: a loopback IP, or localhost."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # An IPv4 client of a `::` socket arrives as ::ffff:127.0.0.1, which ipaddress calls not loopback.
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def endpoint_url(value: Any) -> str:
    """An http:// or https:// base URL with a host (the OpenAI paths go under it: .../v1)."""
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f'must be the endpoint\'s base URL, such as "http://10.0.0.5:8000/v1", got {describe(value)}')
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError as err:
        raise Invalid(f"is not a valid URL ({err}): {value!r}"[:200]) from None
    if parts.scheme not in ("http", "https"):
        raise Invalid(f"must be an http:// or https:// URL, got {value!r}"[:200])
    if not parts.hostname:
        raise Invalid(f"has no host: {value!r}"[:200])
    if parts.username is not None or parts.password is not None:
        raise Invalid("must not carry a user or password; put the key in an environment variable named by api_key_env")
    if parts.query or parts.fragment:
        raise Invalid(f"must be a base URL without a query or fragment, got {value!r}"[:200])
    del port  # only parsed, so that a bad port is refused here
    return value.strip().rstrip("/")


def env_name(value: Any) -> str:
    if not isinstance(value, str) or not _ENV_NAME.match(value):
        raise Invalid(
            f'must be the name of an environment variable of the daemon, such as "BIG_KEY" (not the key itself), '
            f"got {describe(value)}"[:200]
        )
    return value


def remote_name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 256:
        raise Invalid(f"must be the model name the endpoint serves, got {describe(value)}")
    return value


@attrs.frozen
class RemoteModelConfig:
    """One `[models.NAME]` section with an `endpoint`."""

    name: str = "remote"  # the section's NAME
    endpoint: str = setting("", endpoint_url)  # required; the base URL the OpenAI paths go under
    # The daemon's environment variable that holds the endpoint's key (None: send no key).
    api_key_env: str | None = setting(None, optional(env_name))
    remote_model: str | None = setting(None, optional(remote_name))  # None: the NAME
    allow_insecure: bool = setting(False, boolean)  # plain http to a non-loopback host
    default: bool = setting(False, boolean)  # requests without a known model go here
    # How often its reachability is checked (GET <endpoint>/models), for status and /metrics.
    check_interval_s: float = setting(30.0, seconds(high=24 * 3600))

    @property
    def upstream_model(self) -> str:
        """The `model` the endpoint is sent."""
        return self.remote_model or self.name

    @property
    def tls(self) -> bool:
        return urlsplit(self.endpoint).scheme == "https"

    @property
    def base_path(self) -> str:
        """The endpoint's path (`/v1`): the front door's `/v1/...` routes go under it."""
        return urlsplit(self.endpoint).path.rstrip("/")

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in attrs.asdict(self).items() if key != "name"}


# The keys of a model Stoker runs itself: refused beside an endpoint, with why.
LOCAL_ONLY = ("model", "ctx_size", "parallel", "prefer", "idle_ttl_s", "pinned")


def _insecure_problem(name: str, remote: RemoteModelConfig) -> str | None:
    parts = urlsplit(remote.endpoint)
    if parts.scheme != "http" or is_loopback_host(parts.hostname or "") or remote.allow_insecure:
        return None
    return (
        f"models.{name}.endpoint: {remote.endpoint} is plain http to another machine: the prompts, the answers and "
        f"the key would cross the network in clear. Use https://, a tunnel to a loopback address, or set "
        f"allow_insecure = true in [models.{name}] on a network you trust"
    )


def parse_remote(name: str, section: Mapping[str, Any], problems: list[str]) -> RemoteModelConfig | None:
    """One remote section; every problem appended as "models.NAME.key: ..."."""
    keys = {f.name: f for f in attrs.fields(RemoteModelConfig) if f.name != "name"}
    values: dict[str, Any] = {}
    before = len(problems)
    if not MODEL_NAME.match(name):
        problems.append(f"models.{name}: a model name is {NAME_RULE}")
    if "model" in section:
        problems.append(
            f"models.{name}: has both model and endpoint; a model is served by a llama-server Stoker runs (model) "
            f"or by an external endpoint (endpoint), not both: remove one (remote_model names the model the "
            f"endpoint serves)"
        )
    for key, value in section.items():
        if key == "model":
            continue
        if key in LOCAL_ONLY:
            problems.append(
                f"models.{name}.{key}: only for a model Stoker runs itself; [models.{name}] is served by its endpoint"
            )
            continue
        values |= checked_values(
            f"models.{name}", keys, {key: value}, problems, unknown="unknown key for a remote model"
        )
    if len(problems) > before:
        return None
    remote = RemoteModelConfig(name=name, **values)
    if (insecure := _insecure_problem(name, remote)) is not None:
        problems.append(insecure)
        return None
    return remote


def split_remotes(table: Any, problems: list[str]) -> tuple[Any, tuple[RemoteModelConfig, ...]]:
    """The `[models]` table without its remote sections (for parse_models), and those parsed."""
    if not isinstance(table, dict):
        return table, ()
    local: dict[str, Any] = {}
    remotes = []
    for name, section in table.items():
        if isinstance(section, dict) and ENDPOINT_KEY in section:
            remote = parse_remote(name, section, problems)
            if remote is not None:
                remotes.append(remote)
        else:
            local[name] = section
    return local, tuple(remotes)


def remote_problems(remotes: tuple[RemoteModelConfig, ...], local_defaults: list[str]) -> list[str]:
    """What is wrong across the sections: more than one default, local or remote."""
    defaults = local_defaults + [r.name for r in remotes if r.default]
    if len(defaults) > 1 and any(r.default for r in remotes):
        return [f"models: default = true on {', '.join(defaults)}; at most one model is the default"]
    return []
