"""The front door's route table and its CORS policy, as pure functions (daemon/frontdoor/routes.py,
daemon/frontdoor/cors.py); the sockets' side is tests/integration/test_frontdoor_cors.py."""

from __future__ import annotations

import pytest
from stoker.daemon.frontdoor.cors import Origin, answer_headers, is_preflight, judge_origin, preflight_headers
from stoker.daemon.frontdoor.routes import ROUTES, Action, allowed_methods, find_route, is_anthropic, route_label

LISTED = ("https://app.example", "http://localhost:3000")


@pytest.mark.parametrize(
    "path, label, get, post",
    [
        ("/v1/chat/completions", "/v1/chat/completions", None, Action.FORWARD),
        ("/v1/responses", "/v1/responses", None, Action.FORWARD),
        ("/v1/messages/count_tokens", "/v1/messages/count_tokens", None, Action.FORWARD),
        ("/tokenize", "/tokenize", None, Action.FORWARD),
        ("/props", "/props", Action.FORWARD_QUERY, Action.REFUSED),
        ("/v1/models", "/v1/models", Action.MODELS, None),
        ("/v1/models/org/name-7b", "/v1/models/{id}", Action.MODEL, None),
        ("/health", "/health", Action.HEALTH, None),
        ("/slots", "/slots", Action.REFUSED, Action.REFUSED),
        ("/slots/0", "/slots/{id}", Action.REFUSED, Action.REFUSED),
        ("/models/load", "/models/{action}", Action.REFUSED, Action.REFUSED),
    ],
)
def test_each_path_finds_its_route_and_what_each_method_does(path, label, get, post):
    route = find_route(path)
    assert route is not None and route.label == label == route_label(path)
    assert route.methods.get("GET") == get and route.methods.get("POST") == post


def test_unknown_paths_have_no_route_and_a_prefix_needs_something_after_it():
    for path in ("/v2/chat", "/v1/models/", "/slots/", "/tokenizer", "/index.html"):
        assert find_route(path) is None, path


def test_every_refused_method_says_why_and_anthropic_routes_are_marked():
    for route in ROUTES:
        if Action.REFUSED in route.methods.values():
            assert route.why, route.label
    assert is_anthropic("/v1/messages") and is_anthropic("/v1/messages/count_tokens")
    assert not is_anthropic("/v1/chat/completions")
    assert allowed_methods(find_route("/props")) == "GET, POST, OPTIONS"
    assert allowed_methods(None) == "GET, POST, OPTIONS"


def judge(origin: bytes | None, host: bytes | None = b"127.0.0.1:11436", origins=LISTED, keyless=True) -> Origin:
    return judge_origin(origins, origin, host, keyless=keyless)


def test_no_origin_is_not_a_browser_call_and_passes():
    assert judge(None) is Origin.NONE and answer_headers(Origin.NONE, None) == []


def test_a_listed_origin_is_echoed_with_credentials_and_vary():
    assert judge(b"https://app.example") is Origin.LISTED
    assert judge(b"HTTPS://APP.EXAMPLE") is Origin.LISTED  # origins compare case-insensitively
    headers = dict(answer_headers(Origin.LISTED, b"https://app.example"))
    assert headers[b"access-control-allow-origin"] == b"https://app.example"
    assert headers[b"access-control-allow-credentials"] == b"true" and headers[b"vary"] == b"Origin"


def test_any_origin_under_a_star_never_allows_credentials():
    assert judge(b"https://elsewhere.example", origins=("*",)) is Origin.ANY
    headers = dict(answer_headers(Origin.ANY, b"https://elsewhere.example"))
    assert headers[b"access-control-allow-origin"] == b"*"
    assert b"access-control-allow-credentials" not in headers


def test_other_origins_are_refused_by_default():
    assert judge(b"https://elsewhere.example", origins=()) is Origin.REFUSED
    assert judge(b"http://localhost:3000", origins=()) is Origin.REFUSED
    assert judge(b"null", origins=()) is Origin.REFUSED  # a file:// page, a sandboxed frame


def test_the_front_doors_own_origin_passes_but_not_a_rebound_name_without_keys():
    assert judge(b"http://127.0.0.1:11436", origins=()) is Origin.SAME
    assert judge(b"http://localhost:11436", b"localhost:11436", origins=()) is Origin.SAME
    assert judge(b"http://[::1]:11436", b"[::1]:11436", origins=()) is Origin.SAME
    assert judge(b"https://127.0.0.1:11436", origins=()) is Origin.REFUSED  # the front door speaks http
    # A page whose name resolves to 127.0.0.1 (DNS rebinding) is not the front door's own origin
    # while a request needs no key; with keys required it is (the page still needs a key).
    rebound = (b"http://attacker.example:11436", b"attacker.example:11436")
    assert judge(*rebound, origins=(), keyless=True) is Origin.REFUSED
    assert judge(*rebound, origins=(), keyless=False) is Origin.SAME


def test_a_preflight_gets_the_methods_the_headers_asked_for_and_a_max_age():
    assert is_preflight("OPTIONS", b"https://app.example", b"POST")
    assert not is_preflight("OPTIONS", None, b"POST") and not is_preflight("OPTIONS", b"https://app.example", None)
    headers = dict(preflight_headers("POST, OPTIONS", b"authorization, content-type, x-stainless-os"))
    assert headers[b"access-control-allow-methods"] == b"POST, OPTIONS"
    assert headers[b"access-control-allow-headers"] == b"authorization, content-type, x-stainless-os"
    assert int(headers[b"access-control-max-age"]) > 0
    # Anything but a list of header names is not echoed.
    assert b"access-control-allow-headers" not in dict(preflight_headers("POST", b"x\r\nset-cookie: a"))


def test_a_public_pages_private_network_preflight_is_answered_for_an_allowed_origin():
    assert (b"access-control-allow-private-network", b"true") in preflight_headers("POST", None, True)
    assert b"access-control-allow-private-network" not in dict(preflight_headers("POST", None, False))


def test_the_root_is_the_chat_page_and_takes_get_only():
    route = find_route("/")
    assert route is not None and route.methods == {"GET": Action.PAGE}
