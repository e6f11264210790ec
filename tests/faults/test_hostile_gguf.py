"""Hostile GGUF headers (tests/hostile_gguf.py: arrays nested 100,000 deep, a string running
past the end of the file, version 999, a truncated last array, counts of 2^64...) against the
real daemon and the real CLI: a hot reload to each is refused at the pre-check while the healthy
server serves on and the daemon lives; `stoker pull` of one fails as pull_not_gguf.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stoker.daemon.engine.chat import chat_once
from tests.hostile_gguf import write_corpus
from tests.integration.daemon_harness import tiny_config, write_config


@pytest.mark.engine
def test_a_reload_to_any_hostile_header_keeps_the_healthy_server_and_the_daemon(daemon, model, tmp_path):
    d = daemon.start()
    serving = d.wait_state("ready")
    for name, path in write_corpus(tmp_path / "corpus").items():
        write_config(d.paths, tiny_config(path))
        st = d.wait_for(
            lambda s: not s["config"]["valid"] and any(str(path) in p for p in s["config"]["problems"]),
            30,
            f"the reload to the {name} header refused",
        )
        assert d.proc is not None and d.proc.poll() is None, f"the daemon died on {name}"
        assert (st["state"], st["pid"], st["model"]) == ("ready", serving["pid"], serving["model"]), (name, st)
        (problem,) = st["config"]["problems"]
        assert "not a GGUF file" in problem, (name, problem)
    assert d.history(machine="config", limit=1)[0]["reason"] == "model_load_failed"
    answer = chat_once(serving["endpoint"], serving["api_key"], "Hello", max_tokens=2, timeout=60)
    assert answer["tokens"] >= 1
    assert "Traceback" not in d.log_text()


@pytest.mark.parametrize("case", ["arrays-nested-100000-deep", "string-past-end-of-file", "version-999"])
def test_stoker_pull_of_a_hostile_header_fails_as_not_a_gguf(stoker_home, tmp_path, case):
    path = write_corpus(tmp_path)[case]
    env = {**os.environ, "STOKER_HOME": str(stoker_home)}
    done = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "pull", str(path), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    answer = "\n".join(line for line in done.stdout.splitlines() if not line.startswith('{"progress"'))
    error = json.loads(answer)["error"]
    assert error["reason"] == "pull_not_gguf", error
    assert "RecursionError" not in done.stdout + done.stderr
