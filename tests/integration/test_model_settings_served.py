"""docs/models.md's config examples, as written, served by a real daemon and engine.

The "Several models" example (its `~/models/...` files are tiny models under a test HOME, the
embedding one stating its pooling as nomic-embed-text's GGUF does) and the "Per-model
settings" example: the `[models.embed]` section, with no `kind`, answers /v1/embeddings; the
`[models.assistant]` section (model "smollm2", a name Stoker knows, pulled on its first request
from a loopback index) is reached by its alias and answers with that name, its server started
with the section's settings.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from tests.integration.daemon_harness import DaemonProcess, free_port, write_config
from tests.integration.model_sources import pip_env

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def example(marker: str) -> str:
    """The docs' TOML block that holds `marker`, as written."""
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", DOCS.read_text(), re.S) if marker in b]
    return block


def argv_of(alias: str) -> list[str]:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].endswith("llama-server") and alias in cmdline:
            return cmdline
    raise AssertionError(f"no llama-server runs with --alias {alias}")


def test_the_docs_examples_serve_an_embedding_model_and_settings_as_written(
    stoker_home, installed_cpu_bundle, smol_index, tmp_path
):
    home = tmp_path / "user"
    write_tiny_model(home / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    write_tiny_model(home / "models" / "nomic-embed-text-v1.5.Q8_0.gguf", seed=3, pooling=1)
    port = free_port()
    d = DaemonProcess(stoker_home, env={"HOME": str(home), **pip_env(smol_index)})
    several, settings = example("[models.embed]"), example("[models.assistant]")
    write_config(d.paths, f"{several}\n{settings}\n[frontdoor]\nport = {port}\n")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        d.start()
        embedded = httpx.post(f"{base}/embeddings", json={"model": "embed", "input": "hello"}, timeout=120)
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"][0]["embedding"]) == 128  # the tiny model's width
        assert "--embeddings" in argv_of("embed")  # by itself: its header states its pooling
        client = openai.OpenAI(base_url=base, api_key="unused", timeout=120, max_retries=0)
        answer = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert answer.model == "gpt-4o-mini"  # the name sent, not the section's NAME
        streamed = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
        )
        assert {chunk.model for chunk in streamed} == {"gpt-4o-mini"}
        argv = " ".join(argv_of("assistant"))
        for flags in ("--temp 0.2", "--top-k 40", "--chat-template chatml", "--batch-size 256", "-c 2048"):
            assert flags in argv, argv
        assert re.search(r"(-t|--threads) 2\b", argv), argv
        listed = {m["id"]: m for m in httpx.get(f"{base}/models", timeout=10).json()["data"]}
        assert "gpt-4o-mini" in listed["assistant"]["stoker"]["aliases"]
        assert listed["embed"]["stoker"]["pinned"] and listed["code"]["stoker"]["loads_on_demand"]
    finally:
        d.stop()
