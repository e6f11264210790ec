"""Control commands for backends: probe, use, install.

`use` persists the preference in the config file itself (`[backend] prefer`, written
atomically), so the file stays the single source of truth that `stoker config check`, an
editor and the hot-reload watcher all see; the daemon applies the new config at once (the
watcher then finds nothing new) and the launch machine relaunches on the new preference.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from daemon.config.model import BackendConfig, ConfigError, load_config, parse_config
from daemon.core.errors import StokerError
from daemon.control.handlers.service import handler, status_of
from states import launch as L
from states.reasons import ReasonCode

if TYPE_CHECKING:
    from daemon.service import Daemon

USE_CHOICES = ("auto", "cpu", "cuda", "rocm", "vulkan", "metal")


def _params(params: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(params) - allowed
    if unknown:
        raise StokerError(ReasonCode.BAD_REQUEST, f"Unknown parameters {sorted(unknown)}.")


def _backend_param(daemon: "Daemon", params: Mapping[str, Any]) -> str:
    backend = params.get("backend")
    if not isinstance(backend, str) or backend not in daemon.probes.backends:
        raise StokerError(ReasonCode.BAD_REQUEST, f"backend must be one of {', '.join(daemon.probes.backends)}.",
                          {"backend": backend})
    return backend


@handler("probe")
async def probe(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{fresh?: bool, backends?: [name]} -> {"backends": [Detection + generation, cached,
    age_s], "elapsed_s"}. Verdicts younger than 30 s come from the cache unless fresh."""
    _params(params, {"fresh", "backends"})
    fresh = params.get("fresh", False)
    if not isinstance(fresh, bool):
        raise StokerError(ReasonCode.BAD_REQUEST, "fresh must be true or false.")
    names = params.get("backends") or list(daemon.probes.backends)
    if not isinstance(names, list) or not all(isinstance(n, str) and n in daemon.probes.backends for n in names):
        raise StokerError(ReasonCode.BAD_REQUEST, f"backends must name loaded backends: {list(daemon.probes.backends)}.")
    started = time.perf_counter()
    results = await daemon.probes.probe_all(names, fresh=fresh)
    return {"backends": [r.to_dict() for r in results.values()],
            "elapsed_s": round(time.perf_counter() - started, 4)}


def set_backend_prefer(text: str, value: str) -> str:
    """`text` (a config.toml) with `[backend] prefer = value`, everything else untouched."""
    line = f'prefer = "{value}"'
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\s*backend\s*\]\s*(#.*)?$")
    any_header = re.compile(r"^\s*\[")
    start = next((i for i, l in enumerate(lines) if header.match(l)), None)
    if start is None:
        body = text.rstrip("\n")
        return (body + "\n\n" if body else "") + f"[backend]\n{line}\n"
    end = next((i for i in range(start + 1, len(lines)) if any_header.match(lines[i])), len(lines))
    key = re.compile(r"^\s*prefer\s*=")
    for i in range(start + 1, end):
        if key.match(lines[i]):
            lines[i] = line
            break
    else:
        lines.insert(start + 1, line)
    return "\n".join(lines) + "\n"


def write_preference(path: Path, value: str) -> None:
    """Set `[backend] prefer` in the config file atomically (tmp, fsync, rename)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        text = ""
    new = set_backend_prefer(text, value)
    parse_config(new, path.parent, path)  # never write a file the daemon would refuse
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(new)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


@handler("use")
async def use(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{backend: auto|cpu|cuda|rocm|vulkan|metal} -> {prefer, forced, config_path, relaunch,
    status}. Persists `[backend] prefer` in the config file and relaunches on it; anything but
    auto is forced: that backend or a reason-coded failure, never a silent fallback."""
    _params(params, {"backend"})
    value = params.get("backend")
    if value not in USE_CHOICES:
        raise StokerError(ReasonCode.BAD_REQUEST, f"backend must be one of {', '.join(USE_CHOICES)}.",
                          {"backend": value})
    if daemon.config_problems:
        raise StokerError(ReasonCode.CONFIG_INVALID, "The config file is invalid; fix it before `stoker use`.",
                          {"problems": daemon.config_problems})
    path = daemon.paths.config_file
    try:
        write_preference(path, value)
        new = load_config(path)
    except ConfigError as err:
        raise StokerError(ReasonCode.CONFIG_INVALID, err.message, err.evidence) from None
    except OSError as err:
        raise StokerError(ReasonCode.CONFIG_INVALID, f"Cannot write {path}: {err}.", {"path": str(path)}) from None
    changed = new != daemon.config
    before = daemon.supervisor.state
    daemon.on_config_change(new)  # relaunches a running server (a [backend] change)
    if before is L.LaunchState.FAILED:
        daemon.supervisor.offer(L.UpRequested(daemon.launch_settings()))
    return {
        "prefer": value,
        "forced": BackendConfig(prefer=value).forced,
        "config_path": str(path),
        "relaunch": changed and before is not L.LaunchState.STOPPED,
        "status": status_of(daemon),
    }


@handler("install")
async def install(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{backend, variant?} -> {"installed": {root, server, backend, variant, version, cache_key}}.
    Probes the backend, resolves the fitting bundle from the manifest, downloads it (progress
    as `install.progress` events on the subscribe stream), verifies and installs it."""
    _params(params, {"backend", "variant"})
    backend = _backend_param(daemon, params)
    variant = params.get("variant")
    if variant is not None and not isinstance(variant, str):
        raise StokerError(ReasonCode.BAD_REQUEST, "variant must be a string.")
    detection = (await daemon.probes.probe(backend)).detection
    bundle = await daemon.installs.install(backend, variant=variant, detection=detection)
    return {"installed": bundle.to_dict()}
