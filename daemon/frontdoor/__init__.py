"""The front door: one stable OpenAI-compatible address in front of the engine (docs/frontdoor.md).

`server.serve_frontdoor` runs in the daemon's root nursery (`http11`, a lean HTTP/1.1 server on
trio sockets, h11 parsing its requests, serving `app.FrontDoor`'s routes). It reaches the daemon only through `served.FrontDoorDaemon`, never
`daemon.runtime`, and the engine only through `daemon.engine.api.EngineClient`.
"""
