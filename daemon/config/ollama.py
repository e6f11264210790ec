"""`[ollama]`: Ollama's API, served by the front door on a listener of its own.

Documented in docs/config.md and docs/ollama.md; the routes are daemon/frontdoor/ollama.py. The
listener binds `[frontdoor] host` (the same LAN rule: keys required off loopback) at `port`,
Ollama's own 11434 by default, when the daemon starts; a port another program holds (Ollama
itself, most often) leaves it off and `stoker status` says so.
"""

from __future__ import annotations

import attrs

from stoker.daemon.config.checks import boolean, integer, setting

# Ollama's own port: the clients that speak only Ollama's API look there first.
OLLAMA_PORT = 11434


@attrs.frozen
class OllamaConfig:
    # Serve Ollama's API (/api/chat, /api/generate, /api/tags, ...) beside the front door's own
    # address; both are read when the daemon starts. `[frontdoor] enabled = false` turns it off too.
    enabled: bool = setting(True, boolean)
    port: int = setting(OLLAMA_PORT, integer(1, 65535))
