"""The front door: one stable OpenAI-compatible address in front of the engine (docs/frontdoor.md).

`serve_frontdoor` runs in the daemon's root nursery (Hypercorn's trio worker serving a Starlette
app). It reaches the daemon only through `FrontDoorDaemon` (daemon/frontdoor/served.py), never
`daemon.service`, and the engine only through `daemon.engine.api.EngineClient`.
"""

from daemon.frontdoor.served import Authorize, FrontDoorDaemon, allow_loopback
from daemon.frontdoor.server import serve_frontdoor

__all__ = ["Authorize", "FrontDoorDaemon", "allow_loopback", "serve_frontdoor"]
