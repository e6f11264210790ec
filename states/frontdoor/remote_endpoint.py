"""What a remote model's endpoint did, and what it means (pure): for a request the front door
forwards to it, and for the reachability check that status and /metrics show.

Not a machine: a remote model (`[models.NAME] endpoint`, daemon/config/remote.py) has no server
of Stoker's, so no launch state. Each contact with its endpoint ends in one `Contact` (how far it
got) and, when it answered, an HTTP status; `judge` says what that means: reachable or not, the
reason code, and the answer the front door gives in place of the endpoint's (None: the
endpoint's own answer is relayed as it is).

| contact | reachable | reason | front door's answer | Retry-After |
|---|---|---|---|---|
| the key's variable is not set | not known (nothing sent) | remote_key_missing | 503 | no: only a restart with it set helps |
| never connected (refused, no such name, connect timeout) | no | remote_endpoint_unreachable | 503 | 5 s: the request never reached it, sending it again is safe |
| connected, then lost before an answer's head (reset, read timeout) | no | remote_endpoint_unreachable | 502 | no: the endpoint may have run it |
| answered 401 or 403 | yes | remote_key_rejected | 502: the upstream key is wrong, not the client's | no |
| answered anything else | yes | none | the endpoint's, relayed | the endpoint's |

A 401 from the endpoint is never relayed as a 401: the client would take it for its own front
door key being wrong, while the key at fault is the one Stoker sent.
"""

from __future__ import annotations

import enum

import attrs

from stoker.states.reasons import ReasonCode

# Seconds a client is told to wait before sending again a request that never reached the endpoint.
UNREACHABLE_RETRY_AFTER_S = 5
KEY_REJECTED = frozenset({401, 403})


class Contact(enum.StrEnum):
    """How far one request to the endpoint got."""

    KEY_MISSING = "key_missing"  # api_key_env names a variable the daemon's environment lacks: not sent
    NOT_CONNECTED = "not_connected"  # refused, unresolvable, or the connect timed out: never reached it
    LOST = "lost"  # connected, then the connection failed (or went silent) before an answer's head
    ANSWERED = "answered"  # an HTTP answer's head came back


@attrs.frozen
class Verdict:
    """What one contact means: for status (`reachable`, `reason`) and for the client (`status`,
    `retry_after_s`: the front door's own answer; None: relay the endpoint's)."""

    reachable: bool | None  # None: not known (nothing was sent)
    reason: ReasonCode | None = None
    status: int | None = None
    retry_after_s: int | None = None

    @property
    def relayed(self) -> bool:
        """The endpoint's own answer goes to the client as it is."""
        return self.status is None


def judge(contact: Contact, status: int | None = None) -> Verdict:
    """The verdict on one contact with the endpoint (`status`: its answer's, when it answered)."""
    if contact is Contact.KEY_MISSING:
        return Verdict(None, ReasonCode.REMOTE_KEY_MISSING, 503)
    if contact is Contact.NOT_CONNECTED:
        return Verdict(False, ReasonCode.REMOTE_ENDPOINT_UNREACHABLE, 503, UNREACHABLE_RETRY_AFTER_S)
    if contact is Contact.LOST:
        return Verdict(False, ReasonCode.REMOTE_ENDPOINT_UNREACHABLE, 502)
    if status in KEY_REJECTED:
        return Verdict(True, ReasonCode.REMOTE_KEY_REJECTED, 502)
    return Verdict(True)
