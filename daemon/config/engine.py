"""`[engine]`: engine updates (`stoker engine update`, docs/bundles.md "Updates").

`channel` names where updates come from: `stable` is `[bundles] manifest` (or
STOKER_MANIFEST_URL) unless `[engine.channels]` names another manifest for it; any other channel
must be listed there (`beta = "https://mirror.example/beta/manifest.json"`). The automatic check
is off by default: with `auto_update = true` the daemon asks the channel's manifest every
`check_interval_s` for each installed engine and updates it through the same gates as
`stoker engine update`.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from stoker.daemon.config.checks import Invalid, boolean, describe, seconds, setting

STABLE = "stable"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_URL = re.compile(r"^(https://|file://|http://(127\.0\.0\.1|localhost|\[::1\])[:/])")


def _channel(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise Invalid(f"must be a channel name (lowercase letters, digits, . _ -), got {describe(value)}")
    return value


def _channels(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Invalid(f'must be a table of channel = "manifest path or URL", got {describe(value)}')
    out: dict[str, str] = {}
    for name, source in value.items():
        _channel(name)
        if not isinstance(source, str) or not source:
            raise Invalid(f"{name}: must be a manifest path or URL, got {describe(source)}")
        if re.match(r"^[a-z][a-z0-9+.-]*://", source) and not _URL.match(source):
            raise Invalid(f"{name}: must be https:// (http:// only on loopback) or file://, got {source!r}"[:200])
        out[name] = source
    return out


@attrs.frozen
class EngineConfig:
    # The channel `stoker engine update` and the automatic check use when none is named.
    channel: str = setting(STABLE, _channel)
    # Channel name -> manifest (a path or URL); `stable` defaults to [bundles] manifest.
    channels: dict[str, str] = setting(attrs.Factory(dict), _channels)
    # Check the channel for a newer engine by itself, and update through the gates (off by default).
    auto_update: bool = setting(False, boolean)
    # How often the automatic check runs (the first one this long after the daemon starts).
    check_interval_s: float = setting(86400.0, seconds(high=30 * 24 * 3600))

    def manifest_for(self, channel: str | None, default_manifest: str) -> str | None:
        """The manifest of `channel` (this config's own when None); None for an unknown channel."""
        name = channel or self.channel
        if name in self.channels:
            return self.channels[name]
        return default_manifest if name == STABLE else None
