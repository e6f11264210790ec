"""The TUI's Models view with a remote model (`[models.NAME] endpoint`): a row of its own, its
endpoint's reachability as its state, backend remote, and in detail the endpoint, the name it is
sent as, the last check and request with their errors, the key's variable (never the key) and
acceleration as unknown. Fed a recorded status (the fake link of test_tui_snapshots.py)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from textual.widgets import DataTable, Static

from tests.integration.test_tui_snapshots import T0, models_link, run_app, status_models, utc  # noqa: F401

ENDPOINT = "https://gpu.example:8000/v1"


def remote(**overrides: Any) -> dict[str, Any]:
    """One `remotes[]` entry of a status reply (daemon/fleet/remote.py RemoteStatus)."""
    return {
        "name": "big",
        "endpoint": ENDPOINT,
        "remote_model": "meta-llama/Llama-3.1-70B-Instruct",
        "default": False,
        "api_key_env": "BIG_KEY",
        "key_set": True,
        "reachable": False,
        "reason": "remote_endpoint_unreachable",
        "message": "The model's external endpoint could not be reached.",
        "check": {
            "at": T0,
            "reachable": False,
            "reason": "remote_endpoint_unreachable",
            "message": "...",
            "http_status": None,
            "latency_ms": None,
            "error": "cannot connect to the engine at gpu.example:8000: [Errno 111] Connection refused",
        },
        "last_request": {
            "at": T0 - 60,
            "reachable": True,
            "reason": None,
            "message": None,
            "http_status": 200,
            "latency_ms": None,
            "error": None,
        },
        "in_flight": 0,
        "check_interval_s": 30.0,
        "backend": "remote",
        "accelerated": "unknown",
        **overrides,
    }


def text_of(renderable: Any) -> str:
    console = Console(width=120, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_remote_model_is_a_row_and_its_detail_says_what_stoker_knows_of_it():
    status = {**status_models(), "remotes": [remote()]}

    async def scenario(app, pilot) -> tuple[str, str, str]:
        app.action_show_tab("models")
        await pilot.pause(0.1)
        table = app.query_one("#models-table", DataTable)
        row = [str(cell) for cell in table.get_row("big")]
        table.move_cursor(row=table.get_row_index("big"), animate=False)
        await pilot.pause(0.1)
        note = text_of(app.query_one("#models-note", Static).content)
        return " | ".join(row), text_of(app.query_one("#model-detail", Static).content), note

    row, detail, note = run_app(models_link(status=status), scenario)
    assert row.startswith("big | unreachable | remote | - | -"), row
    assert row.endswith("remote_endpoint_unreachable"), row
    assert "1 remote" in note
    assert "big  unreachable  remote" in detail
    assert f"{ENDPOINT}  (sent as meta-llama/Llama-3.1-70B-Instruct)" in detail
    assert "$BIG_KEY set" in detail
    assert "Connection refused" in detail and "HTTP 200" in detail  # the check, then the last request
    assert "acceleration is unknown" in detail
