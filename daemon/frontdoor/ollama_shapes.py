"""Ollama's API in the engine's terms: its requests as OpenAI-compatible ones, the engine's answers
(SSE events or one JSON body) as Ollama's objects (NDJSON lines when streamed).

Pure: no sockets and no clock of its own (the caller passes the times), so each shape is tested
in microseconds (tests/unit/test_ollama_shapes.py). The field names and shapes are Ollama's own
(its api/types.go and docs/api.md): `created_at`, `message`, `response`, `done`, `done_reason`,
`total_duration`, `load_duration`, `prompt_eval_count`, `prompt_eval_duration`, `eval_count`,
`eval_duration` (durations in nanoseconds). daemon/frontdoor/ollama.py serves them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from typing import Any

# The routes' metric labels (daemon/frontdoor/metrics.py), and those that generate tokens.
OLLAMA_GENERATING = ("/api/chat", "/api/generate")
OLLAMA_ROUTES = (
    *OLLAMA_GENERATING,
    "/api/embed",
    "/api/embeddings",
    "/api/tags",
    "/api/ps",
    "/api/show",
    "/api/pull",
    "/api/delete",
    "/api/version",
)

# `options` whose name and meaning llama-server's OpenAI-compatible routes share with Ollama.
SAME_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    # llama-server's own, which Ollama lacks: generate exactly `num_predict` tokens (benchmarks).
    "ignore_eos",
)
# Ollama's name -> the engine's.
RENAMED_OPTIONS = {"num_predict": "max_tokens", "num_keep": "n_keep"}
# Options that size the server as it loads, never sent to the engine: `num_ctx` larger than the
# server's context relaunches it with that context (states/launch/context.py); the others are
# accepted and left to Stoker's plan (its GPU layers, threads, batch, memory mapping: `[server]`).
LAUNCH_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa")

# The engine's finish_reason -> Ollama's done_reason (a tool call ends with "stop" there).
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop"}

IMAGE_MAGIC = (
    (b"\x89PNG", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"RIFF", "image/webp"),
    (b"BM", "image/bmp"),
)


class BadRequest(ValueError):
    """A request Ollama's API would refuse: 400 with this sentence."""


_SECOND: list[Any] = [None, ""]  # the last whole second formatted, and its text (one strftime a second)


def created_at(now: float | None = None) -> str:
    """Ollama's timestamp: RFC 3339 in UTC with nanoseconds."""
    now = time.time() if now is None else now
    whole = int(now)
    if _SECOND[0] != whole:
        _SECOND[0], _SECOND[1] = whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{_SECOND[1]}.{int((now - whole) * 1e9):09d}Z"


