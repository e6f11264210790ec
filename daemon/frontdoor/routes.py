"""The front door's routes: every path it answers, and what it does with each method there.

One table, `ROUTES`, says it all: which paths go to the engine (the model picked by the body's
`model`, or by `?model=` on a GET), which the front door answers itself (the model list, one
model, /health, /metrics), and which it refuses because they would break what Stoker promises
(the engine's slots, settings and model loading belong to Stoker: docs/frontdoor.md, "What is
served"). `FrontDoor.handle` (app.py) looks a request up here and acts; the request figures of
/metrics take their route label from here too (a path with an id, `/v1/models/{id}`, counts under
its pattern). A new route is one row. The paths are llama-server b11434's
(tools/server/server.cpp), checked against the running engine.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs


class Action(enum.StrEnum):
    """What the front door does with a request on a route."""

    FORWARD = "forward"  # to the engine: the JSON body's `model` picks which (or the default)
    FORWARD_QUERY = "forward_query"  # to the engine, no body: `?model=` picks which (or the default)
    MODELS = "models"  # the front door's own list of every configured model
    MODEL = "model"  # one model of that list (`/v1/models/{id}`)
    HEALTH = "health"  # the front door's own health, per model
    METRICS = "metrics"  # Prometheus' text format
    PAGE = "page"  # the chat page (daemon/frontdoor/chat_page.py): static, no secret in it
    REFUSED = "refused"  # would break a guarantee: 403 `frontdoor_route_refused`, with why


@attrs.frozen
class Route:
    """One path (or, with `prefix`, every path under it) and what each method there does."""

    label: str  # the path, or its pattern: the route label of /metrics and the access log's route
    methods: Mapping[str, Action]
    prefix: bool = False  # `label` up to its `{`, and anything after it (`/v1/models/{id}`)
    anthropic: bool = False  # Anthropic's API: its errors in Anthropic's shape
    # The answer ends with the engine's token figures (`usage`, `timings`), read for /metrics and
    # the access log: completions of every kind, embeddings, rerankings.
    figures: bool = False
    remote: bool = False  # an OpenAI-compatible endpoint serves it too, under its base (a remote model)
    why: str = ""  # why a REFUSED method is refused: the error's sentence

    @property
    def stem(self) -> str:
        return self.label.partition("{")[0]


POST = {"POST": Action.FORWARD}
GET_OWN = {"GET": Action.MODELS}

# The engine's slots hold the conversations Stoker saves and restores itself (snapshots), under
# names and ids it keeps: another writer breaks that.
SLOTS_WHY = (
    "The engine's slots are Stoker's: it saves and restores conversations itself ([snapshots], `stoker snapshot`), "
    "and a slot saved, restored or erased from outside would break that; slot ids are not a client's to use."
)
# Stoker loads and unloads models itself, by the model a request names.
LOADING_WHY = (
    "Stoker loads and unloads models itself: name the model in a request (it is loaded on demand), or use "
    "`stoker up NAME` / `stoker down NAME`; the engine's own model management is not served."
)
PROPS_WHY = (
    "POST /props would change the engine's settings for every client and be lost at its next restart; set them "
    "in the config (`[server]` or `[models.NAME]`, `extra_args`), which every launch applies."
)
LORA_WHY = (
    "POST /lora-adapters would change the adapters' scales for every client and be lost at the engine's next "
    "restart; pass `--lora` / `--lora-scaled` in `extra_args`, or set `lora` per request."
)
STREAMS_WHY = (
    "Resumable streams live inside one engine process, which Stoker restarts and replaces; they are not "
    "served through the front door (a stream cut by a restart ends with the `engine_stream_cut` event)."
)


def _routes() -> tuple[Route, ...]:
    generating = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    # Their other names (llama-server's own, without /v1), and its own completion kinds.
    legacy = (
        "/chat/completions",
        "/completion",
        "/completions",
        "/responses",
        "/infill",
        "/rerank",
        "/reranking",
        "/v1/reranking",
    )
    plain = (
        "/embedding",
        "/embeddings",
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/chat/completions/input_tokens",
        "/v1/chat/completions/input_tokens",
        "/responses/input_tokens",
        "/v1/responses/input_tokens",
        "/v1/chat/completions/control",
        "/v1/systemone",
    )
    refused_slots = {"GET": Action.REFUSED, "POST": Action.REFUSED}
    return (
        *(Route(path, POST, figures=True, remote=True) for path in generating),
        Route("/v1/messages", POST, anthropic=True, figures=True, remote=True),
        Route("/v1/messages/count_tokens", POST, anthropic=True, remote=True),
        Route("/v1/embeddings", POST, figures=True, remote=True),
        Route("/v1/rerank", POST, figures=True, remote=True),
        *(Route(path, POST, figures=True) for path in legacy),
        *(Route(path, POST) for path in plain),
        Route("/props", {"GET": Action.FORWARD_QUERY, "POST": Action.REFUSED}, why=PROPS_WHY),
        Route("/lora-adapters", {"GET": Action.FORWARD_QUERY, "POST": Action.REFUSED}, why=LORA_WHY),
        Route("/v1/models", GET_OWN),
        Route("/models", {"GET": Action.MODELS, "POST": Action.REFUSED, "DELETE": Action.REFUSED}, why=LOADING_WHY),
        Route("/v1/models/{id}", {"GET": Action.MODEL}, prefix=True),
        Route("/models/{action}", {"GET": Action.REFUSED, "POST": Action.REFUSED}, prefix=True, why=LOADING_WHY),
        Route("/health", {"GET": Action.HEALTH}),
        Route("/v1/health", {"GET": Action.HEALTH}),
        Route("/metrics", {"GET": Action.METRICS}),
        Route("/", {"GET": Action.PAGE}),
        Route("/slots", refused_slots, why=SLOTS_WHY),
        Route("/slots/{id}", refused_slots, prefix=True, why=SLOTS_WHY),
        Route("/v1/stream", {"GET": Action.REFUSED, "DELETE": Action.REFUSED}, why=STREAMS_WHY),
        Route("/v1/streams/lookup", {"POST": Action.REFUSED}, why=STREAMS_WHY),
    )


ROUTES: tuple[Route, ...] = _routes()
EXACT: dict[str, Route] = {r.label: r for r in ROUTES if not r.prefix}
PREFIXED: tuple[Route, ...] = tuple(r for r in ROUTES if r.prefix)
# Every route's label but /metrics' (a scrape is not a request), and those whose answers carry
# the engine's token figures.
LABELS: tuple[str, ...] = tuple(r.label for r in ROUTES if r.label != "/metrics")
WITH_FIGURES: tuple[str, ...] = tuple(r.label for r in ROUTES if r.figures)


def find_route(path: str) -> Route | None:
    """The route a path is on (None: the front door serves nothing there)."""
    exact = EXACT.get(path)
    if exact is not None:
        return exact
    for route in PREFIXED:
        if path.startswith(route.stem) and len(path) > len(route.stem):
            return route
    return None


def route_label(path: str) -> str | None:
    """A path's route label (its pattern for a path with an id); None when no route serves it."""
    route = find_route(path)
    return route.label if route is not None else None


def is_anthropic(path: str) -> bool:
    """The path is Anthropic's API: its errors take Anthropic's shape."""
    route = find_route(path)
    return route is not None and route.anthropic


def allowed_methods(route: Route | None) -> str:
    """The `Allow` (and Access-Control-Allow-Methods) value of a route: its methods (a refused one is
    answered too, with why) and OPTIONS."""
    return ", ".join([*(route.methods if route is not None else ("GET", "POST")), "OPTIONS"])
