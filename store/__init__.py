"""store: SQLite through sqlite-utils. Machines, their transition history, migrations."""

from stoker.store.database import Store, open_store
from stoker.store.errors import StoreError
from stoker.store.records import MachineRecord, TransitionRecord

__all__ = ["MachineRecord", "Store", "StoreError", "TransitionRecord", "open_store"]