# A token's event as llama-server writes it (`"delta":{"content":"..."}` and no end yet): its text
# is copied into Ollama's line as the JSON string it already is, neither decoded nor encoded.
_TOKEN_EVENT = re.compile(
    rb'^\{"choices":\[\{"finish_reason":null,"index":0,"delta":\{"content":("(?:[^"\\]|\\.)*")\}\}\]'
)


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def image_part(data: Any) -> dict[str, Any]:
    """One of Ollama's `images` (base64, no media type) as the engine's OpenAI image part."""
    if not isinstance(data, str) or not data:
        raise BadRequest("each of `images` must be a base64-encoded image")
    if data.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": data}}
    try:
        head = base64.b64decode(data[:32] + "=" * (-len(data[:32]) % 4), validate=False)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"an image is not valid base64: {exc}") from None
    mime = next((m for magic, m in IMAGE_MAGIC if head.startswith(magic)), "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def tool_call_to_openai(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise BadRequest("each of a message's `tool_calls` needs a `function`")
    arguments = function.get("arguments", {})
    return {
        "id": call.get("id") or f"call_{index}",
        "type": "function",
        "function": {
            "name": function.get("name"),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


def message_to_openai(message: Any) -> dict[str, Any]:
    """One of Ollama's chat messages (role, content, images, tool_calls, tool_name, thinking)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest("each message needs a `role` and a `content`")
    content = message.get("content") or ""
    out: dict[str, Any] = {"role": message["role"]}
    images = message.get("images") or []
    if images:
        out["content"] = [{"type": "text", "text": content}, *(image_part(i) for i in images)]
    else:
        out["content"] = content
    if message.get("tool_calls"):
        out["tool_calls"] = [tool_call_to_openai(c, i) for i, c in enumerate(message["tool_calls"])]
    if message["role"] == "tool" and (message.get("tool_name") or message.get("tool_call_id")):
        out["tool_call_id"] = message.get("tool_call_id") or message["tool_name"]
    if message.get("thinking"):
        out["reasoning_content"] = message["thinking"]
    return out


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """`options`, `format` and `think` as the engine's request fields."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("`options` must be an object")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in SAME_OPTIONS:
            out[key] = value
        elif key in RENAMED_OPTIONS:
            if key == "num_predict" and isinstance(value, int) and value < 0:
                continue  # -1 (and -2): until the context is full or the model stops
            out[RENAMED_OPTIONS[key]] = value
    fmt = body.get("format")
    if fmt == "json" or isinstance(fmt, dict):
        # JSON mode as a schema of any object: the engine's `json_object` leaves a chat's answer
        # unconstrained (measured: "```json " from the tiny model), a schema never does.
        schema = fmt if isinstance(fmt, dict) else {"type": "object"}
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    elif fmt not in (None, ""):
        raise BadRequest('`format` must be "json" or a JSON schema (an object)')
    think = body.get("think")
    if isinstance(think, bool):
        out["chat_template_kwargs"] = {"enable_thinking": think}
    return out


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """/api/chat as the engine's /v1/chat/completions body."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("`messages` must be a list")
    out: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [message_to_openai(m) for m in messages],
        "stream": stream_of(body),
        **sampling(body),
    }
    if body.get("tools"):
        out["tools"] = body["tools"]
    return out


def generate_request(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """/api/generate as the engine's (path, body): /v1/chat/completions with the model's chat
    template (the prompt as the user's turn, `system` before it), or /v1/completions with the
    prompt as it is when `raw` is set."""
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise BadRequest("`prompt` must be a string")
    if body.get("suffix"):
        raise BadRequest("`suffix` (fill-in-the-middle) is not served through Ollama's API here")
    common = {"model": body.get("model"), "stream": stream_of(body), **sampling(body)}
    if body.get("raw"):
        return "/v1/completions", {**common, "prompt": prompt}
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("system"), str) and body["system"]:
        messages.append({"role": "system", "content": body["system"]})
    messages.append(message_to_openai({"role": "user", "content": prompt, "images": body.get("images")}))
    return "/v1/chat/completions", {**common, "messages": messages}


def stream_of(body: dict[str, Any]) -> bool:
    """Ollama streams unless told `"stream": false`."""
    return body.get("stream") is not False


def embed_request(body: dict[str, Any], legacy: bool) -> dict[str, Any]:
    """/api/embed (`input`: a string or a list) or /api/embeddings (`prompt`) as /v1/embeddings."""
    text = body.get("prompt") if legacy else body.get("input")
    if isinstance(text, str):
        inputs: list[str] = [text]
    elif not legacy and isinstance(text, list) and all(isinstance(t, str) for t in text):
        inputs = text
    else:
        raise BadRequest("`prompt` must be a string" if legacy else "`input` must be a string or a list of strings")
    out: dict[str, Any] = {"model": body.get("model"), "input": inputs}
    if isinstance(body.get("dimensions"), int):
        out["dimensions"] = body["dimensions"]
    return out


def embed_answer(engine: dict[str, Any], model: str, legacy: bool, total_s: float) -> dict[str, Any]:
    """The engine's /v1/embeddings answer as Ollama's."""
    vectors = [item.get("embedding") for item in sorted(engine.get("data") or [], key=lambda d: d.get("index", 0))]
    if legacy:
        return {"embedding": vectors[0] if vectors else []}
    usage = engine.get("usage") or {}
    return {
        "model": model,
        "embeddings": vectors,
        "total_duration": ns(total_s),
        "load_duration": 0,
        "prompt_eval_count": usage.get("prompt_tokens", 0),
    }


def error_message(body: bytes) -> str:
    """The sentence of an error answer in OpenAI's shape (the engine's or the front door's own)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500] or "the engine refused the request"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return error if isinstance(error, str) else "the engine refused the request"


def error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


class Answer:
    """One answer being translated: chat (`message`) or generate (`response`), streamed line by
    line or whole. `text` and `thinking` keep the pieces for a whole answer."""

    def __init__(self, chat: bool, model: str, started: float, load_s: float = 0.0) -> None:
        self.chat = chat
        self.model = model
        self.started = started  # time.perf_counter() when the request arrived
        self.load_s = load_s
        self.done_reason: str | None = None
        self.timings: dict[str, Any] = {}
        self.usage: dict[str, Any] = {}
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.text: list[str] = []
        self.thinking: list[str] = []
        # Every line's head: the parts that do not change from one token to the next.
        self._head = b'{"model":' + json.dumps(model).encode() + b',"created_at":"'
        self._key = b'","message":{"role":"assistant","content":' if chat else b'","response":'
        self._tail = b'},"done":false}\n' if chat else b',"done":false}\n'

    # --- streamed ---------------------------------------------------------------------------

    def piece_line(self, text: str) -> bytes:
        """The line of one piece of the answer's text."""
        return self.literal_line(json.dumps(text).encode())

    def literal_line(self, literal: bytes) -> bytes:
        """The line of one piece of text given as a JSON string literal (the hot path: one per token)."""
        return self._head + created_at().encode() + self._key + literal + self._tail

    def event_lines(self, event: dict[str, Any]) -> bytes:
        """The lines of one of the engine's SSE events: its text at once; what it says of the end
        (finish_reason, timings, usage, tool calls) kept for `final`."""
        if "timings" in event:
            self.timings = event["timings"] or {}
        if event.get("usage"):
            self.usage = event["usage"]
        out = b""
        for choice in event.get("choices") or ():
            if choice.get("finish_reason"):
                self.done_reason = DONE_REASONS.get(choice["finish_reason"], choice["finish_reason"])
            delta = choice.get("delta") if self.chat or "delta" in choice else None
            if delta is None:
                text = choice.get("text")  # /v1/completions
                if text:
                    out += self.piece_line(text)
                continue
            for call in delta.get("tool_calls") or ():
                self._tool_piece(call)
            if delta.get("reasoning_content"):
                out += self._line({**self._message("", delta["reasoning_content"]), "done": False})
            if delta.get("content"):
                out += self.piece_line(delta["content"])
        return out

    def _tool_piece(self, call: dict[str, Any]) -> None:
        kept = self.tool_calls.setdefault(call.get("index", len(self.tool_calls)), {"name": "", "arguments": ""})
        function = call.get("function") or {}
        kept["name"] += function.get("name") or ""
        kept["arguments"] += function.get("arguments") or ""

    def final(self, now: float) -> dict[str, Any]:
        """The last object: done, why, and the figures (the engine's timings, in nanoseconds)."""
        out: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message = self._message("".join(self.text), "".join(self.thinking))["message"]
            if self.tool_calls:
                message["tool_calls"] = [self._tool_call(c) for _, c in sorted(self.tool_calls.items())]
            out["message"] = message
        else:
            out["response"] = "".join(self.text)
            if self.thinking:
                out["thinking"] = "".join(self.thinking)
        t, usage = self.timings, self.usage
        prompt = t.get("prompt_n")
        if prompt is None:
            prompt = usage.get("prompt_tokens", 0)
        else:
            prompt += t.get("cache_n", 0)
        generated = t.get("predicted_n", usage.get("completion_tokens", 0))
        out.update(
            done=True,
            done_reason=self.done_reason or "stop",
            total_duration=ns(now - self.started),
            load_duration=ns(self.load_s),
            prompt_eval_count=prompt,
            prompt_eval_duration=ns(t.get("prompt_ms", 0) / 1000),
            eval_count=generated,
            eval_duration=ns(t.get("predicted_ms", 0) / 1000),
        )
        return out

    def _message(self, content: str, thinking: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if self.chat:
            return {"model": self.model, "created_at": created_at(), "message": message}
        out: dict[str, Any] = {"model": self.model, "created_at": created_at(), "response": content}
        if thinking:
            out["thinking"] = thinking
        return out

    def _line(self, obj: dict[str, Any]) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    @staticmethod
    def _tool_call(kept: dict[str, Any]) -> dict[str, Any]:
        try:
            arguments = json.loads(kept["arguments"] or "{}")
        except ValueError:
            arguments = kept["arguments"]
        return {"function": {"name": kept["name"], "arguments": arguments}}

    # --- whole ------------------------------------------------------------------------------

    def whole(self, engine: dict[str, Any], now: float) -> dict[str, Any]:
        """The engine's whole answer (not streamed) as Ollama's one object."""
        self.timings = engine.get("timings") or {}
        self.usage = engine.get("usage") or {}
        choices = engine.get("choices") or [{}]
        choice = choices[0]
        if choice.get("finish_reason"):
            self.done_reason = DONE_REASONS.get(choice["finish_reason"], choice["finish_reason"])
        message = choice.get("message")
        if isinstance(message, dict):
            self.text = [message.get("content") or ""]
            if message.get("reasoning_content"):
                self.thinking = [message["reasoning_content"]]
            for i, call in enumerate(message.get("tool_calls") or ()):
                self._tool_piece({"index": i, **call})
        else:
            self.text = [choice.get("text") or ""]
        return self.final(now)

    def final_line(self, now: float) -> bytes:
        return self._line(self.final(now))


class EventLines:
    """The engine's SSE stream, fed as it arrives (any cut between reads), as Ollama's NDJSON
    lines: `feed` returns the lines of the events it completed; `over` once `data: [DONE]` came."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.pending = b""
        self.over = False

    def feed(self, data: bytes) -> bytes:
        pending = self.pending + data
        cut = pending.rfind(b"\n\n")
        if cut < 0 or self.over:
            self.pending = pending
            return b""
        self.pending = pending[cut + 2 :]
        out = b""
        for event in pending[:cut].split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        self.over = True
                        return out
                    out += self._data(payload)
                elif line.startswith(b"error:"):  # llama-server's own error event
                    out += error_line(error_message(line[6:].strip()))
        return out

    def _data(self, payload: bytes) -> bytes:
        if (token := _TOKEN_EVENT.match(payload)) is not None:
            return self.answer.literal_line(token.group(1))
        try:
            data = json.loads(payload)
        except ValueError:
            return b""
        if not isinstance(data, dict):
            return b""
        if "error" in data:
            error = data["error"]
            return error_line(error.get("message", "") if isinstance(error, dict) else str(error))
        return self.answer.event_lines(data)


def error_line(message: str, code: str | None = None) -> bytes:
    """A stream's error as Ollama sends it: a line of its own."""
    body: dict[str, Any] = {"error": message}
    if code:
        body["code"] = code
    return json.dumps(body, ensure_ascii=False).encode() + b"\n"
