"""Socket methods for backends: probe, use, install, bundle.install.

`use` persists the preference in the config file itself (`[backend] prefer`, written
atomically by daemon/config/edit.py, through a symlink to where the file really is), so the
file stays the single source of truth that `stoker config check`, an editor and the
hot-reload watcher all see; the daemon applies the new config at once (the watcher then finds
nothing new) and the launch machine relaunches on the new preference.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

import trio

from stoker.daemon.bundles.installed import InstalledBundle, bundle_meta_of
from stoker.daemon.config.edit import write_preference
from stoker.daemon.config.model import BackendConfig
from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.handlers.config_writes import refuse_while_invalid, rewrite_config
from stoker.daemon.control.params import Choices, Kind, Param, method
from stoker.daemon.control.replies import BundleInfo, Installed, PreferenceWritten, ProbeReply, ProbeReport
from stoker.daemon.control.status import build_status
from stoker.daemon.core.errors import StokerError
from stoker.daemon.probes.verdicts import ProbeResult
from stoker.states.launch import records as LR
from stoker.states.reasons import ReasonCode

# The loaded backend plugins are the only source of backend names (a third-party one included).
BACKENDS = Choices("a loaded backend", lambda daemon: daemon.backend_names)
PREFERENCES = Choices("auto or a loaded backend", lambda daemon: ("auto", *daemon.backend_names))


@method(
    "probe",
    Param("fresh", Kind.BOOLEAN, "Probe again even where a verdict younger than 30 s is cached.", default=False),
    Param("backends", Kind.STRINGS, "Only these backends (default: every loaded one).", choices=BACKENDS),
    result=ProbeReply,
)
async def probe(daemon: ControlledDaemon, params: Mapping[str, Any]) -> ProbeReply:
    """Probe the backends: is each one's hardware, driver and runtime there and usable?

    Verdicts younger than 30 s come from the cache unless `fresh`.
    Reply: {"backends": [Detection + generation, cached, age_s], "elapsed_s"}.
    """
    names = params["backends"] or list(daemon.backend_names)
    started = time.perf_counter()
    results = await daemon.probe_all(names, fresh=params["fresh"])
    return ProbeReply(
        backends=tuple(_report(r) for r in results.values()), elapsed_s=round(time.perf_counter() - started, 4)
    )


def _report(result: ProbeResult) -> ProbeReport:
    found = result.detection
    return ProbeReport(
        backend=found.backend,
        present=found.present,
        usable=found.usable,
        reason=None if found.reason is None else str(found.reason),
        message=found.message,
        devices=found.devices,
        evidence=dict(found.evidence),
        generation=result.generation,
        cached=result.cached,
        age_s=round(result.age_s, 3),
    )


@method(
    "use",
    Param(
        "backend",
        Kind.STRING,
        "The preference to persist: auto tries the backends in order; a name forces it.",
        required=True,
        choices=PREFERENCES,
    ),
    errors=(ReasonCode.CONFIG_INVALID,),
    result=PreferenceWritten,
)
async def use(daemon: ControlledDaemon, params: Mapping[str, Any]) -> PreferenceWritten:
    """Persist `[backend] prefer` in the config file and relaunch on it.

    Anything but auto is forced: that backend or a reason-coded failure, never a silent
    fallback. Refused while the config file is invalid (fix it first).
    Reply: {prefer, forced, config_path, relaunch, status (the status document)}.
    """
    value = params["backend"]
    refuse_while_invalid(daemon, "stoker use")
    path = daemon.paths.config_file
    before = daemon.supervisor.state
    changed = rewrite_config(  # relaunches a running server (a [backend] change)
        daemon,
        lambda file: write_preference(file, value),
        "The preference was written, but the config it makes was refused; the server keeps serving on the "
        "previous one: ",
    )
    if before is LR.LaunchState.FAILED:
        daemon.supervisor.offer(LR.UpRequested(daemon.launch_settings()))
    return PreferenceWritten(
        prefer=value,
        forced=BackendConfig(prefer=value).forced,
        config_path=str(path),
        relaunch=changed and before is not LR.LaunchState.STOPPED,
        status=build_status(daemon),
    )


@method(
    "install",
    Param("backend", Kind.STRING, "The backend whose engine bundle to install.", required=True, choices=BACKENDS),
    Param("variant", Kind.STRING, "This variant of the bundle (default: the one that fits the probed machine)."),
    errors=("<backend>_bundle_install_failed", ReasonCode.BUNDLE_VERIFY_FAILED, ReasonCode.ENGINE_SLOT_BUSY),
    result=Installed,
)
async def install(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Installed:
    """Probe the backend, resolve the fitting bundle from the manifest, download, verify and install it.

    Progress comes as `install.progress` events on the subscribe stream; a failure carries the
    precise cause (download, digest, archive, smoke test) in its evidence.
    Reply: {"installed": {root, server, backend, variant, version, cache_key}}.
    """
    backend = params["backend"]
    detection = (await daemon.probe(backend)).detection
    return _installed(await daemon.install(backend, variant=params["variant"], detection=detection))


@method(
    "bundle.install",
    Param("path", Kind.STRING, "The bundle zip to install, an absolute path the daemon can read.", required=True),
    Param("smoke", Kind.BOOLEAN, "Run the smoke test (where this machine can run the bundle's engine).", default=False),
    errors=(
        "<backend>_bundle_install_failed",
        ReasonCode.BUNDLE_VERIFY_FAILED,
        ReasonCode.BUNDLE_MISSING,
        ReasonCode.ENGINE_SLOT_BUSY,
    ),
    result=Installed,
)
async def bundle_install(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Installed:
    """Install a local bundle zip through the install machine, as a manifest bundle is installed.

    What `stoker bundle install` and `stoker run` ask of a running daemon: the same steps
    (copy, verify, unpack, validate, smoke if asked, promote) and history as `install`.
    Reply: {"installed": {root, server, backend, variant, version, cache_key}}.
    """
    path = Path(params["path"])
    if not path.is_absolute():
        raise StokerError(
            ReasonCode.BAD_REQUEST,
            "The bundle path must be absolute (the daemon has its own cwd).",
            {"path": str(path)},
        )
    detection = None
    if params["smoke"]:  # a GPU bundle's smoke test needs its device seen
        meta = await trio.to_thread.run_sync(bundle_meta_of, path)
        if meta.backend in daemon.backend_names:
            detection = (await daemon.probe(meta.backend)).detection
    return _installed(await daemon.install_file(path, smoke=params["smoke"], detection=detection))


def _installed(bundle: InstalledBundle) -> Installed:
    meta = bundle.meta
    cache_key = meta.build.get("cache_key")
    return Installed(
        BundleInfo(
            root=str(bundle.root),
            server=str(bundle.server),
            backend=meta.backend,
            variant=meta.variant,
            version=meta.version,
            cache_key=None if cache_key is None else str(cache_key),
        )
    )
