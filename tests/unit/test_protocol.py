"""The sans-I/O protocol: framing limits, request and reply shapes, the error-code table."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.daemon.control import error_codes, protocol
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode


def frames_of(decoder: protocol.FrameDecoder) -> list[bytes]:
    out = []
    while (frame := decoder.next_frame()) is not None:
        out.append(frame)
    return out


# --- framing ---------------------------------------------------------------------------


def test_decoder_splits_lines_and_keeps_partial():
    decoder = protocol.FrameDecoder()
    decoder.feed(b'{"a":1}\n{"b"')
    assert frames_of(decoder) == [b'{"a":1}']
    assert decoder.buffered == 4
    decoder.feed(b":2}\n\n  \n")
    assert frames_of(decoder) == [b'{"b":2}']
    assert decoder.buffered == 0


def test_oversized_frame_is_reported_once_and_not_buffered():
    decoder = protocol.FrameDecoder(max_frame=16)
    decoder.feed(b"x" * 10)
    decoder.feed(b"y" * 10)  # over the limit, no newline yet
    assert decoder.buffered == 0
    with pytest.raises(protocol.FrameTooLarge) as info:
        decoder.next_frame()
    assert info.value.reason == ReasonCode.REQUEST_TOO_LARGE
    assert decoder.next_frame() is None
    for _ in range(100):
        decoder.feed(b"z" * 1000)  # the rest of the huge frame is dropped as it comes
        assert decoder.buffered == 0
    decoder.feed(b'zz\n{"ok":1}\n')
    assert frames_of(decoder) == [b'{"ok":1}']


def test_frame_exactly_at_the_limit_is_accepted():
    decoder = protocol.FrameDecoder(max_frame=8)
    decoder.feed(b"12345678\n123456789\nabc\n")
    assert decoder.next_frame() == b"12345678"
    with pytest.raises(protocol.FrameTooLarge):
        decoder.next_frame()
    assert decoder.next_frame() == b"abc"


messages = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
        max_leaves=6,
    ),
    max_size=5,
)


@settings(max_examples=100, deadline=None)
@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_any_chunking_of_valid_frames_round_trips(payloads, data):
    stream = b"".join(protocol.encode_event(p) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    decoder = protocol.FrameDecoder()
    got = []
    last = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[last:cut])
        last = cut
        got.extend(frames_of(decoder))
    assert [protocol.decode_reply(frame) for frame in got] == [protocol.Event(p) for p in payloads]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=10))
def test_garbage_raises_only_typed_errors(chunks):
    decoder = protocol.FrameDecoder(max_frame=32)
    for chunk in chunks:
        decoder.feed(chunk)
        while True:
            try:
                frame = decoder.next_frame()
            except protocol.FrameTooLarge:
                continue
            if frame is None:
                break
            assert len(frame) <= 32
            for decode in (protocol.decode_request, protocol.decode_reply):
                try:
                    decode(frame)
                except protocol.ProtocolError as err:
                    assert err.reason in (ReasonCode.BAD_REQUEST, ReasonCode.REQUEST_TOO_LARGE)
        assert decoder.buffered <= 32


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=5),
        max_leaves=12,
    )
)
def test_any_json_value_decodes_or_raises_bad_request(value):
    frame = json.dumps(value).encode()
    for decode in (protocol.decode_request, protocol.decode_reply):
        try:
            decode(frame)
        except protocol.ProtocolError as err:
            assert err.reason == ReasonCode.BAD_REQUEST


# --- requests --------------------------------------------------------------------------


def test_request_round_trip():
    frame = protocol.encode_request(7, "status", {"verbose": True})
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1
    assert protocol.decode_request(frame.rstrip(b"\n")) == protocol.Request(7, "status", {"verbose": True})


def test_params_default_to_empty():
    assert protocol.decode_request(b'{"jsonrpc":"2.0","id":"a","method":"up"}').params == {}


def test_malformed_json_is_a_parse_error():
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_request(b'{"jsonrpc": "2.0", "id": 1,')
    assert info.value.reason == ReasonCode.BAD_REQUEST
    assert info.value.code == error_codes.PARSE_ERROR
    assert info.value.request_id is None


def test_invalid_utf8_is_a_parse_error():
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_request(b'{"a": "\xff\xfe"}')
    assert info.value.code == error_codes.PARSE_ERROR


@pytest.mark.parametrize(
    "obj, recovered",
    [
        ([1, 2], None),
        ("hello", None),
        ({"id": 3, "method": "x"}, 3),  # no jsonrpc
        ({"jsonrpc": "2.0", "id": 4}, 4),  # no method
        ({"jsonrpc": "2.0", "id": 5, "method": ""}, 5),
        ({"jsonrpc": "2.0", "id": 6, "method": "x", "params": [1]}, 6),
        ({"jsonrpc": "2.0", "id": "s", "method": 3}, "s"),
        ({"jsonrpc": "2.0", "method": "x"}, None),  # no id
        ({"jsonrpc": "2.0", "id": True, "method": "x"}, None),
        ({"jsonrpc": "2.0", "id": 8, "method": "x", "extra": 1}, 8),
    ],
)
def test_wrong_shapes_are_bad_requests_with_the_id_when_known(obj, recovered):
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_request(json.dumps(obj).encode())
    assert info.value.reason == ReasonCode.BAD_REQUEST
    assert info.value.code == -32600
    assert info.value.request_id == recovered


@pytest.mark.parametrize(
    "frame, recovered, key",
    [
        (b'{"jsonrpc":"2.0","id":1,"method":"history","params":{"limit":5,"limit":9999}}', 1, "limit"),
        (b'{"jsonrpc":"2.0","id":2,"method":"up","method":"down"}', 2, "method"),
        (b'{"jsonrpc":"2.0","id":3,"id":4,"method":"up"}', None, "id"),  # which id? neither
    ],
)
def test_a_key_named_twice_in_a_request_is_refused(frame, recovered, key):
    # json.loads would silently keep the last value: the daemon could act on what the
    # client did not mean (`limit` 9999 where a reviewer of the frame reads 5).
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_request(frame)
    assert info.value.reason == ReasonCode.BAD_REQUEST and info.value.code == -32600
    assert info.value.request_id == recovered
    assert info.value.evidence == {"duplicate_key": key}


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json_in_a_request(constant):
    frame = b'{"jsonrpc":"2.0","id":1,"method":"history","params":{"since":' + constant + b"}}"
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode_request(frame)
    assert (info.value.reason, info.value.code) == (ReasonCode.BAD_REQUEST, error_codes.PARSE_ERROR)


# --- replies ---------------------------------------------------------------------------


def test_result_round_trip():
    frame = protocol.encode_result(3, {"state": "ready"})
    assert protocol.decode_reply(frame) == protocol.Result(3, {"state": "ready"})


def test_error_reply_shape_and_round_trip():
    frame = protocol.encode_error(9, ReasonCode.UNKNOWN_METHOD, data={"method": "nope"})
    obj = json.loads(frame)
    assert obj == {
        "jsonrpc": "2.0",
        "id": 9,
        "error": {
            "code": -32601,
            "reason": "unknown_method",
            "message": "The daemon does not know this command.",
            "data": {"method": "nope"},
        },
    }
    reply = protocol.decode_reply(frame)
    assert isinstance(reply, protocol.ErrorReply)
    err = reply.to_error()
    assert isinstance(err, StokerError)
    assert err.reason == ReasonCode.UNKNOWN_METHOD and err.evidence == {"method": "nope"}


def test_error_reply_with_an_unknown_reason_becomes_internal_error():
    reply = protocol.decode_reply(
        b'{"jsonrpc":"2.0","id":1,"error":{"code":5,"reason":"from_the_future","message":"m"}}'
    )
    err = reply.to_error()
    assert err.reason == ReasonCode.INTERNAL_ERROR
    assert err.evidence["remote_reason"] == "from_the_future"


def test_stoker_error_encodes_with_its_evidence():
    err = StokerError(ReasonCode.PORT_IN_USE, evidence={"port": 8080})
    obj = json.loads(protocol.encode_stoker_error(1, err))
    assert obj["error"]["code"] == error_codes.ERROR_CODES[ReasonCode.PORT_IN_USE]
    assert obj["error"]["data"] == {"port": 8080}


def test_unserialisable_evidence_does_not_break_an_error_reply():
    frame = protocol.encode_error(1, ReasonCode.INTERNAL_ERROR, data={"obj": object()})
    assert json.loads(frame)["error"]["data"]["obj"].startswith("<object")


def test_event_notification_shape():
    obj = json.loads(protocol.encode_event({"topic": "t", "seq": 1}))
    assert obj == {"jsonrpc": "2.0", "method": "event", "params": {"topic": "t", "seq": 1}}


def test_result_encoder_handles_common_types_and_refuses_others(tmp_path):
    obj = json.loads(protocol.encode_result(1, {"path": tmp_path, "reason": ReasonCode.GPU_MISSING, "s": {2, 1}}))
    assert obj["result"] == {"path": str(tmp_path), "reason": "gpu_missing", "s": [1, 2]}
    with pytest.raises(TypeError):
        protocol.encode_result(1, object())


# --- the code table --------------------------------------------------------------------


def test_every_reason_has_a_distinct_code():
    # Reasons missing from the table get a code derived from their string; if two collide,
    # give one of them an entry in error_codes.ERROR_CODES.
    codes = {reason: error_codes.code_for(reason) for reason in ReasonCode}
    assert len(set(codes.values())) == len(codes), codes
    assert error_codes.PARSE_ERROR not in codes.values()
    assert len(set(error_codes.ERROR_CODES.values())) == len(error_codes.ERROR_CODES)


def test_a_reason_missing_from_the_table_gets_a_stable_derived_code():
    assert error_codes.code_for(ReasonCode.GPU_MISSING) == 4001
    unlisted = [reason for reason in ReasonCode if reason not in error_codes.ERROR_CODES]
    for reason in unlisted:
        assert error_codes.DERIVED_BASE <= error_codes.code_for(reason) < error_codes.DERIVED_BASE + 10000
        assert error_codes.code_for(reason) == error_codes.code_for(str(reason))


def test_protocol_reasons_use_jsonrpc_codes():
    assert error_codes.code_for(ReasonCode.BAD_REQUEST) == -32600
    assert error_codes.code_for(ReasonCode.UNKNOWN_METHOD) == -32601
    assert error_codes.code_for(ReasonCode.INTERNAL_ERROR) == -32603
    assert error_codes.code_for("not_a_reason") == error_codes.APPLICATION_ERROR


def test_events_are_encoded_leniently():
    obj = json.loads(protocol.encode_event({"topic": "t", "odd": object(), "x": float("nan"), "l": [float("inf")]}))
    assert obj["params"]["odd"].startswith("<object") and obj["params"]["x"] is None and obj["params"]["l"] == [None]
    with pytest.raises(ValueError):
        protocol.encode_result(1, float("nan"))
