"""Hot reload of config.toml with watchfiles: valid edits are applied, invalid ones reported.

`watch_config` watches the file's directory (editors replace files rather than write them)
and reports each edit once it settles; the caller keeps the old config on an invalid one. A
config that is a symlink (a dotfiles checkout) is watched through every link to its target:
an edit of the target is an edit of the config, and a link pointed elsewhere is followed.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from stoker.daemon.config.model import Config, ConfigError, load_config

DEFAULT_DEBOUNCE_MS = 300

# May answer False: the caller refused the new config (the watcher then treats the file as
# invalid: the config in force stays, and the next save of the file is read again).
OnChange = Callable[[Config], "Awaitable[bool | None] | bool | None"]
OnInvalid = Callable[[ConfigError], "Awaitable[None] | None"]


async def _call(callback: Callable[[Any], Any] | None, arg: Any) -> Any:
    if callback is None:
        return None
    result = callback(arg)
    if inspect.isawaitable(result):
        return await result
    return result


MAX_LINKS = 40  # as the kernel's own limit on a path's symlinks


def link_chain(path: Path) -> tuple[Path, ...]:
    """`path`, each link it goes through, and the file it ends at, each named in its directory's
    real path (so that they compare with what the watcher reports for those directories)."""
    chain: list[Path] = []
    here = path
    for _ in range(MAX_LINKS):
        here = Path(os.path.realpath(here.parent)) / here.name
        if here in chain:
            break  # a loop of links: the config cannot be read, its reading says so
        chain.append(here)
        try:
            target = os.readlink(here)
        except OSError:  # not a link (or not there): the end of the chain
            break
        here = here.parent / target
    return tuple(chain)


async def watch_config(
    path: Path | str,
    on_change: OnChange,
    *,
    on_invalid: OnInvalid | None = None,
    current: Config | None = None,
    debounce_ms: int = DEFAULT_DEBOUNCE_MS,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Watch `path` until cancelled; report each edit once it settles for `debounce_ms`.

    A valid file that differs from the config in force (or follows an invalid one) calls
    `on_change(new)`, which may answer False to refuse it; an invalid one calls `on_invalid(err)`;
    either way the config in force stays.
    `current` is the config in force at the start (default: loaded now); if the file is
    invalid at the start, that is not reported again, but fixing it calls `on_change` even
    when the fixed file equals `current` (so problems can be cleared). The directory is
    watched, since editors replace the file rather than write it; it is created if missing.
    Callbacks may be plain functions or async ones.
    """
    import anyio
    from watchfiles import awatch

    path = Path(path).absolute()
    if current is None:
        current = load_config(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stop = anyio.Event()
    invalid = False

    lock = trio.Lock()

    async def reload(initial: bool = False) -> None:
        async with lock:
            await _reload(initial)

    async def _reload(initial: bool) -> None:
        nonlocal current, invalid
        try:
            new = load_config(path)
        except ConfigError as err:
            invalid = True
            # At start the caller has just loaded the file and knows it is invalid (it runs
            # on `current`, the defaults or an older config); remember it, so that a fix is
            # reported even if it equals `current`, but do not report it twice.
            if not initial:
                await _call(on_invalid, err)
            return
        if new != current or invalid:
            if await _call(on_change, new) is False:
                invalid = True  # refused (its model cannot load): the next save is read again
                return
            current, invalid = new, False

    chain = link_chain(path)

    def is_ours(_change: Any, changed: str) -> bool:
        return Path(changed) in chain

    watching = stop  # the running watcher's stop event

    async def stop_on_cancel() -> None:
        # awatch blocks in a worker thread that only notices cancellation through stop_event.
        try:
            await trio.sleep_forever()
        finally:
            watching.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_cancel)
        first = True
        while True:
            # Each directory that holds the config, a link on the way to it, or its target.
            dirs = sorted({str(p.parent) for p in chain if p.parent.is_dir()})
            watcher = awatch(
                *dirs,
                watch_filter=is_ours,
                debounce=debounce_ms,
                step=min(50, debounce_ms),
                stop_event=watching,
                recursive=False,
            )
            if first:
                # awatch creates its watcher in the first __anext__, before it first checkpoints;
                # the re-read scheduled here runs after that, so an edit made between the caller's
                # load and the watcher's start is not lost.
                task_status.started()
                nursery.start_soon(reload, True)
                first = False
            async for _changes in watcher:
                await reload()
                if link_chain(path) != chain:
                    break  # a link now points elsewhere: watch where it leads
            else:
                break  # stopped
            chain = link_chain(path)
            await watcher.aclose()
            watching = anyio.Event()
            await reload()  # what changed while the watcher was replaced
        nursery.cancel_scope.cancel()
