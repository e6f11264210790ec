"""Whether a model file can be loaded, checked before anything that works is stopped for it."""

from __future__ import annotations

import logging

from stoker.daemon.core.errors import StokerError
from stoker.daemon.models.facts import read_header
from stoker.daemon.models.resolve import look_up, resolve_model
from stoker.states.pull.lookup import Action, ModelForm, model_form
from stoker.states.reasons import ReasonCode
from stoker.store.catalog import ModelCatalog

log = logging.getLogger(__name__)


def model_problem(spec: str, catalog: ModelCatalog) -> tuple[ReasonCode | None, str | None]:
    """What would stop `server.model` from loading: a file missing, not a regular file, not GGUF,
    a header that cannot be read; a name the catalog does not have, or whose file is gone; as
    (reason, sentence), (None, None) when it can load. A well-known name not pulled yet is
    pulled when the launch is planned: nothing to check here."""
    if model_form(spec) is ModelForm.NAME and look_up(spec, catalog).decision.action is Action.PULL:
        return None, None
    try:
        path = resolve_model(spec, catalog).path
        read_header(path)
    except StokerError as err:
        return err.reason, err.message
    except (OSError, ValueError) as err:  # GGUFError: a header the engine could not load either
        return ReasonCode.MODEL_LOAD_FAILED, f"{spec} is not a GGUF file the engine can load (its header: {err})."
    except Exception as err:  # a check that fails must refuse the model, never stop the daemon
        log.exception("checking the model %s failed", spec)
        return ReasonCode.MODEL_LOAD_FAILED, f"{spec} could not be checked ({type(err).__name__}: {err})."
    return None, None
