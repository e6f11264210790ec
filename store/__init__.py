"""store: SQLite through sqlite-utils. Machines, their transition history, migrations."""

from store.database import Store, open_store
from store.errors import StoreError
from store.records import MachineRecord, TransitionRecord

__all__ = ["MachineRecord", "Store", "StoreError", "TransitionRecord", "open_store"]
