"""What `stoker chat` says for each answer the front door can give instead of a chat, and for a
front door that does not listen: the reason code and a sentence that says what to do."""

from __future__ import annotations

import json

import pytest

from stoker.daemon.cli.chat import frontdoor_url
from stoker.daemon.core.errors import StokerError
from stoker.daemon.frontdoor.client import refusal
from stoker.states.reasons import ReasonCode

URL = "http://127.0.0.1:11436/v1"


def body(code, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "x", "param": None, "code": code}}).encode()


def test_a_503_carries_the_front_doors_reason_and_when_to_retry():
    err = refusal(503, body("frontdoor_hold_timeout", "not ready in time"), url=URL, key_given=False, retry_after="5")
    assert err.reason == ReasonCode.FRONTDOOR_HOLD_TIMEOUT and err.message == "not ready in time"
    assert err.evidence == {"url": URL, "status": 503, "retry_after_s": "5"}


def test_a_401_says_how_to_get_a_key_or_that_the_one_given_was_refused():
    none = refusal(401, body("invalid_api_key", "A valid API key is required."), url=URL, key_given=False)
    assert none.reason == ReasonCode.INVALID_API_KEY and "stoker key create" in none.message
    wrong = refusal(401, body("invalid_api_key", "A valid API key is required."), url=URL, key_given=True)
    assert "refused the API key given" in wrong.message and "stoker key list" in wrong.message


def test_the_engines_own_errors_keep_their_message():
    # llama-server's error bodies carry a numeric code: not one of ours.
    err = refusal(400, body(400, "the request exceeds the available context size"), url=URL, key_given=False)
    assert err.reason == ReasonCode.ENGINE_REFUSED_REQUEST and "context size" in err.message
    missing = refusal(404, body("model_not_found", "The model 'x' does not exist here"), url=URL, key_given=False)
    assert missing.reason == ReasonCode.MODEL_NOT_FOUND and "'x'" in missing.message
    garbled = refusal(502, b"<html>bad gateway</html>", url=URL, key_given=False)
    assert garbled.reason == ReasonCode.ENGINE_REFUSED_REQUEST and "bad gateway" in garbled.message


def test_a_stream_cut_midway_is_said_as_such():
    event = body("engine_stream_cut", "the engine's stream was cut midway (peer closed)")
    err = refusal(200, event, url=URL, key_given=False)
    assert err.reason == ReasonCode.ENGINE_STREAM_CUT and "cut midway" in err.message


def status(**frontdoor) -> dict:
    return {"state": "ready", "config": {"path": "/c/config.toml"}, "frontdoor": frontdoor}


def test_the_front_door_url_comes_from_status_or_the_reason_there_is_none():
    assert frontdoor_url(status(url=URL, enabled=True, address="127.0.0.1:11436")) == URL
    with pytest.raises(StokerError) as off:
        frontdoor_url(status(url=None, enabled=False, address="127.0.0.1:11436"))
    assert off.value.reason == ReasonCode.FRONTDOOR_UNAVAILABLE
    assert "enabled = false" in off.value.message and "/c/config.toml" in off.value.message
    with pytest.raises(StokerError) as taken:
        frontdoor_url(status(url=None, enabled=True, address="127.0.0.1:11436"))
    assert "not listening on 127.0.0.1:11436" in taken.value.message and "stoker logs" in taken.value.message
    with pytest.raises(StokerError) as old:
        frontdoor_url({"state": "ready"})  # a daemon older than the frontdoor field
    assert "restart it" in old.value.message
