"""The llama-server arguments a config may set ([server] and each [models.NAME]), and those it may not.

`extra_args` refuses the flags Stoker sets itself (host, port, key, model, and the flags a key of
its own sets), naming the key to use instead; `model_args` turns a model's own keys (kind, chat
template, sampling defaults, vision projector) into the engine's flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from stoker.daemon.config.checks import Invalid, describe

MODEL_KINDS = ("chat", "embedding", "rerank")

# llama-server flags Stoker sets itself: overriding them in extra_args would break supervision
# (host/port/API key/model) or contradict a config key.
FORBIDDEN_EXTRA_ARGS: dict[str, str] = {
    "-m": "set server.model instead",
    "--model": "set server.model instead",
    "-mu": "set server.model instead",
    "--model-url": "set server.model instead",
    "-hf": "set server.model instead",
    "-hfr": "set server.model instead",
    "--hf-repo": "set server.model instead",
    "--host": "set server.host instead",
    "--port": "set server.port instead",
    "--api-key": "Stoker sets a per-launch API key",
    "--api-key-file": "Stoker sets a per-launch API key",
    "-c": "set server.ctx_size instead",
    "--ctx-size": "set server.ctx_size instead",
    "-np": "set server.parallel instead",
    "--parallel": "set server.parallel instead",
    "-t": "set server.threads instead",
    "--threads": "set server.threads instead",
    "-ngl": "set server.n_gpu_layers instead",
    "--gpu-layers": "set server.n_gpu_layers instead",
    "--n-gpu-layers": "set server.n_gpu_layers instead",
    "-fa": "set server.flash_attn instead",
    "--flash-attn": "set server.flash_attn instead",
    "--swa-full": "set snapshots.swa_full instead",
    "-lv": "Stoker reads the log at verbosity 4",
    "--verbosity": "Stoker reads the log at verbosity 4",
    "--log-verbosity": "Stoker reads the log at verbosity 4",
    "--log-file": "Stoker keeps the server log itself",
    "--log-disable": "Stoker reads the server log",
}


def gpu_layers(value: Any) -> int | Literal["auto"]:
    if value == "auto" and isinstance(value, str):
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100_000:
        return value
    raise Invalid(f'must be "auto" or an integer of at least 0, got {describe(value)}')


def flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def extra_args(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise Invalid(f"must be a list of strings, got {describe(value)}")
    refused = [
        f"{arg} ({FORBIDDEN_EXTRA_ARGS[flag_name(arg)]})" for arg in value if flag_name(arg) in FORBIDDEN_EXTRA_ARGS
    ]
    if refused:
        raise Invalid(f"may not set flags Stoker controls: {', '.join(refused)}")
    return tuple(value)


# Sampling defaults: the engine applies them to a request that does not set its own.
SAMPLING_FLAGS: dict[str, str] = {
    "temperature": "--temp",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty",
    "seed": "--seed",
}


def kind_args(kind: str) -> tuple[str, ...]:
    """The engine's mode for a model's kind: embeddings (its pooling: the model's own), reranking."""
    return {"embedding": ("--embeddings",), "rerank": ("--reranking",)}.get(kind, ())


def chat_template_args(template: str | None) -> tuple[str, ...]:
    """A chat template: a file (`.jinja`, or a path) or a built-in name / inline Jinja."""
    if not template:
        return ()
    if template.endswith(".jinja") or template.startswith(("/", "~", "./")):
        return ("--chat-template-file", str(Path(template).expanduser()))
    return ("--chat-template", template)


def sampling_args(values: dict[str, float | int | None]) -> tuple[str, ...]:
    args: list[str] = []
    for key, flag in SAMPLING_FLAGS.items():
        value = values.get(key)
        if value is not None:
            args += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return tuple(args)
