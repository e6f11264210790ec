"""config.toml: defaults for everything, validation that reports every problem.

`load_config(path)` returns a frozen `Config` (defaults when the file is missing) or raises
`ConfigError` listing every problem as "section.key: what is wrong". Hot reload lives in
`daemon/config/watch.py`. Every key is documented in docs/config.md.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Literal, Mapping

import attrs

from stoker.daemon.config.checks import (
    Invalid,
    auto_or,
    boolean,
    byte_size,
    checked_values,
    describe,
    integer,
    loopback_ip,
    one_of,
    seconds,
    setting,
)
from stoker.daemon.config.engine import EngineConfig
from stoker.daemon.config.server_args import MODEL_KINDS, extra_args, gpu_layers
from stoker.daemon.config.frontdoor import FrontdoorConfig, address_from_env, lan_bind_problems
from stoker.daemon.config.ollama import OllamaConfig
from stoker.daemon.config.workers import (
    WorkerConfig,
    WorkerEndpoint,
    parse_workers,
    worker_bind_problems,
    workers_to_dict,
)
from stoker.daemon.config.placement import (
    DEFAULT_MODEL,
    ModelConfig,
    PlacementConfig,
    backend_preference,
    model_spec,
    models_problems,
    models_to_dict,
    parse_models,
)
from stoker.daemon.config.remote import RemoteModelConfig, remote_problems, split_remotes
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.logfiles import DEFAULT_KEEP, DEFAULT_MAX_BYTES, LogRotation
from stoker.daemon.core.paths import StokerPaths
from stoker.states.pull.lookup import ModelForm, model_form
from stoker.states.reasons import ReasonCode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Changes to these keys take effect only when llama-server is relaunched: besides [server]
# and [backend], swa_full is a llama-server flag (--swa-full).
RELAUNCH_SECTIONS = frozenset({"server", "backend", "workers"})
RELAUNCH_KEYS = frozenset({"snapshots.swa_full"})


class ConfigError(StokerError):
    """An invalid config: reason config_invalid; `problems` lists every one found."""

    def __init__(self, problems: list[str], path: Path | str | None = None) -> None:
        self.problems = list(problems)
        self.path = None if path is None else Path(path)
        evidence: dict[str, Any] = {"problems": self.problems}
        if self.path is not None:
            evidence["path"] = str(self.path)
        count = len(self.problems)
        super().__init__(
            ReasonCode.CONFIG_INVALID,
            f"The config file{'' if path is None else f' {path}'} has {count} "
            f"problem{'s' if count != 1 else ''}; fix {'them' if count != 1 else 'it'} "
            f"(`stoker config check` lists every one).",
            evidence,
        )


# --- value checks of these sections (the generic ones: daemon/config/checks.py) ---


def _log_size(value: Any) -> int:
    size = byte_size(value)
    if size < 64 * 2**10:
        raise Invalid(f"must be at least 64 KiB (a launch's own lines take about 16 KB), got {size} bytes")
    return size


def _swa_full(value: Any) -> bool | str:
    if isinstance(value, bool) or value == "auto":
        return value
    raise Invalid(f'must be "auto", true or false, got {describe(value)}')


def _manifest(value: Any) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a path or an https://, http://127.0.0.1 or file:// URL, got {describe(value)}")
    if re.match(r"^[a-z][a-z0-9+.-]*://", value) and not re.match(
        r"^(https://|file://|http://(127\.0\.0\.1|localhost|\[::1\])[:/])", value
    ):
        raise Invalid(f"must be https:// (http:// only on loopback) or file://, got {value!r}"[:200])
    return value


def _trusted_keys(value: Any) -> tuple[str, ...]:
    from stoker.daemon.core.signing import SignatureError, parse_public_key

    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise Invalid(f'must be a list of public keys like "ed25519:BASE64", got {describe(value)}')
    for item in value:
        try:
            parse_public_key(item)
        except SignatureError as err:
            raise Invalid(f"{item[:60]!r}: {err}") from None
    return tuple(dict.fromkeys(value))


# --- the sections -------------------------------------------------------------------------


@attrs.frozen
class ServerConfig:
    model: str = setting(DEFAULT_MODEL, model_spec)
    host: str = setting("127.0.0.1", loopback_ip)
    port: int = setting(0, integer(0, 65535))
    ctx_size: int = setting(4096, integer(0, 1 << 24))
    parallel: int = setting(1, integer(1, 256))
    threads: int = setting(0, integer(0, 4096))
    n_gpu_layers: int | Literal["auto"] = setting("auto", gpu_layers)
    flash_attn: str = setting("auto", one_of("auto", "on", "off"))
    extra_args: tuple[str, ...] = setting((), extra_args)
    # What the engine is started for: "auto" reads it from the model (an embedding model's GGUF
    # states its pooling), "chat", "embedding" (--embeddings) or "rerank" (--reranking).
    kind: str = setting("auto", one_of("auto", *MODEL_KINDS))
    stall_timeout_s: float = setting(120.0, seconds())
    ready_timeout_s: float = setting(600.0, seconds())


@attrs.frozen
class BackendConfig:
    prefer: str = setting("auto", backend_preference)
    cpu_variant: str = setting("auto", one_of("auto", "avx2", "compat", "native"))

    @property
    def forced(self) -> bool:
        """Anything but auto is forced: no fallback to another backend."""
        return self.prefer != "auto"


@attrs.frozen
class SupervisorConfig:
    backoff_initial_s: float = setting(0.5, seconds(high=3600))
    backoff_max_s: float = setting(30.0, seconds(high=24 * 3600))
    max_restarts: int = setting(5, integer(0, 1000))
    stable_after_s: float = setting(30.0, seconds(allow_zero=True))
    stop_grace_s: float = setting(10.0, seconds(high=3600))
    hung_after_s: float = setting(60.0, seconds(allow_zero=True))


@attrs.frozen
class SnapshotsConfig:
    enabled: bool = setting(True, boolean)
    max_count: int = setting(8, integer(0, 10_000))
    # "auto": two full-context saves of every slot, at least 2 GiB (states/snapshots/policy.py).
    max_bytes: int | Literal["auto"] = setting("auto", auto_or(byte_size))
    # Every save before a planned stop together; "auto": twice the KV to save at the measured
    # save speed, plus 5 s, within 20 s .. 10 min.
    stop_budget_s: float | Literal["auto"] = setting("auto", auto_or(seconds(high=3600)))
    swa_full: bool | str = setting("auto", _swa_full)


@attrs.frozen
class BundlesConfig:
    # The published-bundles manifest (docs/bundles.md): a path or URL; "" means the
    # STOKER_MANIFEST_URL environment variable, or none (on-demand installs then fail).
    manifest: str = setting("", _manifest)
    # The public keys a manifest must be signed by (docs/mirror.md): `ed25519:BASE64`, what
    # `stoker bundle keygen` prints. None: only a local manifest is read, unchecked.
    trusted_keys: tuple[str, ...] = setting((), _trusted_keys)


@attrs.frozen
class LogsConfig:
    # The server log and the daemon log (logs/ in the data dir): each is rotated past max_bytes,
    # `keep` older generations kept beside it (name.1 the newest).
    max_bytes: int = setting(DEFAULT_MAX_BYTES, _log_size)
    keep: int = setting(DEFAULT_KEEP, integer(0, 100))

    @property
    def rotation(self) -> LogRotation:
        return LogRotation(self.max_bytes, self.keep)


SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "backend": BackendConfig,
    "supervisor": SupervisorConfig,
    "snapshots": SnapshotsConfig,
    "bundles": BundlesConfig,
    "logs": LogsConfig,
    "frontdoor": FrontdoorConfig,
    "ollama": OllamaConfig,
    "placement": PlacementConfig,
    "engine": EngineConfig,
    "worker": WorkerConfig,
}


@attrs.frozen
class Config:
    """The whole configuration; every field has a default."""

    server: ServerConfig = attrs.field(factory=ServerConfig)
    backend: BackendConfig = attrs.field(factory=BackendConfig)
    supervisor: SupervisorConfig = attrs.field(factory=SupervisorConfig)
    snapshots: SnapshotsConfig = attrs.field(factory=SnapshotsConfig)
    bundles: BundlesConfig = attrs.field(factory=BundlesConfig)
    logs: LogsConfig = attrs.field(factory=LogsConfig)
    frontdoor: FrontdoorConfig = attrs.field(factory=FrontdoorConfig)
    ollama: OllamaConfig = attrs.field(factory=OllamaConfig)  # Ollama's API (daemon/config/ollama.py)
    placement: PlacementConfig = attrs.field(factory=PlacementConfig)
    engine: EngineConfig = attrs.field(factory=EngineConfig)  # engine updates (daemon/config/engine.py)
    models: tuple[ModelConfig, ...] = ()  # [models.NAME] in file order (daemon/config/placement.py)
    worker: WorkerConfig = attrs.field(factory=WorkerConfig)  # this host as an RPC worker (daemon/config/workers.py)
    workers: tuple[WorkerEndpoint, ...] = ()  # [[workers]]: the RPC workers the head places layers on
    # [models.NAME] sections with an `endpoint`: served by an external engine (daemon/config/remote.py)
    remotes: tuple[RemoteModelConfig, ...] = ()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base_dir: Path | None = None) -> "Config":
        """Validate parsed TOML; raises ConfigError with every problem.

        A relative model path is resolved against `base_dir` (the config file's directory).
        """
        problems: list[str] = []
        sections: dict[str, Any] = {}
        for name, table in data.items():
            if name == "workers":
                continue  # [[workers]]: an array of tables, parsed below
            if name not in SECTIONS and name != "models":
                problems.append(f"{name}: unknown section (known: {', '.join(SECTIONS)}, models, workers)")
            elif not isinstance(table, dict):
                problems.append(f"{name}: must be a table ([{name}]), got {describe(table)}")
        for name, section_cls in SECTIONS.items():
            table = data.get(name, {})
            if not isinstance(table, dict):
                continue
            sections[name] = _build_section(name, section_cls, table, problems)
        local_models, remotes = split_remotes(data.get("models", {}), problems)
        models = parse_models(local_models, problems)
        problems.extend(remote_problems(remotes, [m.name for m in models if m.default]))
        workers = parse_workers(data.get("workers"), problems)
        _check_across(sections, problems)
        if "placement" in sections and "server" in sections:
            problems.extend(models_problems(models, sections["placement"], sections["server"].port))
        if problems:
            raise ConfigError(problems)
        config = cls(**sections, models=models, workers=workers, remotes=remotes)
        return _resolve_model(config, base_dir)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain data: {section: {key: value}} (lists, not tuples); `models`: {NAME: {key: value}}."""
        return {
            **{
                name: {
                    key: list(value) if isinstance(value, tuple) else value
                    for key, value in attrs.asdict(getattr(self, name)).items()
                }
                for name in SECTIONS
            },
            "models": {**models_to_dict(self.models), **{r.name: r.to_dict() for r in self.remotes}},
            "workers": workers_to_dict(self.workers),
        }


def _build_section(name: str, section_cls: type, table: Mapping[str, Any], problems: list[str]) -> Any:
    fields = {field.name: field for field in attrs.fields(section_cls)}
    return section_cls(**checked_values(name, fields, table, problems))


def _check_across(sections: Mapping[str, Any], problems: list[str]) -> None:
    if (frontdoor := sections.get("frontdoor")) is not None:
        problems.extend(lan_bind_problems(frontdoor))
    if (worker := sections.get("worker")) is not None:
        problems.extend(worker_bind_problems(worker))
    supervisor = sections.get("supervisor")
    if supervisor is not None and supervisor.backoff_max_s < supervisor.backoff_initial_s:
        problems.append(
            f"supervisor.backoff_max_s: must be at least backoff_initial_s "
            f"({supervisor.backoff_initial_s:g}), got {supervisor.backoff_max_s:g}"
        )


def _resolve_path(spec: str, base_dir: Path | None) -> str:
    if model_form(spec) is not ModelForm.PATH:
        return spec
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return str(path)


def _resolve_model(config: Config, base_dir: Path | None) -> Config:
    """Relative model paths ([server] and each [models.NAME]) resolved against `base_dir`."""
    server = attrs.evolve(config.server, model=_resolve_path(config.server.model, base_dir))
    models = tuple(attrs.evolve(m, model=_resolve_path(m.model, base_dir)) for m in config.models)
    return attrs.evolve(config, server=server, models=models)


def parse_config(
    text: str, base_dir: Path | None = None, path: Path | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Parse and validate TOML text, with the front door's address from `environ` (STOKER_HOST,
    STOKER_PORT) over the file's; raises ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError([f"toml: not valid TOML: {err}"], path) from None
    address, problems = address_from_env(environ or {})
    if problems:
        raise ConfigError(problems, path)
    if address:
        frontdoor = data.get("frontdoor")
        data["frontdoor"] = {**(frontdoor if isinstance(frontdoor, dict) else {}), **address}
    try:
        return Config.from_mapping(data, base_dir)
    except ConfigError as err:
        raise ConfigError(err.problems, path) from None


def default_config_path() -> Path:
    return StokerPaths.from_env().config_file


def load_config(path: Path | str | None = None) -> Config:
    """The config at `path` (default: the user's config.toml; defaults if it does not exist), with
    STOKER_HOST and STOKER_PORT from this process's environment."""
    path = default_config_path() if path is None else Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = b""
    except OSError as err:
        raise ConfigError([f"file: cannot be read: {err.strerror or err}"], path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError([f"file: is not UTF-8 text: {err}"], path) from None
    return parse_config(text, path.absolute().parent, path, os.environ)


def _flatten(config: Config) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.to_dict().items() for key, value in values.items()}


def config_diff(old: Config, new: Config) -> set[str]:
    """The "section.key" names whose values differ (a [models.NAME] added or removed: "models.NAME")."""
    before, after = _flatten(old), _flatten(new)
    return {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}


def needs_relaunch(old: Config, new: Config) -> bool:
    """Whether going from `old` to `new` needs llama-server relaunched."""
    return any(key.split(".", 1)[0] in RELAUNCH_SECTIONS or key in RELAUNCH_KEYS for key in config_diff(old, new))
