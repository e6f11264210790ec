"""Loading the code a process keeps until it exits, without the garbage collector's passes over it.

Importing the daemon makes some hundred thousand objects (modules, classes, functions, the
records' generated methods) that live as long as the process. The collector scans them again
and again while they are made (~0.25 s of CPU at every daemon start), and once more, whole,
when the interpreter exits (~0.4 s more: the daemon took that long to end after its servers
had). None of them is garbage, so the collector is paused while they load (`loading`), and
the daemon then moves them out of its sight for good (`keep_loaded`, `gc.freeze`): the objects
made while it runs are collected as before.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def loading() -> Iterator[None]:
    """The garbage collector paused for the imports inside (as it was after them)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def keep_loaded() -> None:
    """Everything alive now stays until exit, and the collector never scans it again: only for
    a process whose objects so far are its code (the daemon right after its imports)."""
    gc.freeze()
