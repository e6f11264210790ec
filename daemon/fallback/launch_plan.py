"""The LaunchPlan, complete: every argument llama-server gets, decided here, when planning ends.

The launch machine records the plan in history (PlanReady) and the supervisor turns it into a
command line without reading the config, the model registry or the snapshot settings; so what
history shows is exactly what ran. Everything that shapes the command line is therefore
settled here, once per plan:

    -ngl            the backend plugin's answer (`Backend.launch_args`) for the count the config
                    asks for, or "auto" (the engine fits); the CPU's is -ngl 0
    devices         the GPUs the server may use when only some can take a layer
                    (daemon/fallback/vram.py), as the plugin spells it (`Backend.launch_env`:
                    CUDA_VISIBLE_DEVICES), recorded as the plan's `backend_env`
    -t, -fa         the config's threads (0: the engine decides) and flash attention
    extra args      the model's own (a chat template a well-known model needs), then --alias
                    NAME for a [models.NAME] model (the engine then answers with the name the
                    client routed by), then the user's extra_args, then --metrics (telemetry
                    reads tokens/s from /metrics), then the snapshot flags (--swa-full where the
                    KV cache must hold full SWA)
    --slot-save-path  always, so that turning snapshots on needs no relaunch
    --rpc, -ts      the RPC workers the placement uses and the split over their devices and the
                    local GPUs (daemon/fallback/workers.py, decided by states/fleet/rpc_placement.py),
                    with -ngl all (or the configured count): recorded as the plan's `rpc`

A respawn after a crash runs the same plan; a config change that touches any of these
re-plans (config.needs_relaunch), so the plan never goes stale while it is in use.
"""

from __future__ import annotations

from pathlib import Path

from stoker.daemon.backends.base import Backend, LaunchRequest
from stoker.daemon.bundles.installed import InstalledBundle
from stoker.daemon.config.model import Config
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.fallback.workers import with_worker_layers
from stoker.daemon.snapshots.layout import snapshot_server_args
from stoker.states.launch.records import GpuLayers, LaunchPlan
from stoker.states.fleet.rpc_placement import RpcPlacement

METRICS = "--metrics"


def complete_plan(
    paths: StokerPaths,
    config: Config,
    bundle: InstalledBundle,
    model_path: str | Path,
    n_gpu_layers: GpuLayers,
    plugin: Backend,
    devices: tuple[int, ...] = (),
    model_args: tuple[str, ...] = (),
    alias: str | None = None,
    rpc: RpcPlacement | None = None,
) -> LaunchPlan:
    """The whole plan for `bundle` (its backend and variant, run by `plugin`) and the model,
    on `devices` (the detected GPUs to give the server; empty: all), with the model's own
    arguments (`model_args`: a well-known model's chat template, daemon/models/known.py) and the
    name the engine reports as its model (`alias`; None: its file path, as without [models]),
    over the RPC workers of `rpc` (None: none configured).
    Blocking: it may read the model's GGUF header (for --swa-full) and creates the slot-save
    directory."""
    server = config.server
    request = LaunchRequest(n_gpu_layers, devices)
    slot_save_path, snapshot_args = snapshot_server_args(paths, config, model_path)
    return LaunchPlan(
        backend=bundle.meta.backend,
        variant=bundle.meta.variant,
        bundle_root=str(bundle.root),
        server_path=str(bundle.server),
        model_path=str(model_path),
        host=server.host,
        port=server.port,
        ctx_size=server.ctx_size,
        parallel=server.parallel,
        threads=server.threads,
        n_gpu_layers=server.n_gpu_layers if rpc is not None and rpc.used else n_gpu_layers,
        flash_attn=server.flash_attn,
        slot_save_path=str(slot_save_path),
        extra_args=(*model_args, *(("--alias", alias) if alias else ()), *server.extra_args, METRICS, *snapshot_args),
        # With RPC workers the layers go to devices whatever the local backend: the config's count
        # (a CPU plan's own is 0), "auto" as -ngl all (daemon/fallback/workers.py says why).
        backend_args=with_worker_layers(plugin.launch_args(request), rpc, server.n_gpu_layers),
        backend_env=plugin.launch_env(request),
        rpc=rpc,
    )
