"""The TUI and telemetry against a real daemon on a temporary STOKER_HOME.

Pilot tests: keys pressed in the app really reach the daemon (d + confirm stops the server,
u starts it) and the screen follows the daemon's events; with no daemon the app says so and
reconnects by itself. The telemetry tests read the CPU path for real: psutil figures of the
live llama-server and tokens/s from its /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import httpx
import pytest

from textual.widgets import TabbedContent

from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from stoker.tui.app import StokerApp
from stoker.tui.link import SocketLink
from stoker.tui.screens.confirm import ConfirmScreen
from stoker.tui.screens.not_running import NotRunningScreen
from stoker.tui.widgets.backend_card import BackendCard
from stoker.tui.widgets.history_view import HistoryView
from stoker.tui.widgets.telemetry_panel import TelemetryPanel
from tests.waits import wait_until


@pytest.fixture
def model(tiny_model, tmp_path):
    """A private copy of the tiny model, so that its path names this test's servers only."""
    path = tmp_path / "tiny.gguf"
    shutil.copy(tiny_model, path)
    return path


def _cleanup(d: DaemonProcess, model) -> None:
    d.stop()
    leftovers = servers_for(model)
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


@pytest.fixture
def daemon(stoker_home, installed_cpu_bundle, model):
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(model))
    yield d
    _cleanup(d, model)


