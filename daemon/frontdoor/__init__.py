"""The front door: one stable OpenAI-compatible address in front of the engine (docs/frontdoor.md).

`server.serve_frontdoor` runs in the daemon's root nursery (Hypercorn's trio worker serving a
Starlette app). It reaches the daemon only through `served.FrontDoorDaemon`, never
`daemon.service`, and the engine only through `daemon.engine.api.EngineClient`.
"""
