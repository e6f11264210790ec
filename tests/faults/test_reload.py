"""A hot reload to a model that cannot load keeps the healthy server serving, and says why.

The fault: a config edit pointing server.model at a bad file stopped the serving server first and
only then found the model unusable. The model file is checked before anything is stopped (exists,
regular file, GGUF magic, readable header); the config machine rejects the change (status shows
the problem, history records it) and the next save of the file is read again.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from stoker.daemon.engine.chat import chat_once
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config

pytestmark = [pytest.mark.engine]


def refused(d: DaemonProcess, model_path, serving: dict) -> dict:
    """Point the config at `model_path`; the daemon refuses it and the same server serves on."""
    write_config(d.paths, tiny_config(model_path))
    st = d.wait_for(lambda s: not s["config"]["valid"], 30, f"the reload to {model_path} refused")
    time.sleep(0.5)  # what used to happen next: the server stopped for the relaunch
    st = d.call("status")
    assert (st["state"], st["pid"], st["model"]) == ("ready", serving["pid"], serving["model"]), st
    answer = chat_once(st["endpoint"], st["api_key"], "Hello", max_tokens=2, timeout=60)
    assert answer["tokens"] >= 1
    (problem,) = st["config"]["problems"]
    assert problem.startswith("server.model: "), problem
    return {"problem": problem, "history": d.history(machine="config", limit=1)[0]}


def test_a_reload_to_a_bad_model_keeps_serving_and_reports_the_problem(daemon, model, tmp_path):
    d = daemon.start()
    serving = d.wait_state("ready")

    missing = refused(d, tmp_path / "nowhere.gguf", serving)
    assert "does not exist" in missing["problem"]
    assert (missing["history"]["to_state"], missing["history"]["reason"]) == ("invalid", "model_missing")

    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("this is no model\n" * 100)
    assert "not a GGUF file" in refused(d, not_gguf, serving)["problem"]

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(model.read_bytes()[:200])  # the magic, then a header cut short
    bad_header = refused(d, truncated, serving)
    assert "header" in bad_header["problem"] and bad_header["history"]["reason"] == "model_load_failed"

    directory = tmp_path / "dir.gguf"
    directory.mkdir()
    assert "is a directory" in refused(d, directory, serving)["problem"]

    # Fixing the file in place (the config unchanged) and saving the config again is read again.
    shutil.copy(model, truncated)
    os.utime(d.paths.config_file)
    write_config(d.paths, tiny_config(truncated))
    st = d.wait_for(lambda s: s["config"]["valid"] and s["state"] == "ready" and s["model"] == str(truncated), 60)
    assert st["pid"] != serving["pid"]  # relaunched on the new model
    assert d.history(machine="config", limit=1)[0]["to_state"] == "valid"
