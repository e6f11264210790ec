"""The front door's access log, as a user reads it: `stoker logs --access`.

A real daemon and llama-server; requests through the front door (a streamed and a plain chat
with a user key, an unknown model, the models list); then `stoker logs --access` must show one
line per request with its route, status, model, instance, timings, token counts and the key's
name, and the daemon's log must hold neither the prompt nor the key itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from tests.integration.daemon_harness import start_with_frontdoor

pytestmark = [pytest.mark.engine]

# A prompt no log line would hold by chance.
PROMPT = "Tell me about the violet heron of Quaxmoor, codeword 5318008."


def stoker(daemon, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], env=daemon.env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def test_each_request_has_an_access_line_without_its_prompt(daemon, model):
    base = start_with_frontdoor(daemon, model)
    daemon.wait_state("ready")
    key = daemon.call("key.create", name="webui")["key"]
    auth = {"Authorization": f"Bearer {key}"}
    chat = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "ignore_eos": True}
    with httpx.Client(base_url=base, trust_env=False, timeout=60) as client:
        plain = client.post("/chat/completions", json=chat, headers=auth)
        assert plain.status_code == 200, plain.text
        with client.stream("POST", "/chat/completions", json={**chat, "stream": True}, headers=auth) as stream:
            assert stream.status_code == 200
            streamed = b"".join(stream.iter_bytes())
        assert b"[DONE]" in streamed
        missing = client.post("/chat/completions", json={**chat, "model": "no such model"})
        assert missing.status_code == 404
        assert client.get("/models").status_code == 200

    lines = stoker(daemon, "logs", "--access", "-n", "10").splitlines()
    assert len(lines) == 4, lines  # one per request, nothing else of the daemon's log
    plain_line, stream_line, missing_line, models_line = lines
    for line in (plain_line, stream_line):
        assert " POST /v1/chat/completions 200 " in line, line
        got = fields(line)
        assert (got["model"], got["instance"], got["key"]) == ("default", "default", "webui"), line
        assert int(got["tokens_out"]) == 6 and int(got["tokens_in"]) > 0, line
        assert float(got["duration_ms"]) >= float(got["ttfb_ms"]) > 0, line
        # The front door's own share of that first byte, the engine's time left out.
        assert 0 < float(got["added_ms"]) < float(got["ttfb_ms"]), line
        assert got["client"].startswith("127.0.0.1:"), line
    # The same prompt counts the same, whether the engine evaluated it or found it in its cache.
    assert fields(plain_line)["tokens_in"] == fields(stream_line)["tokens_in"], (plain_line, stream_line)
    assert " POST /v1/chat/completions 404 " in missing_line, missing_line
    got = fields(missing_line)
    assert (got["model"], got["instance"], got["key"], got["tokens_out"], got["added_ms"]) == (
        '"no',  # a model name with spaces is quoted (one word per field: the line cannot be forged)
        "-",
        "-",
        "-",
        "-",  # no engine asked
    ), missing_line
    assert '"no such model"' in missing_line
    assert " GET /v1/models 200 " in models_line, models_line

    # --json: the same lines, as data.
    (log,) = json.loads(stoker(daemon, "logs", "--access", "-n", "2", "--json"))["logs"]
    assert log["log"] == "access" and log["lines"] == lines[-2:], log

    everything = daemon.paths.logs_dir.joinpath("daemon.log").read_text()
    assert "Quaxmoor" not in everything and "5318008" not in everything  # never the prompt
    assert key not in everything and key[len("sk-stoker-") :][:16] not in everything  # never the key
    answer = plain.json()["choices"][0]["message"]["content"]
    if len(answer.strip()) >= 12:  # long enough not to appear by chance
        assert answer not in everything


def test_stoker_chat_answers_are_counted_whole(daemon, model):
    start_with_frontdoor(daemon, model)
    daemon.wait_state("ready")
    for turn in (1, 2):
        # The random tiny model may say its end-of-text at once, or only parts of a character:
        # the answer's text can be empty, its token count cannot.
        said = json.loads(stoker(daemon, "chat", "--json", "--max-tokens", "5", PROMPT))
        # Read at once: the line is written as the answer's last byte leaves, not after.
        line = stoker(daemon, "logs", "--access", "-n", "1").splitlines()[-1]
        assert " POST /v1/chat/completions 200 " in line, line
        assert " cut=" not in line, line  # the client read the answer to its end
        got = fields(line)
        assert int(got["tokens_out"]) == said["tokens"] >= 1 and int(got["tokens_in"]) > 0, (turn, line, said)
