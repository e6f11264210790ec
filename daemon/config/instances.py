"""The models the daemon serves, each with the config its server is launched with.

Without `[models]`: one model, `[server] model`, as instance `default` (what Stoker always
served, under the same history ids). With `[models.NAME]` sections: one per section, in file
order, each launched with `[server]` and `[backend]` overlaid with its section
(`instance_config`, the one place that overlay is made), so the launch supervisor, the
fallback orchestrator and the plan read `config.server` and `config.backend` as they always
have and never learn which section a value came from.

Then every catalog name no configured model claims: servable by that name with no config edit,
loaded on demand and unloaded after CATALOG_IDLE_TTL_S idle, launched with `[server]` and
`[backend]` as they are. Catalog names that reference one file (the bytes are stored once) are
one model answering to each. A vision projector's row is never a model of its own.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

import attrs

from stoker.daemon.config.model import Config
from stoker.daemon.config.placement import ModelConfig, default_model
from stoker.daemon.config.server_args import chat_template_args, sampling_args
from stoker.store.catalog import ModelRecord
from stoker.states.pull.lookup import ModelForm, model_form

DEFAULT_INSTANCE = "default"
# A catalog model no [models] section names is unloaded after this many idle seconds (as Ollama's
# keep-alive); a section's idle_ttl_s says otherwise for a configured one.
CATALOG_IDLE_TTL_S = 300.0


@attrs.frozen
class ServedModel:
    """One model the daemon serves: its NAME (its instance's), the config its server is
    launched with, and how it is placed."""

    name: str
    config: Config  # [server]/[backend] with this model's section laid over them
    default: bool = False  # requests naming no configured model (or "default") go here
    pinned: bool = False  # started with the daemon, never unloaded to make room
    idle_ttl_s: float = 0.0  # 0: never unloaded for being idle
    aliases: tuple[str, ...] = ()  # more names a request may send: the section's, the catalog's
    catalog: bool = False  # served because the catalog has it, no [models] section names it

    @property
    def spec(self) -> str:
        """The model as the config names it: a catalog name or a path."""
        return self.config.server.model

    @property
    def autostart(self) -> bool:
        """Started with the daemon: the default and the pinned ones; the others load on demand."""
        return self.default or self.pinned

    @property
    def engine_alias(self) -> str:
        """The model id its engine is told to report (`--alias`): its public id, so answers
        carry a name the client may send, never the file's path."""
        return self.public_id

    @cached_property
    def public_id(self) -> str:
        """The id /v1/models lists it under: its NAME; without [models] (and for a catalog
        model) the model's own name (its catalog name, or its file's name), the one the user wrote.
        Worked out once (a config change makes new records): every forwarded request asks."""
        if self.catalog or (not self.config.models and self.name == DEFAULT_INSTANCE):
            return Path(self.spec).name if model_form(self.spec) is ModelForm.PATH else self.spec
        return self.name


def instance_config(config: Config, section: ModelConfig) -> Config:
    """The config a model's server is launched with: `[server]` and `[backend]` with the
    section's keys laid over them (a key the section leaves out keeps the shared value)."""
    shared = config.server
    server = attrs.evolve(
        shared,
        model=section.model,
        ctx_size=shared.ctx_size if section.ctx_size is None else section.ctx_size,
        parallel=shared.parallel if section.parallel is None else section.parallel,
        threads=shared.threads if section.threads is None else section.threads,
        n_gpu_layers=shared.n_gpu_layers if section.n_gpu_layers is None else section.n_gpu_layers,
        kind=shared.kind if section.kind is None else section.kind,
        extra_args=(
            *shared.extra_args,
            *section.extra_args,
            *chat_template_args(section.chat_template),
            *sampling_args(section.sampling()),
            *(("--mmproj", _projector(section.mmproj)) if section.mmproj else ()),
        ),
    )
    backend = config.backend if section.prefer is None else attrs.evolve(config.backend, prefer=section.prefer)
    return attrs.evolve(config, server=server, backend=backend)


def _projector(value: str) -> str:
    return str(Path(value).expanduser()) if model_form(value) is ModelForm.PATH else value


def served_models(
    config: Config, catalog: Sequence[ModelRecord] = (), same_as: Callable[[str], str | None] = lambda name: None
) -> tuple[ServedModel, ...]:
    """Every model the config serves with a server of its own, the default one marked (none
    when a remote section, served by its endpoint, is the default: daemon/config/remote.py),
    then every catalog model none of them serves. `same_as` names what a name means (a known
    name's FAMILY:TAG): a catalog name that means what a configured model's name means is one
    more name of that model (`smollm2` reaches the default `smollm2-135m-instruct`)."""
    remote_default = any(r.default for r in config.remotes)
    if not config.models:
        configured = [ServedModel(DEFAULT_INSTANCE, config, default=not remote_default)]
    else:
        chosen = None if remote_default else default_model(config.models)
        configured = [
            ServedModel(
                section.name,
                instance_config(config, section),
                default=section is chosen,
                pinned=section.pinned,
                idle_ttl_s=section.idle_ttl_s,
                aliases=section.aliases,
            )
            for section in config.models
        ]
    return _with_catalog(config, configured, catalog, same_as)


def _with_catalog(
    config: Config, configured: list[ServedModel], catalog: Sequence[ModelRecord], same_as: Callable[[str], str | None]
) -> tuple[ServedModel, ...]:
    """The configured models, then one model per cataloged file for the catalog names no
    configured model claims (its spec, NAME or aliases, the same meaning, or the same file),
    named by the shortest of them. Which
    member serves a name never depends on which other names were pulled since: a configured
    model's own row appearing later does not take another name's model away."""
    taken = {s.name for s in configured} | {s.spec for s in configured} | {a for s in configured for a in s.aliases}
    meaning = {m: index for index, s in enumerate(configured) if (m := same_as(s.spec)) is not None}
    # The file each configured model serves (by its catalog row, or its path): a catalog name of
    # that file is one more name of that model, never a second server of the same bytes.
    rows = {r.spec: r for r in catalog if r.spec} | {r.name: r for r in catalog}
    serving: dict[str, int] = {}
    for at, served in enumerate(configured):
        row_of = rows.get(served.spec)
        if row_of is not None:
            serving.setdefault(os.path.realpath(row_of.path), at)
        elif model_form(served.spec) is ModelForm.PATH:
            serving.setdefault(os.path.realpath(served.spec), at)
    result = list(configured)
    files: dict[str, list[ModelRecord]] = {}
    for row in catalog:
        if _projector_row(row) or row.name in taken:
            continue
        index = meaning.get(same_as(row.name) or "")
        if index is None:
            index = serving.get(os.path.realpath(row.path))
        if index is not None:
            result[index] = attrs.evolve(result[index], aliases=(*result[index].aliases, row.name))
            taken.add(row.name)
            continue
        files.setdefault(os.path.realpath(row.path), []).append(row)
    for group in files.values():
        names = sorted({r.name for r in group}, key=lambda n: (len(n), n))
        primary = names[0]
        config_of = attrs.evolve(config, server=attrs.evolve(config.server, model=primary))
        instance = _instance_name(primary, {s.name for s in result})
        result.append(
            ServedModel(instance, config_of, idle_ttl_s=CATALOG_IDLE_TTL_S, aliases=tuple(names[1:]), catalog=True)
        )
    return tuple(result)


def _projector_row(row: ModelRecord) -> bool:
    """A vision projector's catalog row (pulled beside its model): never served alone."""
    return row.architecture == "clip" or row.name.endswith(".mmproj")


def _instance_name(name: str, taken: set[str]) -> str:
    """A catalog name as an instance name (1-32 of a-z, 0-9, '_', '-'), unique among `taken`."""
    base = re.sub(r"[^a-z0-9_-]+", "-", name.lower()).strip("-_")[:28] or "model"
    candidate, n = base, 1
    while candidate in taken or candidate == DEFAULT_INSTANCE:
        n += 1
        candidate = f"{base}-{n}"
    return candidate
