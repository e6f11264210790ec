"""The launch machine's vocabulary: its states, data, plan, events and effects (pure data).

The transitions that use them are in states/launch/table.py and the exit policy in
states/launch/exits.py; callers import these records from here.
"""

from __future__ import annotations

import enum
from typing import Any, Literal, Union

import attrs

from stoker.states.machine import Failure, Observed, as_evidence, str_tuple
from stoker.states.reasons import ReasonCode
from stoker.states.server_process import ProcessExit, SpawnFailure
from stoker.states.fleet.rpc_placement import RpcPlacement

# The backend every fallback ends on, the one the engine always has. The machines treat it
# apart: a CPU server that dies before ready is respawned (there is nowhere to fall back to),
# any other is re-planned so that the fallback moves on.
CPU_BACKEND = "cpu"

# GPU layers, spelled one way everywhere (config, plan, spawn spec, status): a count, or
# "auto" (-ngl auto: the engine fits as many as free VRAM allows). A CPU plan has 0.
GpuLayers = Union[int, Literal["auto"]]


class LaunchState(enum.StrEnum):
    STOPPED = "stopped"
    PLANNING = "planning"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    CRASHED = "crashed"
    BACKOFF = "backoff"
    FAILED = "failed"


class AfterStop(enum.StrEnum):
    """What `stopping` leads to once the process is gone."""

    STOP = "stop"
    RESTART = "restart"
    CRASH = "crash"  # a stall before ready: counted as a crash, respawned
    HUNG = "hung"  # a ready server that showed no sign of life: counted as a crash, respawned
    FAIL = "fail"  # a server found at daemon start while failed: stopped, the failure stays


class DownCause(enum.StrEnum):
    """Who stopped a server that stays stopped, which says whether a request may load it again."""

    USER = "user"  # `stoker down`: it stays down until `stoker up` (a request is refused)
    EVICTED = "evicted"  # unloaded to make room for another model ([placement] max_loaded): loads on demand
    IDLE = "idle"  # unloaded after its idle TTL ([models.NAME] idle_ttl_s): loads on demand
    SHUTDOWN = "shutdown"  # the daemon stopped: loads on demand once it runs again
    REMOVED = "removed"  # its [models] section left the config


class ExitPhase(enum.StrEnum):
    """When a server died: before the machine ever saw it ready, or while it served."""

    NEVER_READY = "never_ready"
    AFTER_READY = "after_ready"


def _gpu_layers(value: Any) -> GpuLayers:
    # -1 is how plans recorded before "auto" had one spelling said it; read them as "auto".
    if value == "auto" or value == -1:
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'n_gpu_layers must be "auto" or an integer >= 0, got {value!r}')
    return value


def _env(value: Any) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, dict) else (value or ())
    return tuple(sorted((str(k), str(v)) for k, v in items))


def _mib_map(value: Any) -> dict[str, float]:
    return {str(k): float(v) for k, v in dict(value or {}).items()}


def _parts(value: Any) -> dict[str, dict[str, float]]:
    return {str(k): _mib_map(v) for k, v in dict(value or {}).items()}


# Which estimate answered a plan's memory figures (states/fleet/placement.py decides with them): the
# engine's own fitter (the bundle's llama-fit-params, run with the plan's arguments), Stoker's
# upper bound from the GGUF header where a `-ngl auto` plan clearly fits the free VRAM and no
# fitter ran (states/fallback/memory_bound.py), or Stoker's estimate (the file size plus the KV
# cache from the GGUF header, no compute buffers) where the fitter is absent or failed.
FITTER = "llama-fit-params"
STOKER_BOUND = "stoker-bound"
STOKER_ESTIMATE = "stoker"


