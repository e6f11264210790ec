"""The models the daemon serves, each with the config its server is launched with.

Without `[models]`: one model, `[server] model`, as instance `default` (what Stoker always
served, under the same history ids). With `[models.NAME]` sections: one per section, in file
order, each launched with `[server]` and `[backend]` overlaid with its section
(`instance_config`, the one place that overlay is made), so the launch supervisor, the
fallback orchestrator and the plan read `config.server` and `config.backend` as they always
have and never learn which section a value came from.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from stoker.daemon.config.model import Config
from stoker.daemon.config.placement import ModelConfig, default_model
from stoker.states.pull.lookup import ModelForm, model_form

DEFAULT_INSTANCE = "default"


@attrs.frozen
class ServedModel:
    """One model the daemon serves: its NAME (its instance's), the config its server is
    launched with, and how it is placed."""

    name: str
    config: Config  # [server]/[backend] with this model's section laid over them
    default: bool = False  # requests naming no configured model (or "default") go here
    pinned: bool = False  # started with the daemon, never unloaded to make room
    idle_ttl_s: float = 0.0  # 0: never unloaded for being idle

    @property
    def spec(self) -> str:
        """The model as the config names it: a catalog name or a path."""
        return self.config.server.model

    @property
    def autostart(self) -> bool:
        """Started with the daemon: the default and the pinned ones; the others load on demand."""
        return self.default or self.pinned

    @property
    def engine_alias(self) -> str | None:
        """The model id its engine is told to report (`--alias`): its NAME with [models], so the
        answers carry the name the client routed by; None without (the engine's file path, as before)."""
        return self.name if self.config.models else None

    @property
    def public_id(self) -> str:
        """The id /v1/models lists it under: its NAME; without [models] the model's own name (its
        catalog name, or its file's name), the one the user wrote."""
        if self.config.models or self.name != DEFAULT_INSTANCE:
            return self.name
        return Path(self.spec).name if model_form(self.spec) is ModelForm.PATH else self.spec


def instance_config(config: Config, section: ModelConfig) -> Config:
    """The config a model's server is launched with: `[server]` and `[backend]` with the
    section's keys laid over them (a key the section leaves out keeps the shared value)."""
    server = attrs.evolve(
        config.server,
        model=section.model,
        ctx_size=config.server.ctx_size if section.ctx_size is None else section.ctx_size,
        parallel=config.server.parallel if section.parallel is None else section.parallel,
    )
    backend = config.backend if section.prefer is None else attrs.evolve(config.backend, prefer=section.prefer)
    return attrs.evolve(config, server=server, backend=backend)


def served_models(config: Config) -> tuple[ServedModel, ...]:
    """Every model the config serves with a server of its own, the default one marked (none
    when a remote section, served by its endpoint, is the default: daemon/config/remote.py)."""
    remote_default = any(r.default for r in config.remotes)
    if not config.models:
        return (ServedModel(DEFAULT_INSTANCE, config, default=not remote_default),)
    chosen = None if remote_default else default_model(config.models)
    return tuple(
        ServedModel(
            section.name,
            instance_config(config, section),
            default=section is chosen,
            pinned=section.pinned,
            idle_ttl_s=section.idle_ttl_s,
        )
        for section in config.models
    )
