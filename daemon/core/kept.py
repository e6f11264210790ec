"""Answers worth keeping across daemon runs, in a small JSON file of the daemon's data dir.

`KeptAnswers` is a bounded dict: read from its file once, at its first use (a file that cannot
be read starts it afresh), and written whole at each new answer (a temporary file renamed over
it, mode 0600); past `limit` answers the oldest go. Thread-safe: plans of several models ask
from their own threads. What it keeps is a cache: a write that fails leaves the answer in
memory, and the next daemon works it out again. The fitter's answers (daemon/engine/fit.py)
and the parsed GGUF headers (daemon/models/facts.py) are kept this way.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def write_private_json(path: Path, value: Any) -> None:
    """`value` as JSON in `path`, whole or not at all (a temporary file renamed over it), 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(value, fh)
    os.replace(tmp, path)


class KeptAnswers:
    """Answers by key, in memory and in `path` (None: in memory only)."""

    def __init__(self, path: Path | None, limit: int) -> None:
        self.path = path
        self.limit = limit
        self._answers: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _loaded(self) -> dict[str, Any]:
        if self._answers is None:
            self._answers = {}
            if self.path is not None:
                try:
                    found = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    found = None
                if isinstance(found, dict):
                    self._answers = found
        return self._answers

    def get(self, key: str) -> Any:
        with self._lock:
            return self._loaded().get(key)

    def put(self, key: str, answer: Any) -> None:
        with self._lock:
            answers = self._loaded()
            answers.pop(key, None)
            answers[key] = answer
            while len(answers) > self.limit:
                answers.pop(next(iter(answers)))
            if self.path is None:
                return
            try:
                write_private_json(self.path, answers)
            except (OSError, TypeError, ValueError) as err:  # kept in memory still
                log.warning("answers could not be kept in %s: %s", self.path, err)