@attrs.frozen
class MemoryEstimate:
    """What a plan's server is projected to hold, in MiB, and which estimate said so. `host_mib`
    is RAM (the model's part kept on the host, its KV cache and compute buffers there);
    `devices` the accelerators' (VRAM) by the engine's device name; `parts` each one's model,
    context and compute figures as the estimate gave them. `partial`: the figures leave out
    something the server will hold (Stoker's own estimate has no compute buffers). `detail`:
    the arguments the fitter fitted (a GPU plan with -ngl auto), or why it did not answer."""

    source: str
    host_mib: float
    devices: dict[str, float] = attrs.field(factory=dict, converter=_mib_map, hash=False)
    parts: dict[str, dict[str, float]] = attrs.field(factory=dict, converter=_parts, hash=False)
    partial: bool = False
    detail: str | None = None
    seconds: float | None = None  # how long the estimate took
    # A GPU plan the fitter fitted short of every layer (or of the context asked) to the free
    # VRAM: what the devices would hold with every layer and that context (empty otherwise).
    # Placement may unload idle models for the difference (states/fleet/placement.py, place_offload).
    whole: dict[str, float] = attrs.field(factory=dict, converter=_mib_map, hash=False)

    @property
    def vram_mib(self) -> float:
        """Summed over the accelerators."""
        return float(sum(self.devices.values()))

    @property
    def whole_vram_mib(self) -> float:
        """With every layer on the GPU(s), summed; 0 when the plan is not short of any."""
        return float(sum(self.whole.values()))


@attrs.frozen
class LaunchPlan:
    """Everything needed to spawn one llama-server, complete when planning ends: the command
    line is a function of this record alone, so what history records is what ran (paths are
    strings: JSON-stable). `n_gpu_layers` is what was planned (status shows it); the backend
    plugin turned it into `backend_args`. `extra_args` come after the named flags: the model's
    own arguments (a chat template), the user's extra_args, --metrics, the snapshot flags."""

    backend: str
    variant: str
    bundle_root: str
    server_path: str
    model_path: str
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int = 4096  # 0: no -c, the engine's default
    parallel: int = 1
    threads: int = 0  # 0: no -t, the engine decides
    n_gpu_layers: GpuLayers = attrs.field(default=0, converter=_gpu_layers)
    flash_attn: str | None = None  # "on" | "off" | "auto"; None: no -fa
    slot_save_path: str | None = None  # where the engine may save KV slots; None: no saving
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    # The backend plugin's own arguments for this plan (Backend.launch_args: -ngl, --device),
    # asked when planning ended. A plan recorded before they were asked ran `-ngl n_gpu_layers`.
    backend_args: tuple[str, ...] = attrs.field(
        default=attrs.Factory(lambda plan: ("-ngl", str(plan.n_gpu_layers)), takes_self=True), converter=str_tuple
    )
    # The environment the backend plugin sets for this plan's server (Backend.launch_env: the
    # devices it may use, e.g. CUDA_VISIBLE_DEVICES), sorted; recorded, so history shows it.
    backend_env: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_env)
    # The RPC workers this plan places layers on (states/fleet/rpc_placement.py), those it left out and
    # why; its `--rpc`/`--tensor-split` are in backend_args. None: no [[workers]] configured.
    rpc: RpcPlacement | None = None

    # What its server is projected to hold (the estimate placement decided with); not part of
    # what runs, so two plans with the same command line are equal whatever it says.
    memory: MemoryEstimate | None = attrs.field(default=None, eq=False)

    @property
    def on_cpu(self) -> bool:
        """A CPU plan: nothing is offloaded, and nowhere is left to fall back to."""
        return self.backend == CPU_BACKEND


@attrs.frozen
class PlanFailure:
    """The crash that asked for a new plan, as the machine judged it: what the next plan must
    avoid (a SIGILL'd CPU variant, a backend that never got its server ready)."""

    reason: ReasonCode
    phase: ExitPhase
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class LaunchSettings:
    """The machine's knobs; they travel in UpRequested/ConfigChanged so tests can vary them."""

    max_restarts: int = 5  # more consecutive crashes than this without Stable -> crash_loop
    stall_timeout: float = 120.0  # seconds without loading progress before the server is stopped
    stop_grace: float = 10.0  # seconds between TERM and KILL
    stable_after: float = 60.0  # seconds ready before the crash counter resets
    hung_after: float = 60.0  # seconds a ready server may show no sign of life before it is hung (0: never)
    # Seconds a planned stop of a ready server (down, restart, config relaunch) lets the requests
    # in flight through the front door finish before TERM: llama-server given TERM mid-request
    # hangs until the KILL after stop_grace, and the streams under it are cut.
    drain_timeout: float = 30.0


