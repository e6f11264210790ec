"""Messages the event worker and the query workers post to the app (data flowing up)."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class Connected(Message):
    """The event stream is open: the daemon runs."""


class Disconnected(Message):
    """No daemon answers (or it went away); the worker keeps retrying."""

    def __init__(self, message: str, attempt: int) -> None:
        super().__init__()
        self.message = message
        self.attempt = attempt


class DaemonEvent(Message):
    """One event from the daemon's stream, as published."""

    def __init__(self, event: dict[str, Any]) -> None:
        super().__init__()
        self.event = event


class StatusLoaded(Message):
    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__()
        self.status = status


class TelemetryLoaded(Message):
    def __init__(self, sample: dict[str, Any], history: list[dict[str, Any]] | None) -> None:
        super().__init__()
        self.sample = sample
        self.history = history


class HistoryLoaded(Message):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        super().__init__()
        self.rows = rows


class SnapshotsLoaded(Message):
    """The catalogue, or None with a reason when the daemon cannot list snapshots."""

    def __init__(
        self, items: list[dict[str, Any]] | None, unavailable: str | None = None, listing: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.items = items
        self.unavailable = unavailable
        self.listing = listing or {}


class ModelHistoryLoaded(Message):
    """One model's history (its launch and fallback machines), newest first; `merge`: for the
    History tab (rows to add) rather than the models view."""

    def __init__(self, name: str, rows: list[dict[str, Any]], merge: bool = False) -> None:
        super().__init__()
        self.name = name
        self.rows = rows
        self.merge = merge
