"""The fallback orchestrator: per launch request, the preferred backend first, CPU last.

It answers the launch machine's `MakePlan` by handing its facts to the fallback machine
(states/fallback/table.py) as `PlanRequested`, whose table decides what the request means (a start
that failed on the backend being launched: record `<backend>_startup_failed` and move on;
anything else: start afresh), and by carrying out that machine's effects:

    ProbeCandidates   probe every candidate at once, so each check reads the cache
    CheckBackend(b)   probe b (the 30 s cache answers most of the time) and look for its
                      installed bundle, checked against the hardware (driver floor, archs);
                      read free VRAM now (daemon/fallback/vram.py): the table decides from
                      that reading whether any GPU has room for a layer and which GPUs the
                      server gets, and it is the one the plan's figures quote
    InstallBundle(b)  only when the sole problem is a missing bundle (BundleMissing): install
                      from the manifest, then re-check
    InstallBeside(b)  the same install as a task of `tasks` (the member's), when only a local
                      build has the bundle (`InstallService.first_source`): the plan goes on to
                      the next candidate; EngineBuilt or EngineBuildFailed when it ends
    Upgrade(b)        the built bundle is preferred to the one serving: `restart` (a planned
                      restart, so the front door holds requests and snapshots carry the
                      conversations across), whose new plan starts from the first candidate
    UsePlan(b)        the complete LaunchPlan for b (daemon/fallback/launch_plan.py)
    GiveUp(reason)    no backend left, or the forced one failed: PlanFailed(reason)

Every skipped backend is a transition with its reason and evidence. After the server is
ready, `on_ready` has daemon/fallback/proof.py gather what a GPU plan proved (the engine's
`offloaded N/M layers to GPU`, its devices and, where the platform reports it, the server's
own VRAM) and reports it as `LaunchSucceeded`; the table's verdict (states/fallback/proof.py)
reports a server not really accelerated as CPU with `<backend>_gpu_layers_zero` or
`gpu_claimed_but_unused`. One orchestrator per server instance, with its own fallback machine.
"""

from __future__ import annotations

import logging
import platform
from typing import Any, Awaitable, Callable, Mapping, Protocol

import attrs
import trio

from stoker.daemon.backends.base import Backend, Detection, ReasonKind
from stoker.daemon.backends.registry import candidates_for, family_reason
from stoker.daemon.bundles.installed import InstalledBundle, list_installed
from stoker.daemon.config.model import Config
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.machines import EffectDriver, MachineRunner, Publish
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.engine.exits import missing_library
from stoker.daemon.fallback.cpu_plan import cpu_bundle, missing_cpu_bundle
from stoker.daemon.fallback.launch_plan import complete_plan
from stoker.daemon.fallback.layers import (
    LayerEstimate,
    estimate,
    fit_margin,
    offload_kind,
    why_actual,
    why_planned,
    why_with_workers,
)
from stoker.daemon.fallback.proof import read_proof
from stoker.daemon.fallback.vram import keeps_to, read_free_vram
from stoker.daemon.fallback.workers import confirm_placement, plan_workers
from stoker.daemon.install.installer import InstallService
from stoker.daemon.launch.instance import ServerInstance
from stoker.daemon.models.pull import PullService
from stoker.daemon.models.resolve import locate_model
from stoker.daemon.probes.verdicts import ProbeService
from stoker.states.fallback import table as F
from stoker.states.fallback.fit_reuse import FitRoom
from stoker.states.launch import records as LR
from stoker.states.fallback.proof import acceleration_verdict
from stoker.states.fallback.vram import FreeVram, VramCheck
from stoker.states.install.sources import Source
from stoker.states.machine import IllegalTransition
from stoker.states.reasons import ReasonCode, message_for
from stoker.store.database import Store

log = logging.getLogger(__name__)


class ServedPlan(Protocol):
    """A server instance as the fallback sees it after the launch: its plan, and what the
    engine said when it became ready (the launch supervisor is one)."""

    @property
    def plan(self) -> LR.LaunchPlan | None: ...

    @property
    def ready_evidence(self) -> Mapping[str, Any] | None: ...