async def until(pilot, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> None:
    """Let the app run until `predicate()` holds (real time: a real daemon is on the other end)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def state_of(app: StokerApp) -> str | None:
    return (app.status or {}).get("state")


def card_text(app: StokerApp) -> str:
    card = app.query_one(BackendCard)
    return "".join(segment.text for segment in app.console.render(card.render(), app.console.options))


# --- Pilot tests against the real daemon ----------------------------------------------------


@pytest.mark.engine
def test_keys_reach_the_daemon_and_the_screen_follows(daemon, model):
    daemon.start()
    daemon.wait_state("ready")

    async def scenario() -> None:
        app = StokerApp(SocketLink(daemon.paths.socket_path))
        async with app.run_test(size=(100, 30)) as pilot:
            await until(
                pilot, lambda: state_of(app) == "ready" and app.loaded >= {"history", "telemetry"}, what="ready"
            )
            assert "ready" in card_text(app) and "cpu" in card_text(app)
            assert app.query_one(HistoryView).rows[0]["to_state"] == "ready"

            # d asks first; n leaves the server alone.
            await pilot.press("d")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")
            await pilot.pause(0.3)
            assert not isinstance(app.screen, ConfirmScreen)
            assert (await asyncio.to_thread(daemon.call, "status"))["state"] == "ready"

            # d, y: the daemon really stops its server, and the screen follows its events.
            await pilot.press("d")
            await pilot.press("y")
            await until(pilot, lambda: state_of(app) == "stopped", what="the card to say stopped")
            assert (await asyncio.to_thread(daemon.call, "status"))["state"] == "stopped"
            assert servers_for(model) == []
            history = app.query_one(HistoryView)
            await until(pilot, lambda: history.rows[0]["to_state"] == "stopped", what="the live transition")
            launch_rows = [r["to_state"] for r in history.rows if r["machine_id"] == "launch"]
            assert launch_rows[:2] == ["stopped", "stopping"]
            panel = app.query_one(TelemetryPanel)
            await until(pilot, lambda: (panel.sample or {}).get("activity") == "stopped", what="telemetry to stop")

            # u: up again, ready again.
            await pilot.press("u")
            await until(pilot, lambda: state_of(app) == "ready", what="ready again")
            status = await asyncio.to_thread(daemon.call, "status")
            assert status["state"] == "ready" and status["pid"] == app.status["pid"]
            assert "ready" in card_text(app)

            # While the app watches, the daemon publishes samples of the live CPU server.
            await until(
                pilot,
                lambda: (
                    (panel.sample or {}).get("process") is not None and (panel.sample or {}).get("pid") == status["pid"]
                ),
                timeout=20,
                what="a CPU sample",
            )
            assert panel.sample["backend"] == "cpu" and panel.sample["gpu"] is None
            assert panel.has_class("-cpu") and not panel.has_class("-gpu")
            await pilot.press("q")

    asyncio.run(scenario())


@pytest.mark.engine
def test_restart_asks_then_gives_a_new_server(daemon):
    daemon.start()
    first = daemon.wait_state("ready")

    async def scenario() -> None:
        app = StokerApp(SocketLink(daemon.paths.socket_path))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: state_of(app) == "ready", what="ready")
            await pilot.press("r")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(
                pilot, lambda: state_of(app) == "ready" and app.status["pid"] != first["pid"], what="a new server"
            )
            await pilot.press("q")

    asyncio.run(scenario())


def test_not_running_screen_then_reconnects_by_itself(stoker_home, tmp_path):
    # No engine needed: the model is missing, so the daemon settles in `failed` at once.
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(tmp_path / "no-such-model.gguf"))

    async def scenario() -> None:
        app = StokerApp(SocketLink(d.paths.socket_path), retry_s=0.2)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, NotRunningScreen), timeout=10, what="not-running screen")
            assert app.screen.attempt >= 1
            attempts = app.screen.attempt
            await until(pilot, lambda: app.screen.attempt > attempts, timeout=10, what="a retry")
            assert not app.check_action("up", ())  # no daemon actions without a daemon

            d.start(wait=False)
            await until(
                pilot,
                lambda: app.connected and not isinstance(app.screen, NotRunningScreen),
                timeout=30,
                what="reconnection",
            )
            await until(pilot, lambda: state_of(app) in ("failed", "stopped"), timeout=30, what="status")
            assert app.check_action("up", ())

            # The daemon goes away: the screen says so again, and comes back with it.
            await asyncio.to_thread(d.stop)
            await until(pilot, lambda: isinstance(app.screen, NotRunningScreen), timeout=30, what="not running again")
            d.start(wait=False)
            await until(
                pilot,
                lambda: app.connected and not isinstance(app.screen, NotRunningScreen),
                timeout=30,
                what="second reconnection",
            )
            await pilot.press("q")

    try:
        asyncio.run(scenario())
    finally:
        d.stop()


@pytest.fixture
def other_model(tmp_path):
    """A second tiny model (other weights), for two models at once."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path / "other" / "other.gguf", seed=7)


@pytest.mark.engine
def test_the_models_view_follows_two_real_models(daemon, model, other_model):
    """alpha (the default) and beta (loaded on demand by a request): the Models tab lists both with
    their state, backend, layers and the memory their processes hold; the highlighted model's
    history is its own machines'; d on the Models tab stops the highlighted model only; Enter opens
    the History tab filtered to it."""
    from tests.integration.test_frontdoor import sdk
    from tests.integration.test_several_models import two_models, wait_model
    from stoker.tui.widgets.models_view import ModelsView, estimate_line

    def states(view: ModelsView) -> dict[str, str]:
        return {m["name"]: m["state"] for m in view.models}

    try:
        base = two_models(daemon, model, other_model, max_loaded=2)
        wait_model(daemon, "alpha", "ready")

        async def scenario() -> None:
            app = StokerApp(SocketLink(daemon.paths.socket_path))
            async with app.run_test(size=(100, 30)) as pilot:
                view = app.query_one(ModelsView)
                await until(pilot, lambda: states(view) == {"alpha": "ready", "beta": "stopped"}, what="both models")
                app.action_show_tab("models")
                alpha = view.models[0]
                assert alpha["backend"] == "cpu" and alpha["memory"]["rss_mib"] > 1  # the live process's own RSS
                # Which estimate answered its plan (the bundle's fitter), and what placement counts now.
                estimate = str(estimate_line(alpha))
                assert estimate.startswith(f"llama-fit-params: ram {alpha['memory']['estimate']['ram_mib']:.0f} MiB")
                assert "(engine's buffers)" in estimate
                assert view.selected == "alpha"
                await until(pilot, lambda: any(r["machine_id"] == "launch:alpha" for r in view.history_rows))

                # A request loads beta; the view follows the daemon's events.
                reply = await asyncio.to_thread(
                    lambda: sdk(base).completions.create(model="beta", prompt="The", max_tokens=2)
                )
                assert reply.model == "beta"
                await until(pilot, lambda: states(view)["beta"] == "ready", what="beta ready in the view")
                await pilot.press("down")
                await until(
                    pilot,
                    lambda: view.selected == "beta" and any(r["to_state"] == "ready" for r in view.history_rows),
                    what="beta's history",
                )
                assert {r["machine_id"] for r in view.history_rows} <= {"launch:beta", "fallback:beta"}
                beta = next(m for m in view.models if m["name"] == "beta")
                assert beta["backend"] == "cpu" and beta["memory"]["rss_mib"] > 1
                # A status refresh redraws the table: the cursor stays on beta and nothing asks for
                # another model's history (a refill that passed through alpha could leave it there).
                highlighted: list[str] = []
                post = view.post_message

                def recording(message):
                    if isinstance(message, ModelsView.Highlighted):
                        highlighted.append(message.name)
                    return post(message)

                view.post_message = recording
                view.show_status(app.status)
                view.show_status(app.status)
                await pilot.pause()
                view.post_message = post
                assert highlighted == [] and view.selected == "beta"
                assert app.query_one("#models-table").cursor_row == 1

                # d on the Models tab: beta stops, alpha serves on.
                await pilot.press("d")
                assert isinstance(app.screen, ConfirmScreen)
                await pilot.press("y")
                await until(pilot, lambda: states(view)["beta"] == "stopped", what="beta stopped")
                await until(pilot, lambda: view.history_rows[0]["to_state"] == "stopped", what="the live stop")
                status = await asyncio.to_thread(daemon.call, "status")
                assert {m["name"]: m["state"] for m in status["models"]} == {"alpha": "ready", "beta": "stopped"}
                assert servers_for(other_model) == []

                # Enter: all of beta's history, in the History tab.
                await pilot.press("enter")
                history = app.query_one(HistoryView)
                await until(pilot, lambda: app.query_one(TabbedContent).active == "history", what="the History tab")
                shown = history._visible()
                assert shown and {r["machine_id"] for r in shown} <= {"launch:beta", "fallback:beta"}
                await pilot.press("q")

        asyncio.run(scenario())
    finally:
        daemon.stop()
        leftovers = servers_for(other_model)
        for proc in leftovers:
            proc.kill()
        assert not leftovers


# --- telemetry on the CPU path, for real ----------------------------------------------------


@pytest.mark.engine
def test_cpu_telemetry_reads_the_live_server(daemon):
    daemon.start()
    st = daemon.wait_state("ready")
    first = daemon.call("telemetry")
    sample = first["sample"]
    assert sample["backend"] == "cpu" and sample["pid"] == st["pid"] and sample["state"] == "ready"
    assert sample["gpu"] is None and sample["gpu_error"] is None  # no NVML on a CPU plan
    assert sample["process"]["rss_mib"] > 1 and sample["process"]["threads"] >= 1
    # --metrics is on: the engine's own counters are there.
    assert sample["engine_error"] is None, sample["engine_error"]
    assert sample["engine"]["requests_processing"] == 0
    assert sample["activity"] == "idle"
    # Within the TTL every caller gets the same sample.
    assert daemon.call("telemetry")["sample"]["time"] == sample["time"]

    body = {"prompt": "hello", "n_predict": 16, "temperature": 0}
    reply = httpx.post(
        f"{st['endpoint']}/completion", json=body, headers={"Authorization": f"Bearer {st['api_key']}"}, timeout=60
    )
    assert reply.status_code == 200
    later = wait_until(
        lambda: (t := daemon.call("telemetry"))["sample"]["time"] > sample["time"] and t,
        timeout=first["ttl_s"] + 30,
        what="a telemetry sample newer than the first (one TTL later)",
    )
    engine = later["sample"]["engine"]
    assert later["sample"]["time"] > sample["time"]
    assert engine["tokens_predicted_total"] >= 16
    assert engine["tokens_per_s"] > 0  # the window since the last scrape held the generation
    assert later["sample"]["process"]["cpu_percent"] is not None
    assert len(later["history"]) >= 2


@pytest.mark.engine
def test_telemetry_events_and_the_cli(daemon):
    daemon.start()
    daemon.wait_state("ready")
    with daemon.client() as client, client.subscribe() as events:
        deadline = time.monotonic() + 20
        sample_event = None
        for event in events:
            if event.get("topic") == "telemetry.sample":
                sample_event = event
                break
            assert time.monotonic() < deadline
    assert sample_event["sample"]["backend"] == "cpu"
    assert sample_event["point"]["rss_mib"] > 1

    env = {**os.environ, "STOKER_HOME": str(daemon.home)}
    out = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "telemetry", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["sample"]["backend"] == "cpu" and "history" in doc
    human = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "telemetry"], env=env, capture_output=True, text=True, timeout=60
    )
    assert human.returncode == 0 and "rss" in human.stdout and "tok/s" in human.stdout

    # --watch --json: one sample per line, a new one about every 5 s.
    watch = subprocess.Popen(
        [sys.executable, "-m", "stoker.daemon", "telemetry", "--watch", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    guard = threading.Timer(60, watch.kill)  # a stuck stream fails the test instead of hanging it
    guard.start()
    try:
        lines = [json.loads(watch.stdout.readline()) for _ in range(3)]
    finally:
        guard.cancel()
        watch.terminate()
        watch.wait(10)
    assert all(line["backend"] == "cpu" for line in lines)
    assert lines[-1]["time"] > lines[0]["time"]


def test_telemetry_cli_without_a_daemon_exits_3(stoker_home):
    env = {**os.environ, "STOKER_HOME": str(stoker_home)}
    out = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "telemetry", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3
    assert json.loads(out.stdout)["error"]["reason"] == "daemon_not_running"
