"""A hostile Hub (an HF_ENDPOINT mirror, or a repository listing someone altered) names a file
that would land outside the models directory: `../x.gguf`, an absolute path, a directory that
is a link leading out. The pull is refused with pull_unsafe_path before a byte is written, and
`stoker rm` never deletes outside the models directory, even for a catalog row whose path
climbs out with `..`. `stoker rm` says what it deleted and what it kept, and why.

The Hub is the loopback one (tests/integration/model_sources.py) with the real huggingface_hub
underneath; the CLI is the real one, pulling in its own process (no daemon runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models import hub as H
from stoker.daemon.models.pull import PullOptions, PullService
from stoker.states.reasons import ReasonCode
from tests.integration.model_sources import HF_REPO, FakeHub, HubRepo


def _files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _hostile_names(outside: Path) -> dict[str, str]:
    return {
        "climbs": "../../../../outside/escape-Q8_0.gguf",
        "climbs-midway": "sub/../../../../../outside/escape-Q8_0.gguf",
        "absolute": str(outside / "escape-Q8_0.gguf"),
        "through-a-link": "link/escape-Q8_0.gguf",  # models/hf/ORG/REPO/link -> outside
    }


@pytest.mark.parametrize("case", ["climbs", "climbs-midway", "absolute", "through-a-link"])
async def test_a_hub_file_named_outside_the_models_directory_is_refused_and_nothing_is_written(
    service, tiny_bytes, tmp_path, case
):
    svc = service
    outside = tmp_path / "outside"
    outside.mkdir()
    name = _hostile_names(outside)[case]
    if case == "through-a-link":
        repo_dir = svc.paths.models_dir / "hf" / HF_REPO
        repo_dir.mkdir(parents=True)
        (repo_dir / "link").symlink_to(outside, target_is_directory=True)
    before = _files_under(tmp_path)
    fake_hub = FakeHub({HF_REPO: HubRepo({name: tiny_bytes})}, catch_all=(HF_REPO, name)).start()
    try:
        with trio.fail_after(60), pytest.raises(StokerError) as err:
            await svc.pull(f"{HF_REPO}:Q8_0", options=PullOptions(hub=H.HubOptions(endpoint=fake_hub.endpoint)))
    finally:
        fake_hub.stop()
    assert err.value.reason is ReasonCode.PULL_UNSAFE_PATH, err.value
    assert err.value.evidence["file"] == name and "Nothing was written" in err.value.message
    assert _files_under(tmp_path) == before  # no file appeared anywhere: outside, the models dir, the partials
    assert not list(outside.iterdir()) and svc.models() == []
    assert fake_hub.ranges() == []  # refused before a byte was fetched


async def test_rm_of_a_row_whose_path_climbs_out_deletes_nothing_outside(service, tiny_bytes, tmp_path):
    """A catalog row written by an older Stoker (or edited) whose path is models/hf/../../x:
    text says it is under the models directory, resolution says it is not."""
    svc = service
    fake_hub = FakeHub({HF_REPO: HubRepo({"tiny-Q8_0.gguf": tiny_bytes})}).start()
    try:
        with trio.fail_after(60):
            record = await svc.pull(
                f"{HF_REPO}:Q8_0", options=PullOptions(hub=H.HubOptions(endpoint=fake_hub.endpoint))
            )
    finally:
        fake_hub.stop()
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(tiny_bytes)
    climbing = str(svc.paths.models_dir) + "/.." * len(svc.paths.models_dir.parts) + str(victim)
    assert Path(climbing).resolve() == victim.resolve()
    with svc.store.transaction() as db:
        db.execute("update models set path = ? where name = ?", (climbing, record.name))
        db.execute("update machines set data = json_set(data, '$.path', ?) where kind = 'pull'", (climbing,))
    restarted = PullService(svc.paths, svc.store)  # a daemon started on that database
    removed = await restarted.remove(record.name)
    assert victim.exists(), "rm deleted a file outside the models directory"
    assert removed["deleted"] is None and removed["kept"] == climbing
    assert "outside" in removed["why"]
    assert Path(record.path).exists()  # the real file was not the row's: it stays too


def _stoker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_rm_says_it_kept_a_file_another_name_uses_and_deletes_it_with_the_last_name(stoker_home, tiny_bytes):
    fake_hub = FakeHub({HF_REPO: HubRepo({"tiny-Q8_0.gguf": tiny_bytes})}).start()
    try:
        env = {**os.environ, "STOKER_HOME": str(stoker_home), "HF_ENDPOINT": fake_hub.endpoint}
        for name in ("first", "second"):
            done = _stoker(env, "pull", f"{HF_REPO}:Q8_0", "--name", name, "--json")
            assert done.returncode == 0, done.stderr
        path = json.loads(done.stdout.splitlines()[-1])["model"]["path"]
    finally:
        fake_hub.stop()

    kept = _stoker(env, "rm", "first")
    assert kept.returncode == 0, kept.stderr
    assert Path(path).exists()
    assert "deleted" not in kept.stdout, kept.stdout
    assert f"kept {path}: another name, second, uses it" in kept.stdout, kept.stdout

    as_json = _stoker(env, "rm", "second", "--json")
    assert as_json.returncode == 0, as_json.stderr
    reply = json.loads(as_json.stdout)
    assert reply["deleted"] == path and reply["kept"] is None
    assert not Path(path).exists()
    models = StokerPaths.from_env(env).models_dir
    assert [p for p in models.rglob("*") if p.is_file()] == []