@attrs.define(eq=False)
class PlanRequest:
    """One MakePlan being answered: the config it is planned for, the request, the model
    file, and the plan once UsePlan has made it."""

    config: Config
    effect: LR.MakePlan
    model: str
    model_args: tuple[str, ...] = ()  # the model's own server arguments (a well-known one's chat template)
    plan: LR.LaunchPlan | None = None
    free: dict[str, FreeVram | None] = attrs.field(factory=dict)  # each checked GPU backend's reading


def exit_detail(backend: str, reason: ReasonCode, evidence: Mapping[str, Any]) -> dict[str, Any]:
    """What decided a GPU server's early exit, for <backend>_startup_failed: the deciding log
    line, a library the loader could not find, the exit status, the log's last lines, and a
    sentence built from them (the code's own names every cause it may have)."""
    tail = [str(line) for line in (evidence.get("log_tail") or [])][-8:]
    detail = {k: evidence[k] for k in ("line", "returncode", "signal") if evidence.get(k) is not None}
    missing = missing_library(tail)
    if missing:
        detail["missing_library"] = missing
    if tail:
        detail["log_tail"] = tail
    detail["message"] = startup_sentence(backend, reason, detail)
    return detail


def startup_sentence(backend: str, reason: ReasonCode, detail: Mapping[str, Any]) -> str:
    """The one true sentence about a server that died before it was ready, from its evidence:
    a missing library, an out-of-memory exit, else how it ended and its last log line."""
    if detail.get("missing_library"):
        return (
            f"The {backend} server could not start: the loader could not find {detail['missing_library']}. "
            f"Reinstall the bundle (`stoker install {backend}`) or install that library."
        )
    if reason == ReasonCode.OUT_OF_MEMORY:
        line = f" ({detail['line']})" if detail.get("line") else ""
        return (
            f"The {backend} server ran out of memory before it was ready{line}. Free VRAM, or lower the "
            f"context size or n_gpu_layers."
        )
    how = (
        f"was killed by signal {detail['signal']}"
        if detail.get("signal")
        else f"exited with status {detail['returncode']}"
        if detail.get("returncode") is not None
        else "exited"
    )
    tail = detail.get("log_tail") or []
    last = detail.get("line") or (tail[-1] if tail else None)
    said = f"; its log: {last}" if last else ""
    return f"The {backend} server {how} before it was ready ({reason}){said}. See the server log and `stoker history`."


def detection_evidence(detection: Detection) -> dict[str, Any]:
    """A detection as fallback evidence: the verdict, the devices and what decided it."""
    return {
        "message": detection.message,
        "present": detection.present,
        "devices": [d.to_dict() for d in detection.devices],
        **dict(detection.evidence),
    }