@attrs.frozen
class LaunchData:
    settings: LaunchSettings = LaunchSettings()
    crashes: int = 0  # consecutive crashes since the last Stable or user start
    restarts: int = 0  # restarts after a crash since the user last started the server
    plan: LaunchPlan | None = None
    pid: int | None = None
    create_time: float | None = None  # the process's start time: part of its identity
    after_stop: AfterStop = AfterStop.STOP
    replan_for: PlanFailure | None = None  # the last crash asked for a new plan, not a respawn
    plan_requests: int = 0  # MakePlan asked so far: a plan answers the newest request or is dropped
    spawning: bool = False  # a Spawn is out and its answer (Spawned or SpawnFailed) not yet back
    silent: bool = False  # ready, but the liveness watchdog sees no sign of life (Stable forgives nothing)
    reason: ReasonCode | None = None  # why the machine is where it is (None when healthy)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    down_cause: DownCause | None = None  # who stopped it, while a stop asked for lasts (None: never, or up since)
    # The `-c` a request asked for (Ollama's num_ctx, states/launch/context.py) over the config's:
    # every plan gets it until the server stops for good or a plan with it fails (None: the config's).
    ctx_size: int | None = None


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class UpRequested:
    """The user (or the daemon at start-up) wants the server running; `settings` replaces the knobs."""

    settings: LaunchSettings | None = None


@attrs.frozen
class DownRequested:
    """The server is to stop and stay stopped: the user's `down` (`cause` user), or the daemon's
    (evicted for another model, idle past its TTL, its shutdown, its [models] section removed);
    `evidence` says what decided it (an eviction: the model it made room for, max_loaded, the
    idle time; an idle unload: the idle time and the TTL)."""

    cause: DownCause = attrs.field(default=DownCause.USER, converter=DownCause)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class RestartRequested:
    """The user wants a fresh server now: stop, re-plan, start; the crash count starts over."""


@attrs.frozen
class ContextRequested:
    """A request needs a larger context than the server has (states/launch/context.py decided):
    plan with `ctx_size` as `-c` from now on, relaunching a running server (a planned restart);
    `evidence` holds the figures that decided."""

    ctx_size: int
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class ConfigChanged:
    """The model or server settings changed: relaunch if running."""

    settings: LaunchSettings | None = None


@attrs.frozen
class PlanReady:
    """MakePlan succeeded: spawn this plan. `request` is the MakePlan it answers (None: not
    said); an answer to an older request than the newest is refused."""

    plan: LaunchPlan
    request: int | None = None


@attrs.frozen
class PlanFailed(Failure):
    """No plan is possible (model missing, no usable backend): fail with the reason."""

    request: int | None = None  # the MakePlan it answers, as in PlanReady


@attrs.frozen
class Spawned:
    """The process exists: its pid and start time (identity), and where its log goes."""

    pid: int
    create_time: float | None = None
    log_path: str | None = None


@attrs.frozen
class Adopted:
    """After a daemon restart: the identity file proves a live server of ours (pid, start time,
    executable, command line, health and API key). The machine keeps it if it is the server it
    runs, and stops it otherwise."""

    pid: int
    create_time: float | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class OrphanFound:
    """After a daemon restart: the identity file names a live process of ours (pid, start time
    and executable match) that does not prove the rest (no health, or not our key): it is
    stopped, whatever the machine was doing."""

    pid: int
    create_time: float | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class NothingToAdopt(Observed):
    """After a daemon restart: the identity file proves no live process of ours (there is none,
    it is unreadable, or the process it names is gone): resume with no server."""


