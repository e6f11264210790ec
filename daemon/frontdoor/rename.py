"""The answer's `model` is the name the client sent.

The engine reports one id for every answer (its `--alias`: the model's public id); a client that
sent another name the model answers to (an alias from its `[models.NAME]` section, another
catalog name of the same file, "default") gets its own name back, as a hosted API does. The
engine writes compact JSON, so its `"model":"ALIAS"` is replaced byte for byte: an SSE stream
event by event (an event is never split, so the pattern never straddles a piece), any other
body (one JSON answer, not streamed) whole at its end.
"""

from __future__ import annotations

import json

import attrs


@attrs.define
class ModelRename:
    """Rewrites `"model":"<old>"` to `"model":"<new>"` in the pieces of one answer."""

    old: bytes
    new: bytes
    sse: bool
    _pending: bytes = b""

    @classmethod
    def of(cls, reported: str, sent: object, sse: bool) -> "ModelRename | None":
        """A rename when the client sent a name other than the one the engine reports; else None."""
        if not isinstance(sent, str) or not sent or sent == reported:
            return None
        key = b'"model":'
        return cls(key + json.dumps(reported).encode(), key + json.dumps(sent).encode(), sse)

    def piece(self, data: bytes) -> bytes:
        """What of `data` (after what was held back) can go now, renamed."""
        data = self._pending + data
        cut = data.rfind(b"\n\n") + 2 if self.sse else 0  # a whole JSON body: kept whole until its end
        if cut < 2:
            cut = 0
        ready, self._pending = data[:cut], data[cut:]
        return ready.replace(self.old, self.new)

    def rest(self) -> bytes:
        """What was held back, at the answer's end."""
        rest, self._pending = self._pending, b""
        return rest.replace(self.old, self.new)