@attrs.define(eq=False)
class FallbackOrchestrator:
    """Plans launches for the supervisor, walking the fallback machine through the backends."""

    paths: StokerPaths
    store: Store
    probes: ProbeService
    installs: InstallService
    backends: Mapping[str, Backend]
    publish: Publish | None = None
    instance: ServerInstance = ServerInstance()
    alias: str | None = None  # the model id its engine reports ([models.NAME]: NAME); None: the file path
    # The daemon's pull service (the catalog, and the pulls a well-known model needs); a private one by default.
    pulls: PullService = attrs.field(
        default=attrs.Factory(lambda self: PullService(self.paths, self.store, self.publish), takes_self=True)
    )
    runner: MachineRunner = attrs.field(init=False)
    _detections: dict[str, Detection] = attrs.field(factory=dict, init=False)
    _bundles: dict[str, InstalledBundle] = attrs.field(factory=dict, init=False)
    estimate: LayerEstimate | None = attrs.field(default=None, init=False)
    planned_why: str | None = attrs.field(default=None, init=False)
    # The last plan's room for the engine's fit (its GPUs' free memory as read for it, the
    # margin, the runtime's share); None for a CPU plan or no reading. The fitter's answers
    # are kept by it (daemon/fallback/memory.py, states/fallback/fit_reuse.py).
    fit_room: FitRoom | None = attrs.field(default=None, init=False)
    lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    # Where a build beside runs (the member's nursery; None: waited for like any install), and
    # how a settled server is restarted onto the bundle built (the member's supervisor).
    tasks: trio.Nursery | None = attrs.field(default=None, init=False)
    restart: Callable[[], object] | None = attrs.field(default=None, init=False)
    _beside: set[str] = attrs.field(factory=set, init=False)  # the builds beside running now
    _effects: EffectDriver[Awaitable[object | None] | None] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.runner = MachineRunner(F.FALLBACK, self.instance.machine_id(F.FALLBACK.name), self.store, self.publish)
        self._effects = EffectDriver(
            F.FALLBACK,
            {
                F.ProbeCandidates: self._probe_candidates,
                F.CheckBackend: self._check,
                F.InstallBundle: self._install,
                F.InstallBeside: self._install_beside,
                F.Upgrade: self._upgrade,
                F.UsePlan: self._use_plan,
                F.GiveUp: self._give_up,
            },
        )

    @property
    def data(self) -> F.FallbackData:
        return self.runner.data

    # --- the supervisor's planner ---------------------------------------------------------

    async def plan(self, config: Config, effect: LR.MakePlan) -> LR.LaunchPlan:
        """Answer MakePlan: a LaunchPlan, or StokerError (the launch machine's PlanFailed)."""
        async with self.lock:
            try:
                return await self._plan(config, effect)
            except StokerError:
                raise
            except Exception as err:  # a bug here must become a reason, never kill the daemon
                log.exception("fallback orchestrator failed")
                raise StokerError(ReasonCode.INTERNAL_ERROR, f"Planning failed: {type(err).__name__}: {err}") from err

    async def _plan(self, config: Config, effect: LR.MakePlan) -> LR.LaunchPlan:
        # A missing model is nobody's backend problem: fail the plan with it at once. A well-known
        # name the catalog lacks is pulled first (the launch waits in planning; a failed pull
        # fails the plan with the pull's reason).
        model = await locate_model(config.server.model, self.pulls.catalog, self.pulls)
        mode = await trio.to_thread.run_sync(model.engine_mode, config.server.kind)
        request = PlanRequest(config, effect, str(model.path), (*model.launch_args, *mode))
        # Until the machine asks for nothing more (UsePlan) or gives up (its StokerError is the plan's).
        await self._effects.drive(self.runner, self.runner.fire(self._requested(config, effect)).effects, request)
        if request.plan is None:
            raise StokerError(
                ReasonCode.INTERNAL_ERROR,
                "The fallback machine stopped without a plan.",
                {"state": self.runner.state.value},
            )
        return request.plan

    def _requested(self, config: Config, effect: LR.MakePlan) -> F.PlanRequested:
        """MakePlan's facts for the fallback table: the candidates now, and the failure (if
        a crash asked for this plan) with the failed backend's own startup code."""
        candidates, forced = candidates_for(config.backend.prefer, self.backends)
        previous, failure = effect.previous, effect.failure
        variant, arch = config.backend.cpu_variant, platform.machine()
        if previous is None or failure is None:
            return F.PlanRequested(
                candidates,
                forced,
                previous_backend=previous.backend if previous else None,
                previous_variant=previous.variant if previous else None,
                cpu_variant=variant,
                arch=arch,
            )
        return F.PlanRequested(
            candidates,
            forced,
            previous_backend=previous.backend,
            previous_variant=previous.variant,
            cpu_variant=variant,
            arch=arch,
            failure=failure.reason,
            phase=failure.phase,
            startup_failed=family_reason(
                self.backends, previous.backend, ReasonKind.STARTUP_FAILED, ReasonCode.SERVER_CRASHED
            ),
            evidence={"variant": previous.variant, **exit_detail(previous.backend, failure.reason, failure.evidence)},
        )

    async def _probe_candidates(self, eff: F.ProbeCandidates, request: PlanRequest) -> None:
        await self.probes.probe_all([b for b in eff.backends if b in self.probes.backends])

    async def _give_up(self, eff: F.GiveUp, request: PlanRequest) -> None:
        await trio.lowlevel.checkpoint()
        raise self._no_backend(eff)

    def _no_backend(self, eff: F.GiveUp) -> StokerError:
        data = self.data
        tried = ", ".join(f"{s.backend}: {s.reason}" for s in data.skipped)
        if data.forced:
            backend = data.candidates[0]
            # The check's own sentence: the generic one for gpu_missing says "serving on the
            # CPU", which is exactly what a forced backend does not do (seen on an H200 run).
            why = str(eff.evidence.get("message") or message_for(eff.reason)).rstrip(".")
            message = (
                f"The backend {backend!r} is forced (`stoker use {backend}` or [backend] prefer) and cannot "
                f"run: {why}. Stoker does not fall back from a forced backend, so nothing is served; "
                f"`stoker use auto` lets it."
            )
        else:
            message = f"No backend can run here ({tried}). {message_for(eff.reason)}"
        evidence = dict(eff.evidence)
        if "message" in evidence:  # the last check's own sentence; ours says what it means
            evidence["detail"] = evidence.pop("message")
        return StokerError(eff.reason, message, evidence)

    async def _check(self, eff: F.CheckBackend, request: PlanRequest) -> object:
        backend, config = eff.backend, request.config
        if backend == LR.CPU_BACKEND:
            bundle = await trio.to_thread.run_sync(cpu_bundle, self.paths, eff.cpu_variants)
            if bundle is None:
                return F.BundleMissing(backend, evidence=missing_cpu_bundle(self.paths, eff.cpu_variants))
            self._bundles[backend] = bundle
            return F.CheckPassed(backend, {"variant": bundle.meta.variant, "bundle": str(bundle.root)})
        plugin = self.backends.get(backend)
        if plugin is None or backend not in self.probes.backends:
            return F.CheckFailed(
                backend,
                ReasonCode.PROBE_FAILED,
                {"message": f"No backend plugin named {backend!r} is loaded.", "loaded": sorted(self.backends)},
            )
        result = await self.probes.probe(backend)
        detection = result.detection
        self._detections[backend] = detection
        evidence = {
            **detection_evidence(detection),
            "probe_generation": result.generation,
            "probe_cached": result.cached,
        }
        if not detection.usable:
            return F.CheckFailed(backend, detection.reason or plugin.unavailable_reason, evidence)
        installed = [b for b in await trio.to_thread.run_sync(list_installed, self.paths) if b.meta.backend == backend]
        if not installed:
            source = await self.installs.first_source(backend, detection) if self.tasks is not None else None
            return F.BundleMissing(
                backend,
                detection.present,
                plugin.reason(ReasonKind.BINARY_MISSING),
                {
                    **evidence,
                    "bundles_dir": str(self.paths.bundles_dir),
                    **({"source": source.value} if source else {}),
                },
                slow=source is Source.LOCAL_BUILD,
            )
        variant = plugin.choose_variant(detection, [b.meta.variant for b in installed]) or installed[0].meta.variant
        bundle = next(b for b in installed if b.meta.variant == variant)
        check = plugin.explain_bundle(detection, bundle.meta.to_dict())
        if not check.ok:
            return F.CheckFailed(
                backend,
                check.reason or plugin.unavailable_reason,
                {"message": check.message, "bundle": str(bundle.root), **dict(check.evidence)},
            )
        # The probe's figures can be 30 s old: the decision and the figures shown are a reading now.
        free = await read_free_vram(plugin, detection)
        request.free[backend] = free
        server = config.server
        vram = VramCheck(
            free,
            fit_margin(server.extra_args),
            plugin.runtime_reserve_mib,
            server.n_gpu_layers,
            plugin.reason(ReasonKind.VRAM_FULL),
        )
        self._bundles[backend] = bundle
        return F.CheckPassed(
            backend,
            {
                "variant": variant,
                "bundle": str(bundle.root),
                "devices": [d.name for d in detection.devices],
                **(free.evidence() if free else {}),
            },
            vram,
        )

    async def _install(self, eff: F.InstallBundle, request: PlanRequest | None, beside: bool = False) -> object:
        backend = eff.backend
        detection = self._detections.get(backend)
        if detection is None and backend in self.probes.backends:
            detection = (await self.probes.probe(backend)).detection  # the CPU: its variant by features
        try:
            await self.installs.install(backend, detection=detection, beside=beside)
        except StokerError as err:
            reason = family_reason(
                self.backends, backend, ReasonKind.BUNDLE_INSTALL_FAILED, ReasonCode.BUNDLE_VERIFY_FAILED
            )
            return F.BundleInstallFailed(backend, reason, {"message": err.message, **err.evidence})
        return F.BundleInstalled(backend)

    async def _install_beside(self, eff: F.InstallBeside, request: PlanRequest) -> None:
        """Start the install as a task of its own; the plan goes on without it."""
        await trio.lowlevel.checkpoint()
        if eff.backend in self._beside:
            return
        if self.tasks is None:  # nowhere to run it beside: nothing is built, the machine hears why
            self._fire(F.EngineBuildFailed(eff.backend, ReasonCode.INTERNAL_ERROR, {"message": "no task nursery"}))
            return
        self._beside.add(eff.backend)
        self.tasks.start_soon(self._build_beside, eff.backend)

    async def _build_beside(self, backend: str) -> None:
        started = trio.current_time()
        try:
            answer = await self._install(F.InstallBundle(backend), None, beside=True)
        except Exception as err:  # a bug here must become a reason, never kill the member
            log.exception("building the %s bundle beside failed", backend)
            answer = F.BundleInstallFailed(
                backend, ReasonCode.INTERNAL_ERROR, {"message": f"{type(err).__name__}: {err}"}
            )
        finally:
            self._beside.discard(backend)
        seconds = round(trio.current_time() - started, 1)
        if isinstance(answer, F.BundleInstalled):
            log.info("the %s bundle built beside is installed after %.0f s", backend, seconds)
            self._fire(F.EngineBuilt(backend, {"seconds": seconds}))
        else:
            assert isinstance(answer, F.BundleInstallFailed)
            self._fire(F.EngineBuildFailed(backend, answer.reason, {**answer.evidence, "seconds": seconds}))

    def _upgrade(self, eff: F.Upgrade, request: PlanRequest | None) -> None:
        log.info("switching from %s to %s, whose bundle is built now", eff.serving, eff.backend)
        if self.restart is not None:
            self.restart()

    def _fire(self, event: object) -> None:
        """An event from outside a plan (a build beside ended, a server ready): the machine's
        answer's effects are the quick ones (Upgrade), run here."""
        try:
            step = self.runner.fire(event)
        except IllegalTransition as err:  # a ready server from before the current request
            log.info("fallback: %s", err)
            return
        for effect in step.effects:
            self._effects.run(effect, None)

    async def _use_plan(self, eff: F.UsePlan, request: PlanRequest) -> None:
        """The complete plan for the backend that passed its check, on the GPUs its reading
        found room on."""
        backend, config, model = eff.backend, request.config, request.model
        bundle, plugin = self._bundles[backend], self.backends[backend]
        self.estimate = None
        self.fit_room = None
        layers: LR.GpuLayers = 0
        devices: tuple[int, ...] = ()
        if backend == LR.CPU_BACKEND:
            self.planned_why = why_planned(backend, None, str(self.data.reason) if self.data.reason else None)
        else:
            layers = config.server.n_gpu_layers
            free = request.free.get(backend)
            margin = fit_margin(config.server.extra_args)
            devices = keeps_to(plugin, layers, eff.devices)
            if free is not None:
                read = {i: mib for i, mib in free.mib if not devices or i in devices}
                self.fit_room = FitRoom(read, margin, plugin.runtime_reserve_mib)
            try:
                self.estimate = await trio.to_thread.run_sync(
                    estimate, model, config.server.ctx_size, free, devices, plugin.runtime_reserve_mib, margin, layers
                )
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.info("no layer estimate for %s: %s", model, err)
            self.planned_why = why_planned(backend, self.estimate, layers=layers)
        rpc = await plan_workers(config, bundle.meta.rpc_protocol, request.effect, request.free.get(backend), devices)
        if rpc is not None and rpc.used:
            self.planned_why = why_with_workers(self.planned_why, len(rpc.used))
        args = (self.paths, config, bundle, model, layers, plugin, devices, request.model_args, self.alias, rpc)
        request.plan = await trio.to_thread.run_sync(complete_plan, *args)

    # --- after the launch ---------------------------------------------------------------

    async def on_ready(self, server: ServedPlan, evidence: Mapping[str, Any]) -> dict[str, Any]:
        """Prove the planned backend is really in use and report it to the fallback machine,
        which settles (or, for the same plan respawned, keeps the new verdict)."""
        plan = server.plan
        if plan is None:
            return {}
        if evidence.get("adopted"):
            # A server kept across a daemon restart: its load lines were read by the daemon
            # before; nothing new to prove here, and nothing to demote on missing lines.
            self._report(F.LaunchSucceeded(plan.backend, evidence={"adopted": True}, adopted=True))
            return {}
        if self.runner.state is F.FallbackState.SETTLED and self.estimate is not None:
            # The same plan respawned after a crash: its free-VRAM reading is as old as the plan
            # (the GPUs may have filled since). Only the engine's figures of this launch speak.
            self.estimate = self.estimate.without_reading()
            self.planned_why = why_planned(plan.backend, self.estimate) + " (respawned with its plan)"
        proof = None if plan.on_cpu else await read_proof(self.backends, plan.backend, evidence, plan, self.estimate)
        reason = None if proof is None else acceleration_verdict(proof)
        if reason is not None:
            log.warning("the %s server is not really accelerated: %s", plan.backend, reason)
        self._report(F.LaunchSucceeded(plan.backend, proof))
        effective = self.effective_backend(plan)
        return {"effective_backend": effective, **({"demoted": str(reason)} if reason else {})}

    def _report(self, event: F.LaunchSucceeded) -> None:
        self._fire(event)

    # --- for status ---------------------------------------------------------------------

    def effective_backend(self, plan: LR.LaunchPlan | None) -> str | None:
        """The backend really in use by `plan`'s server: the fallback machine's verdict once it
        has settled on that plan (the CPU after a demotion), else the plan's own."""
        data = self.data
        if plan is None:
            return None
        if self.runner.state is F.FallbackState.SETTLED and data.chosen and plan.backend == data.current:
            return data.chosen
        return plan.backend

    def status(self, server: ServedPlan, prefer: str | None = None) -> dict[str, Any]:
        """The fallback part of `status`: effective backend, fallbacks with reasons, layers."""
        data = self.data
        plan = server.plan
        ready = server.ready_evidence or {}
        fallbacks = [self._fallback(s.backend, s.reason, s.evidence) for s in data.skipped]
        effective = self.effective_backend(plan)
        if plan is not None and effective != plan.backend and data.reason:
            fallbacks.append(self._fallback(plan.backend, data.reason, data.evidence))
        why = self.planned_why or ""
        if plan is not None and ready:
            why = why_actual(plan.backend, why, ready)
        return {
            "backend": effective,
            "planned_backend": plan.backend if plan else None,
            "offload": None if plan is None or plan.on_cpu else offload_kind(ready),
            "preference": {"prefer": prefer, "forced": data.forced, "candidates": list(data.candidates)},
            "fallback_state": self.runner.state.value,
            "fallback_reason": str(data.reason) if data.reason else None,
            "fallbacks": fallbacks,
            "workers": confirm_placement(plan, server.ready_evidence),
            "layers": {
                "planned": plan.n_gpu_layers if plan is not None else None,
                "offloaded": ready.get("offloaded_layers"),
                "total": ready.get("total_layers"),
                "why": why or None,
                "estimate": self.estimate.to_dict() if self.estimate else None,
            },
        }

    @staticmethod
    def _fallback(backend: str, reason: ReasonCode, evidence: Mapping[str, Any]) -> dict[str, Any]:
        """One passed-over backend for status: its own sentence where its evidence has one."""
        return {
            "backend": backend,
            "reason": str(reason),
            "message": evidence.get("message") or message_for(reason),
            "evidence": dict(evidence),
        }
