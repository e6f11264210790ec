"""Ollama's API through the official `ollama` Python client and litellm's `ollama_chat/` provider,
against a real daemon and llama-server (the tiny generated model), on a free port of its own.

Chat (whole, streamed, JSON mode and a JSON schema), generate (whole and streamed, raw), embed
and the legacy embeddings, list, show, ps, version, a pull from a loopback Hugging Face hub with
Ollama's progress objects, delete; keys; the probe of `/`; and `stoker status` when another
program holds the port.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import subprocess
from pathlib import Path

import click
import httpx
import pytest

from stoker.daemon.control.status_text import format_status

from tests.integration.daemon_harness import DaemonProcess, free_port, tiny_config, write_config
from tests.integration.model_sources import HF_REPO, FakeHub, HubRepo

pytestmark = [pytest.mark.engine]

ollama = pytest.importorskip("ollama")

DOCS_URL = "http://127.0.0.1:11434"  # the address docs/ollama.md's examples use


def start(daemon: DaemonProcess, model: Path, *, ollama_port: int | None = None, extra: str = "") -> str:
    """Start `daemon` with the front door and Ollama's API on free ports; Ollama's URL. The
    engine serves embeddings too (`--embeddings`)."""
    port = ollama_port or free_port()
    text = tiny_config(model, ollama_port=port, extra_args=["--embeddings", "--pooling", "mean"])
    text += extra + f"[frontdoor]\nport = {free_port()}\n"
    write_config(daemon.paths, text)
    daemon.start()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def other_model(tmp_path):
    """A second tiny model (other weights), loaded on demand by an Ollama request."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path / "other" / "other.gguf", seed=7)


def test_ollama_client_chat_generate_embed_list_show_ps(daemon, model, other_model):
    sections = f'[models.chat]\nmodel = "{model}"\ndefault = true\n[models.embed]\nmodel = "{other_model}"\n'
    url = start(daemon, model, extra=sections)
    daemon.wait_for(lambda s: any(m["state"] == "ready" for m in s["models"]), what="the chat model ready")
    client = ollama.Client(host=url, trust_env=False)
    greedy = {"temperature": 0, "num_predict": 6, "seed": 1}

    reply = client.chat(model="chat", messages=[{"role": "user", "content": "hi"}], options=greedy)
    assert reply.done and reply.done_reason in ("stop", "length") and reply.model == "chat"
    assert reply.message.role == "assistant" and isinstance(reply.message.content, str)
    assert reply.eval_count and 1 <= reply.eval_count <= 6 and reply.prompt_eval_count
    assert reply.total_duration and reply.total_duration > 0 and reply.eval_duration and reply.created_at

    parts = list(client.chat(model="chat", messages=[{"role": "user", "content": "hi"}], options=greedy, stream=True))
    assert len(parts) >= 2 and not any(p.done for p in parts[:-1])  # lines as tokens come, then the last one
    last = parts[-1]
    # A token that is part of a UTF-8 character comes with the next one: at most a line per token.
    assert last.done and last.done_reason and 1 <= len(parts) - 1 <= last.eval_count == reply.eval_count
    assert "".join(p.message.content for p in parts) == reply.message.content  # greedy: the same answer

    # `num_predict` reaches the engine; `stop` and JSON mode are accepted.
    short = client.chat(
        model="chat", messages=[{"role": "user", "content": "hi"}], options={**greedy, "num_predict": 2}
    )
    assert short.eval_count == 2 and short.done_reason == "length"
    # A schema whose one answer is known: the grammar the engine builds from it leaves no other.
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    structured = client.chat(
        model="chat", messages=[{"role": "user", "content": "a?"}], format=schema, options={"num_predict": 64}
    )
    assert json.loads(structured.message.content) == {"a": "x"}
    # JSON mode is the engine's grammar of any object, as the OpenAI route gives it (greedy: the same answer).
    as_json = client.generate(model="chat", prompt="x", format="json", options=greedy)
    openai_json = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "chat",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 6,
            "temperature": 0,
            "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}},
        },
        trust_env=False,
        timeout=60,
    ).json()
    assert as_json.response == openai_json["choices"][0]["message"]["content"]
    unconstrained = client.generate(model="chat", prompt="x", options=greedy)
    assert as_json.response != unconstrained.response

    generated = client.generate(model="chat", prompt="Once", options=greedy)
    assert generated.done and isinstance(generated.response, str) and generated.eval_count
    pieces = list(client.generate(model="chat", prompt="Once", options=greedy, stream=True))
    assert pieces[-1].done and "".join(p.response for p in pieces) == generated.response
    raw = client.generate(model="chat", prompt="Once", raw=True, options=greedy)
    assert raw.done and raw.eval_count

    listed = client.list()
    names = {m.model for m in listed.models}
    assert names == {"chat", "embed"}, names
    v1 = httpx.get(f"{url}/v1/models", trust_env=False).json()  # the OpenAI routes on Ollama's port too
    assert {m["id"] for m in v1["data"]} == names
    entry = next(m for m in listed.models if m.model == "chat")
    assert entry.size == model.stat().st_size and entry.details.format == "gguf"

    shown = client.show("chat:latest")  # Ollama's clients add the tag
    assert shown.details.format == "gguf" and "completion" in (shown.capabilities or [])

    running = client.ps()
    assert "chat" in {m.model for m in running.models}

    vectors = client.embed(model="embed", input=["The sky", "is blue"])
    assert len(vectors.embeddings) == 2 and len(vectors.embeddings[0]) > 8
    legacy = client.embeddings(model="embed", prompt="The sky")
    assert len(legacy.embedding) == len(vectors.embeddings[0])
    assert "embed" in {m.model for m in client.ps().models}  # loaded on demand, as any request

    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error

    assert httpx.get(url, trust_env=False).text == "Ollama is running"
    assert httpx.head(url, trust_env=False).status_code == 200
    assert httpx.get(f"{url}/api/version", trust_env=False).json()["version"]

    # What went through Ollama's routes is counted as the OpenAI routes' requests are.
    metrics = httpx.get(f"{url}/metrics", trust_env=False).text
    assert 'stoker_requests_total{code="200",route="/api/chat"}' in metrics
    assert 'stoker_generated_tokens_total{route="/api/chat"}' in metrics


