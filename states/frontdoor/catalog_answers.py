"""The HTTP status Ollama's catalog routes (daemon/frontdoor/ollama.py: /api/pull, /api/delete)
answer a failed pull or removal with, by its reason code; the body carries the code itself."""

from __future__ import annotations

from stoker.states.reasons import ReasonCode

STATUS_OF: dict[ReasonCode, int] = {
    ReasonCode.PULL_BAD_SPEC: 400,
    ReasonCode.PULL_NO_FILE_FOR_QUANT: 400,
    ReasonCode.PULL_NOT_GGUF: 400,
    ReasonCode.PULL_UNAUTHORIZED: 401,
    ReasonCode.PULL_NOT_FOUND: 404,
    ReasonCode.MODEL_NOT_IN_CATALOG: 404,
    ReasonCode.MODEL_IN_USE: 409,
}
# Anything else (a source that did not answer, a full disk, a checksum that did not match) is
# the server's failure, not the request's.
OTHERWISE = 500


def http_status(reason: ReasonCode) -> int:
    """The status a catalog route answers a failure with."""
    return STATUS_OF.get(reason, OTHERWISE)
