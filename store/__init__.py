"""store: SQLite through sqlite-utils. Machines, their transition history, migrations.

`Store` and `open_store` load sqlite-utils on first use (PEP 562): the CLI reads the records
of this package on every command, and importing sqlite-utils cost ~0.1 s of each.
"""

from typing import TYPE_CHECKING, Any

from stoker.store.errors import StoreError
from stoker.store.records import MachineRecord, TransitionRecord

if TYPE_CHECKING:
    from stoker.store.database import Store, open_store

__all__ = ["MachineRecord", "Store", "StoreError", "TransitionRecord", "open_store"]


def __getattr__(name: str) -> Any:
    if name in ("Store", "open_store"):
        from stoker.store import database

        return getattr(database, name)
    raise AttributeError(f"module 'stoker.store' has no attribute {name!r}")
