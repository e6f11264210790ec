"""Snapshots of every main view at fixed sizes, fed recorded daemon answers (deterministic).

Regenerate after an intended change with `pytest tests/integration/test_tui_snapshots.py
--snapshot-update` and review the SVGs in __snapshots__/.
"""

from __future__ import annotations

import time

import pytest

from tests.integration import tui_fakes as fake
from tui.app import StokerApp

EVERYTHING = {"status", "history", "telemetry", "snapshots"}


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """Times render in local time; pin it so the snapshots do not depend on the machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


async def loaded(pilot) -> None:
    app = pilot.app
    for _ in range(200):
        if app.loaded >= EVERYTHING:
            break
        await pilot.pause(0.02)
    await pilot.pause(0.1)


def on_tab(tab: str, *keys: str):
    async def run_before(pilot) -> None:
        await loaded(pilot)
        pilot.app.action_show_tab(tab)
        await pilot.pause(0.1)
        if keys:
            await pilot.press(*keys)
        await pilot.pause(0.1)

    return run_before


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
def test_overview_gpu(snap_compare, size):
    assert snap_compare(StokerApp(fake.cuda_link()), terminal_size=size, run_before=loaded)


def test_overview_gpu_idle(snap_compare):
    app = StokerApp(fake.cuda_link(telemetry=fake.telemetry_cuda_idle()))
    assert snap_compare(app, terminal_size=(80, 24), run_before=loaded)


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
def test_overview_cpu_fallback(snap_compare, size):
    assert snap_compare(StokerApp(fake.cpu_link()), terminal_size=size, run_before=loaded)


def test_overview_install_progress(snap_compare):
    link = fake.cuda_link(status={**fake.status_cuda(), "state": "stopped", "endpoint": None, "pid": None,
                                  "uptime_s": None, "layers": {}})
    link.answers["telemetry"] = {"sample": {"activity": "stopped", "time": fake.T0}, "history": [], "ttl_s": 5.0}
    link.events = [
        {"topic": "install.progress", "backend": "cuda", "variant": "cuda13", "phase": "downloading",
         "bytes_done": 187_695_104, "total": 563_085_312, "rate": 24_117_248.0, "eta": 15.6},
    ]
    assert snap_compare(StokerApp(link), terminal_size=(100, 30), run_before=loaded)


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
def test_history_with_evidence_of_the_selected_crash(snap_compare, size):
    # Rows are newest first; the fifth is the out_of_memory crash.
    assert snap_compare(StokerApp(fake.cuda_link()), terminal_size=size,
                        run_before=on_tab("history", "down", "down", "down", "down"))


def test_history_filtered_by_machine(snap_compare):
    async def run_before(pilot) -> None:
        await on_tab("history")(pilot)
        view = pilot.app.query_one("#history-filter")
        view.value = "install:cuda13"
        await pilot.pause(0.2)

    assert snap_compare(StokerApp(fake.cuda_link()), terminal_size=(80, 24), run_before=run_before)


def test_snapshots_catalogue(snap_compare):
    assert snap_compare(StokerApp(fake.cuda_link()), terminal_size=(80, 24), run_before=on_tab("snapshots"))


def test_snapshots_not_available(snap_compare):
    # The CPU link has no snapshot.list: the daemon answers unknown_method.
    assert snap_compare(StokerApp(fake.cpu_link()), terminal_size=(80, 24), run_before=on_tab("snapshots"))


def test_confirmation_before_stopping(snap_compare):
    assert snap_compare(StokerApp(fake.cuda_link()), terminal_size=(80, 24), run_before=on_tab("overview", "d"))


def test_backend_choice(snap_compare):
    assert snap_compare(StokerApp(fake.cuda_link()), terminal_size=(80, 24), run_before=on_tab("overview", "b"))


def test_help(snap_compare):
    assert snap_compare(StokerApp(fake.cuda_link()), terminal_size=(80, 24),
                        run_before=on_tab("overview", "question_mark"))


def test_daemon_not_running(snap_compare):
    async def run_before(pilot) -> None:
        for _ in range(100):
            if pilot.app._not_running is not None:
                break
            await pilot.pause(0.02)
        await pilot.pause(0.2)

    # A long retry interval keeps the attempt counter at 1 for the picture.
    app = StokerApp(fake.FakeLink({}, running=False), retry_s=1000)
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
