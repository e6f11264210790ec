"""The store keeper: writes what a refusing disk held back, and checkpoints the WAL.

Two chores of the daemon's one SQLite connection, on the trio loop (the connection belongs to
this thread; each chore is a few SQLite calls):

- While the disk refuses writes (full, read-only), transitions wait in memory
  (`Store.health().pending`); every `retry_s` the keeper tries to write them, in order, so
  they catch up as soon as space returns, even when no new transition comes to push them.
- Every `checkpoint_s`, if anything was written since, a PASSIVE checkpoint copies the WAL
  into the main file: history then survives a lost `-wal` file (a backup that copied only
  `stoker.db`, a cleaner that removed it) up to the last few seconds, instead of living only
  in the WAL until a clean close. PASSIVE never waits for a reader.

docs/store.md says why these intervals.
"""

from __future__ import annotations

import logging

import trio

from stoker.store import Store

log = logging.getLogger(__name__)

RETRY_S = 2.0
CHECKPOINT_S = 5.0


async def serve_store_keeper(
    store: Store,
    *,
    retry_s: float = RETRY_S,
    checkpoint_s: float = CHECKPOINT_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Retry held-back writes and checkpoint the WAL until cancelled."""
    task_status.started()
    tick = min(retry_s, checkpoint_s)
    last_checkpoint = trio.current_time()
    while True:
        await trio.sleep(tick)
        if store.health().pending:
            written = store.flush()
            if written:
                log.info("state database: %d held-back transition(s) written", written)
        if trio.current_time() - last_checkpoint >= checkpoint_s:
            store.checkpoint()
            last_checkpoint = trio.current_time()
