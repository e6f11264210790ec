"""What `stoker snapshot list --model NAME` shows: one instance's snapshots, newest first, each
with whether it fits that model's ready server, beside the budgets every instance shares.

A snapshot belongs to the instance that saved it (its `[models.NAME]`), so a listing is always
one instance's; retention's byte budget and the snapshots dir are shared, so the listing also
says what every instance's snapshots weigh together (`all_bytes`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoker.daemon.config.model import SnapshotsConfig
from stoker.daemon.core.errors import StokerError
from stoker.daemon.snapshots.layout import check_identity
from stoker.daemon.snapshots.live import LiveServer
from stoker.store.snapshots import SnapshotRecord


def fit(rec: SnapshotRecord, live: LiveServer | None) -> dict[str, Any]:
    """`fits_server` and `why_not` (a reason code) against `live`; nothing said without one."""
    if live is None:
        return {}
    try:
        check_identity(rec.identity(), live.identity, snapshot_id=rec.id)
    except StokerError as err:
        return {"fits_server": False, "why_not": str(err.reason)}
    return {"fits_server": True, "why_not": None}


def listing_of(
    instance: str,
    records: list[SnapshotRecord],
    live: LiveServer | None,
    config: SnapshotsConfig,
    *,
    max_bytes: int,
    snapshots_dir: Path,
    dropped: list[dict[str, Any]],
) -> dict[str, Any]:
    """The reply of snapshot.list: `instance`'s rows among `records` (every instance's, newest
    first), each with its fit to `live` (that instance's ready server, or None)."""
    rows = [{**rec.to_dict(), **fit(rec, live)} for rec in records if rec.instance == instance]
    return {
        "model": instance,
        "snapshots": rows,
        "total_bytes": sum(r["file_size"] for r in rows),
        "all_bytes": sum(rec.file_size for rec in records),  # what retention's byte budget counts
        "enabled": config.enabled,
        "max_count": config.max_count,
        "max_bytes": max_bytes,
        "max_bytes_setting": config.max_bytes,
        "dir": str(snapshots_dir),
        "server": None if live is None else {"identity": live.identity, **live.swa},
        "dropped": dropped,
    }
