"""Whether a model file can be loaded, checked before anything that works is stopped for it."""

from __future__ import annotations

from daemon.core.errors import StokerError
from daemon.core.paths import StokerPaths
from daemon.models.facts import read_header
from daemon.models.resolve import NAMED_MODELS, resolve_model
from states.reasons import ReasonCode


def model_problem(spec: str, paths: StokerPaths) -> tuple[ReasonCode | None, str | None]:
    """What would stop the model file `spec` (`server.model`) from loading: missing, not a regular
    file, not GGUF, a header that cannot be read; as (reason, sentence), (None, None) when it can
    load. A named model comes from its package at plan time: nothing to check here."""
    if spec in NAMED_MODELS:
        return None, None
    try:
        path = resolve_model(spec, paths)
        read_header(path)
    except StokerError as err:
        return err.reason, err.message
    except (OSError, ValueError) as err:
        return ReasonCode.MODEL_LOAD_FAILED, f"{spec}: the GGUF header cannot be read ({err})."
    return None, None
