"""Pulls under faults: a download killed with its process (the CLI's, the daemon's) resumes
without fetching again what is on disk (proved by the Range requests the loopback Hub logged),
a corrupted download is refused and removed, a full disk is refused before a byte is fetched.

The Hub is a loopback server (tests/integration/model_sources.py); the loading code is the real
huggingface_hub, and the daemon and CLI are the real ones (docs/reliability.md, "Model pulls").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models import hub as H
from stoker.daemon.models.pull import PullOptions
from stoker.states.reasons import ReasonCode
from tests.integration.model_sources import HF_REPO, FakeHub, HubRepo, sha256
from tests.waits import wait_until


async def test_a_corrupted_download_is_refused_removed_and_not_cataloged(service, tiny_bytes):
    svc = service
    fake_hub = FakeHub({HF_REPO: HubRepo({"tiny-Q8_0.gguf": tiny_bytes})}, corrupt={"tiny-Q8_0.gguf"}).start()
    try:
        with trio.fail_after(60), pytest.raises(StokerError) as err:
            await svc.pull(f"{HF_REPO}:Q8_0", options=PullOptions(hub=H.HubOptions(endpoint=fake_hub.endpoint)))
    finally:
        fake_hub.stop()
    assert err.value.reason is ReasonCode.PULL_CHECKSUM_MISMATCH
    assert err.value.evidence["expected_sha256"] == sha256(tiny_bytes) != err.value.evidence["actual_sha256"]
    assert svc.models() == []
    leftovers = [p for p in svc.paths.models_dir.rglob("*") if p.is_file()]
    assert leftovers == [], leftovers  # the partial file went with the refusal


def _mount_small_disk(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()!r}): needs CAP_SYS_ADMIN")


async def test_a_model_larger_than_the_free_disk_is_refused_before_a_byte_is_fetched(service, big_model):
    svc = service
    data = big_model.read_bytes()
    _mount_small_disk(svc.paths.models_dir, "40m")  # 22 MB model + the 64 MiB Stoker keeps spare > 40 MB
    fake_hub = FakeHub({"stoker-test/big-GGUF": HubRepo({"big-Q8_0.gguf": data})}).start()
    try:
        with trio.fail_after(60), pytest.raises(StokerError) as err:
            await svc.pull("stoker-test/big-GGUF", options=PullOptions(hub=H.HubOptions(endpoint=fake_hub.endpoint)))
        assert err.value.reason is ReasonCode.PULL_DISK_FULL
        assert err.value.evidence["needed_bytes"] == len(data) and err.value.evidence["free_bytes"] < 41 * 2**20
        assert fake_hub.ranges() == [] and svc.models() == []  # nothing was downloaded
    finally:
        fake_hub.stop()
        subprocess.run(["umount", "-l", str(svc.paths.models_dir)], capture_output=True)


def stoker(env: dict[str, str], *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "stoker.daemon", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def wait_part(models_dir: Path, at_least: int, proc: subprocess.Popen | None = None, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parts = list((models_dir / ".partial").glob("*.part"))
        if parts and parts[0].stat().st_size >= at_least:
            return parts[0].stat().st_size
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"stoker exited early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError("the download never reached the size to kill it at")


@pytest.mark.slow
def test_a_cli_pull_killed_mid_download_resumes_without_fetching_the_bytes_again(stoker_home, big_model):
    data = big_model.read_bytes()
    hub = FakeHub({"stoker-test/big-GGUF": HubRepo({"big-Q8_0.gguf": data})}, throttle=4 * 2**20).start()
    try:
        env = {**os.environ, "STOKER_HOME": str(stoker_home), "HF_ENDPOINT": hub.endpoint}
        paths = StokerPaths.from_env(env)
        first = stoker(env, "pull", "stoker-test/big-GGUF:Q8_0", "--json")
        kept = wait_part(paths.models_dir, 10 * 2**20, first)  # no daemon runs: the CLI pulls itself
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        hub.throttle = None
        second = stoker(env, "pull", "stoker-test/big-GGUF:Q8_0", "--json")
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        lines = [json.loads(line) for line in out.splitlines()]
        model = lines[-1]["model"]
        assert Path(model["path"]).read_bytes() == data and model["sha256"] == sha256(data)
        assert any("progress" in line for line in lines[:-1])
        ranges = hub.ranges()
        assert ranges[0] is None and len(ranges) == 2, ranges
        resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
        assert resumed_at >= kept, (resumed_at, kept)  # what was on disk was not fetched again
    finally:
        hub.stop()


@pytest.mark.slow
@pytest.mark.engine
def test_a_daemon_killed_mid_pull_resumes_it_at_start_and_serves_the_model(daemon, big_model, tiny_bytes):
    from tests.integration.daemon_harness import tiny_config, write_config

    data = big_model.read_bytes()
    hub = FakeHub(
        {"stoker-test/big-GGUF": HubRepo({"big-Q8_0.gguf": data}), HF_REPO: HubRepo({"tiny-Q8_0.gguf": tiny_bytes})},
        throttle=4 * 2**20,
    ).start()
    try:
        daemon.start()
        env = {**daemon.env, "HF_ENDPOINT": hub.endpoint}
        cli = stoker(env, "pull", "stoker-test/big-GGUF:Q8_0", "--json")
        kept = wait_part(daemon.paths.models_dir, 10 * 2**20, cli)
        # The CLI first: left alone, a CLI whose daemon dies finishes the pull itself.
        cli.send_signal(signal.SIGKILL)
        cli.wait(10)
        daemon.kill9()
        hub.throttle = None
        daemon.start()  # resumes the pull at start, with the daemon's HF_ENDPOINT unset: the URL is pinned
        listing = wait_until(
            lambda: (found := daemon.call("model.list"))["models"] and found,
            timeout=60,
            what="the resumed pull in the model list",
            detail=lambda: daemon.log_text()[-3000:],
        )
        [model] = listing["models"]
        assert model["name"] == "stoker-test/big-GGUF:Q8_0" and model["sha256"] == sha256(data)
        ranges = hub.ranges()
        assert ranges[0] is None and len(ranges) == 2, ranges
        assert int(ranges[1].removeprefix("bytes=").rstrip("-")) >= kept
        assert "resumed_from" in json.dumps(daemon.history(machine="pull:stoker-test/big-GGUF:Q8_0", limit=20))

        # The pulled tiny model, served by the real engine through its catalog path.
        done = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "pull", f"{HF_REPO}:Q8_0", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        pulled = json.loads(done.stdout.splitlines()[-1])["model"]
        write_config(daemon.paths, tiny_config(Path(pulled["path"])))
        status = daemon.wait_for(
            lambda s: s["state"] == "ready" and s.get("model") == pulled["path"], 60, "the pulled model served"
        )
        assert status["state"] == "ready"
        with pytest.raises(StokerError) as err:
            daemon.call("model.rm", name=f"{HF_REPO}:Q8_0")
        assert err.value.reason is ReasonCode.MODEL_IN_USE and Path(pulled["path"]).exists()
        removed = daemon.call("model.rm", name="stoker-test/big-GGUF:Q8_0")
        assert removed["deleted"] == model["path"] and not Path(model["path"]).exists()
    finally:
        hub.stop()