@attrs.frozen
class LoadStarted(Observed):
    """The HTTP listener answers (503 while loading the model)."""


@attrs.frozen
class Ready(Observed):
    """/health is 200 and the planned backend is really in use."""


@attrs.frozen
class ServerExited(ProcessExit):
    """The process is gone, unasked: its exit status and the classified reason, with the
    evidence that decided it. The machine judges it (fatal, new plan, or respawn) from the
    reason, the state it was in (the phase) and the plan's backend."""


@attrs.frozen
class SpawnFailed(SpawnFailure):
    """The process could not be started at all (the binary will not execute)."""


@attrs.frozen
class StallTimeout:
    """No loading progress for `stall_timeout` seconds."""


@attrs.frozen
class BackoffStarted:
    """The daemon chose the jittered delay for StartBackoff(attempt) and armed the timer."""

    delay: float


@attrs.frozen
class BackoffElapsed:
    """The backoff delay ran out: try again."""


@attrs.frozen
class Stable:
    """The server stayed ready for `stable_after` seconds: forget earlier crashes."""


@attrs.frozen
class EngineSilent:
    """The liveness watchdog saw no sign of life from the ready server for `silent_for` seconds:
    its facts (states/launch/liveness.py judged each sample) are in the evidence."""

    silent_for: float
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class EngineAnswered(Observed):
    """After EngineSilent: the watchdog sees signs of life again."""


@attrs.frozen
class StopCompleted:
    """The process is gone after Terminate (or was never there)."""

    returncode: int | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class MakePlan:
    """Choose backend, bundle and every argument; answer PlanReady or PlanFailed. `previous`
    is the last plan; after a crash that asked for a new plan, `failure` says what it was
    (reason, phase, the evidence that decided it) so that the planner avoids it."""

    previous: LaunchPlan | None = None
    failure: PlanFailure | None = None
    request: int = 0  # numbered: only the answer to the newest request is taken
    ctx_size: int | None = None  # the `-c` a request asked for (LaunchData.ctx_size); None: the config's


@attrs.frozen
class Spawn:
    """Start llama-server for the plan (its command line from the plan alone); answer
    Spawned, or SpawnFailed, and later ServerExited."""

    plan: LaunchPlan


@attrs.frozen
class WatchReadiness:
    """Follow the live server (spawned or adopted) until it is ready: LoadStarted, Ready,
    or StallTimeout after no progress."""

    stall_timeout: float


@attrs.frozen
class Terminate:
    """First up to `drain` seconds for the front door's requests in flight to finish (0: none),
    then TERM to the process group, `grace` seconds, then KILL; answer StopCompleted."""

    grace: float
    drain: float = 0.0


@attrs.frozen
class StartBackoff:
    """Compute the capped, jittered exponential delay for `attempt` (1-based), answer
    BackoffStarted(delay), then BackoffElapsed when it runs out."""

    attempt: int


@attrs.frozen
class Reattach:
    """At daemon start, before anything else runs: read the identity file (the evidence of a
    server that outlived the last daemon, whatever the store says) and answer what it proves:
    Adopted, OrphanFound or NothingToAdopt. `pid`/`create_time` are what the machine recorded.
    Never signal anything here: the machine decides what to stop."""

    pid: int | None
    create_time: float | None


@attrs.frozen
class WatchLiveness:
    """While ready: sample the server every `every` seconds (/health and /slots answered within
    `answer_within`, the process's CPU time and state); report EngineSilent while no sample
    shows a sign of life, EngineAnswered when one does again."""

    every: float
    answer_within: float


@attrs.frozen
class ArmStableTimer:
    """After `after` seconds still ready, fire Stable."""

    after: float


@attrs.frozen
class Notify:
    """Tell the service manager: kind "ready" (READY=1) or "status" (STATUS=text)."""

    kind: str
    text: str = ""


Effect = (
    MakePlan | Spawn | WatchReadiness | Terminate | StartBackoff | Reattach | WatchLiveness | ArmStableTimer | Notify
)
