"""Ollama's requests as the engine's OpenAI-compatible ones, and the engine's answers as Ollama's
objects (daemon/frontdoor/ollama_shapes.py): pure, no sockets."""

from __future__ import annotations

import base64
import json

import pytest

from stoker.daemon.frontdoor.ollama_shapes import (
    Answer,
    BadRequest,
    EventLines,
    chat_request,
    embed_answer,
    embed_request,
    generate_request,
)
from stoker.daemon.frontdoor.metrics import engine_figures

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


def test_options_format_and_images_reach_the_engine_in_its_words():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "what is it?", "images": [PNG]}],
        "options": {"temperature": 0.2, "num_predict": 7, "stop": ["\n"], "num_ctx": 8192, "seed": 3, "top_k": 5},
        "format": {"type": "object"},
        "keep_alive": "5m",
    }
    out = chat_request(body)
    assert out["stream"] is True  # Ollama streams unless told not to
    assert out["temperature"] == 0.2 and out["max_tokens"] == 7 and out["stop"] == ["\n"]
    assert out["seed"] == 3 and out["top_k"] == 5
    assert "num_ctx" not in out and "keep_alive" not in out  # the server's launch decides them
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": {"type": "object"}},
    }
    text, image = out["messages"][0]["content"]
    assert text == {"type": "text", "text": "what is it?"}
    assert image["image_url"]["url"] == f"data:image/png;base64,{PNG}"
    assert chat_request({**body, "stream": False, "options": {"num_predict": -1}})["stream"] is False
    assert "max_tokens" not in chat_request({**body, "options": {"num_predict": -1}})  # -1: no bound


def test_json_mode_tools_and_bad_requests():
    assert chat_request({"messages": [], "format": "json"})["response_format"]["json_schema"]["schema"] == {
        "type": "object"
    }
    call = {"function": {"name": "f", "arguments": {"x": 1}}}
    out = chat_request({"messages": [{"role": "assistant", "content": "", "tool_calls": [call]}]})
    assert out["messages"][0]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    with pytest.raises(BadRequest):
        chat_request({"messages": "hi"})
    with pytest.raises(BadRequest):
        chat_request({"messages": [], "format": "yaml"})


def test_generate_uses_the_chat_template_unless_raw():
    path, out = generate_request({"model": "m", "prompt": "Once", "system": "Be brief."})
    assert path == "/v1/chat/completions"
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once"}]
    path, out = generate_request({"model": "m", "prompt": "Once", "raw": True})
    assert path == "/v1/completions" and out["prompt"] == "Once"


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_a_stream_cut_anywhere_gives_the_same_lines_and_its_figures():
    events = sse(
        {"choices": [{"delta": {"role": "assistant", "content": None}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"delta": {"content": "lo \u00e9"}, "finish_reason": None}]},
        {
            "choices": [{"delta": {}, "finish_reason": "length"}],
            "timings": {"prompt_n": 4, "cache_n": 2, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 10.0},
        },
    )
    for size in (1, 7, len(events)):
        answer = Answer(True, "m", started=0.0)
        stream = EventLines(answer)
        out = b"".join(stream.feed(events[i : i + size]) for i in range(0, len(events), size))
        assert stream.over
        lines = [json.loads(line) for line in out.splitlines()]
        assert [line["message"]["content"] for line in lines] == ["Hel", "lo \u00e9"]
        assert all(line["done"] is False and line["model"] == "m" and line["created_at"] for line in lines)
        final = answer.final(now=1.0)
        assert final["done"] is True and final["done_reason"] == "length"
        assert final["prompt_eval_count"] == 6 and final["eval_count"] == 2
        assert final["eval_duration"] == 10_000_000 and final["prompt_eval_duration"] == 1_500_000
        assert final["total_duration"] == 1_000_000_000 and final["message"]["content"] == ""
        # /metrics reads the tokens from Ollama's last line as from the engine's.
        figures = engine_figures(answer.final_line(now=1.0))
        assert figures.generated == 2 and figures.prompt == 6 and figures.seconds == pytest.approx(0.01)


def test_a_generate_stream_and_an_error_event():
    answer = Answer(False, "m", started=0.0)
    stream = EventLines(answer)
    out = stream.feed(b'data: {"choices":[{"text":"Once","finish_reason":null}]}\n\n')
    assert json.loads(out) == {
        "model": "m",
        "created_at": json.loads(out)["created_at"],
        "response": "Once",
        "done": False,
    }
    out = stream.feed(b'error: {"error":{"message":"boom","code":500}}\n\n')
    assert json.loads(out) == {"error": "boom"}


def test_a_whole_answer_and_embeddings():
    engine = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    out = Answer(True, "m", started=0.0).whole(engine, now=0.5)
    assert out["message"]["content"] == "Hi" and out["done_reason"] == "stop"
    assert out["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"a": 1}}}]
    assert out["prompt_eval_count"] == 3 and out["eval_count"] == 1

    assert embed_request({"model": "m", "input": "a"}, legacy=False)["input"] == ["a"]
    with pytest.raises(BadRequest):
        embed_request({"model": "m", "input": 3}, legacy=False)
    data = {"data": [{"index": 1, "embedding": [0.2]}, {"index": 0, "embedding": [0.1]}], "usage": {"prompt_tokens": 2}}
    assert embed_answer(data, "m", legacy=False, total_s=0.1)["embeddings"] == [[0.1], [0.2]]
    assert embed_answer(data, "m", legacy=True, total_s=0.1) == {"embedding": [0.1]}


def test_a_token_event_copied_as_it_is_reads_as_one_decoded():
    """The hot path (a token's text copied as the JSON string it is) gives what decoding gives."""
    texts = ["Hel", 'say "hi"\\n', "caf\u00e9 \u2603", "\\u00e9", "\n\t"]
    for chat in (True, False):
        copied, decoded = EventLines(Answer(chat, "m", 0.0)), Answer(chat, "m", 0.0)
        for text in texts:
            event = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}], "created": 1}
            for ensure_ascii in (True, False):
                raw = json.dumps(event, ensure_ascii=ensure_ascii, separators=(",", ":")).encode()
                fast = json.loads(copied.feed(b"data: " + raw + b"\n\n"))
                slow = json.loads(decoded.event_lines(event))
                assert fast == {**slow, "created_at": fast["created_at"]}
                assert (fast["message"]["content"] if chat else fast["response"]) == text


def test_a_catalog_failure_is_the_requests_or_the_servers():
    from stoker.states.frontdoor.catalog_answers import http_status
    from stoker.states.reasons import ReasonCode

    assert http_status(ReasonCode.MODEL_NOT_IN_CATALOG) == 404 and http_status(ReasonCode.PULL_BAD_SPEC) == 400
    assert http_status(ReasonCode.MODEL_IN_USE) == 409 and http_status(ReasonCode.PULL_DISK_FULL) == 500