def test_litellm_ollama_chat_provider(daemon, model):
    litellm = pytest.importorskip("litellm")
    url = start(daemon, model)
    daemon.wait_state("ready")
    messages = [{"role": "user", "content": "hi"}]
    reply = litellm.completion(model="ollama_chat/default", messages=messages, api_base=url, max_tokens=4)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1
    stream = litellm.completion(
        model="ollama_chat/default", messages=messages, api_base=url, max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert len(chunks) >= 2 and any(c.choices[0].delta.content for c in chunks)
    vectors = litellm.embedding(model="ollama/default", input=["hi"], api_base=url)
    assert vectors.data  # the chat model's server embeds too (its /v1/embeddings)

    # The examples of docs/ollama.md, run as they are written but for the address.
    page = (Path(__file__).resolve().parents[2] / "docs" / "ollama.md").read_text()
    python = re.findall(r"```python\n(.*?)```", page, re.S)
    shell = re.findall(r"```sh\n(.*?)```", page, re.S)
    assert len(python) == 3 and len(shell) == 1
    for example in python:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(example.replace(DOCS_URL, url), {})
        assert out.getvalue().strip(), example
    answer = subprocess.run(
        shell[0].replace(DOCS_URL, url), shell=True, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(answer.stdout)["done"] is True


@pytest.fixture
def fake_hub(tiny_model):
    hub = FakeHub({HF_REPO: HubRepo({"tiny-Q4_K_M.gguf": Path(tiny_model).read_bytes()})}).start()
    yield hub
    hub.stop()


def test_pull_streams_progress_then_delete(daemon, model, fake_hub):
    daemon.env["HF_ENDPOINT"] = fake_hub.endpoint
    url = start(daemon, model)
    client = ollama.Client(host=url, trust_env=False)
    progress = list(client.pull(f"hf.co/{HF_REPO}:Q4_K_M", stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    assert any(p.total and p.completed is not None for p in progress), progress  # bytes counted as they came
    name = f"{HF_REPO}:Q4_K_M"  # the catalog's name for it, as `stoker pull` gives it
    catalog = daemon.call("model.list")["models"]
    assert any(m["name"] == name for m in catalog), catalog
    assert client.pull(f"hf.co/{HF_REPO}:Q4_K_M", stream=False).status == "success"  # already there: at once

    assert client.delete(f"hf.co/{name}").status == "success"  # the name pulled, as Ollama's clients keep it
    assert not any(m["name"] == name for m in daemon.call("model.list")["models"])
    with pytest.raises(ollama.ResponseError) as gone:
        client.delete(name)
    assert gone.value.status_code == 404


def test_keys_are_asked_of_ollama_clients_too(daemon, model):
    url = start(daemon, model)
    text = daemon.paths.config_file.read_text().replace("[frontdoor]\n", "[frontdoor]\nrequire_keys = true\n")
    daemon.stop()
    write_config(daemon.paths, text)
    daemon.start()
    key = daemon.call("key.create", name="ollama-test")["key"]
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=url, trust_env=False).list()
    assert refused.value.status_code == 401
    keyed = ollama.Client(host=url, trust_env=False, headers={"Authorization": f"Bearer {key}"})
    assert len(keyed.list().models) == 1


def test_status_says_when_another_program_holds_the_port(daemon, model):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        start(daemon, model, ollama_port=port)
        status = daemon.call("status")
        assert status["ollama"]["url"] is None and status["ollama"]["reason"] == "ollama_port_taken"
        assert f"127.0.0.1:{port}" in status["ollama"]["message"]
        assert status["frontdoor"]["url"]  # the rest serves on
    shown = click.unstyle(format_status(status))
    assert f"ollama    not listening: ollama_port_taken: 127.0.0.1:{port}: cannot listen" in shown, shown


def test_json_lines_are_ollamas(daemon, model):
    """The raw stream: one JSON object per line, Ollama's field names, the last one `done`."""
    url = start(daemon, model)
    daemon.wait_state("ready")
    # Greedy and seeded: the random tiny model, sampled, may say its end-of-text within 3 tokens.
    options = {"num_predict": 3, "temperature": 0, "seed": 1}
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "options": options}
    with httpx.stream("POST", f"{url}/api/chat", json=body, trust_env=False) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert all(set(line) >= {"model", "created_at", "message", "done"} for line in lines)
    final = lines[-1]
    assert final["done"] is True and final["done_reason"] == "length" and final["eval_count"] == 3
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int), key


@pytest.fixture
def long_model(tmp_path):
    """A tiny model trained on 1024 tokens of context, whose server the config gives 256."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path / "long" / "long.gguf", n_ctx=1024)


def test_num_ctx_restarts_the_server_with_a_larger_context_that_lasts(daemon, long_model):
    url = start(daemon, long_model)
    before = daemon.wait_state("ready")
    assert before["n_ctx"] == 256 and before["models"][0]["n_ctx"] == 256
    client = ollama.Client(host=url, trust_env=False)
    long_prompt = [{"role": "user", "content": " ".join(["fire"] * 70)}]  # about 380 tokens: more than 256
    with pytest.raises(ollama.ResponseError) as overflow:  # what an Ollama user got with num_ctx ignored
        client.chat(model="default", messages=long_prompt, options={"num_predict": 2})
    assert overflow.value.status_code == 400

    # At or below the server's context (and the options Stoker's plan decides): served as it is.
    same = {"num_ctx": 256, "num_gpu": 99, "num_thread": 2, "num_batch": 64, "num_predict": 2}
    assert client.chat(model="default", messages=[{"role": "user", "content": "hi"}], options=same).done
    assert daemon.call("status")["pid"] == before["pid"]

    # Larger: the server is restarted with it, then the request is answered.
    reply = client.chat(model="default", messages=long_prompt, options={"num_ctx": 512, "num_predict": 2})
    assert reply.done and 256 < reply.prompt_eval_count < 512, reply
    status = daemon.call("status")
    assert status["state"] == "ready" and status["pid"] != before["pid"]
    assert status["n_ctx"] == 512 and status["models"][0]["n_ctx"] == 512
    assert "   context 512" in click.unstyle(format_status(status))  # `stoker status`
    (loaded,) = client.ps().models
    assert loaded.context_length == 512
    restart = daemon.history(machine="launch", limit=50)
    asked = [row for row in restart if row["event"] == "ContextRequested"]
    assert len(asked) == 1 and asked[0]["evidence"]["num_ctx"] == 512, asked

    # It lasts while the server runs: a smaller num_ctx, or none, restarts nothing.
    for options in ({"num_ctx": 400, "num_predict": 2}, {"num_predict": 2}):
        assert client.chat(model="default", messages=long_prompt, options=options).done
    assert daemon.call("status")["pid"] == status["pid"]
    # Never above what the model was trained on.
    client.chat(model="default", messages=[{"role": "user", "content": "hi"}], options={"num_ctx": 100_000})
    assert daemon.wait_state("ready")["n_ctx"] == 1024
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model="default", messages=[{"role": "user", "content": "hi"}], options={"num_ctx": "8k"})
    assert bad.value.status_code == 400 and "num_ctx" in bad.value.error

    # Stopped for good, it loads with its config's context again.
    daemon.call("down")
    daemon.call("up")
    assert daemon.wait_state("ready")["n_ctx"] == 256


def test_a_num_ctx_whose_server_does_not_fit_is_refused_with_the_placements_reason(daemon, tmp_path):
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "wide" / "wide.gguf", n_ctx=65536)
    # A few MiB hold the server at 256 tokens; its KV cache at 65536 takes tens more.
    url = start(daemon, model, extra="[placement]\nmax_ram_mib = 12\n")
    before = daemon.wait_state("ready")
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "options": {"num_ctx": 65536, "num_predict": 2},
    }
    refused = httpx.post(f"{url}/api/chat", json=body, trust_env=False, timeout=60)
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    answer = refused.json()
    assert answer["code"] == "placement_no_room" and "max_ram_mib" in answer["error"], answer
    assert daemon.call("status")["reason"] == "placement_no_room"

    # The larger context is forgotten: the next request loads the model with its config's.
    client = ollama.Client(host=url, trust_env=False)
    assert client.chat(model="default", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}).done
    after = daemon.call("status")
    assert after["state"] == "ready" and after["n_ctx"] == before["n_ctx"] == 256
