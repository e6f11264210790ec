"""The fallback orchestrator: per launch request, the preferred backend first, CPU last.

It answers the launch machine's `MakePlan` by handing its facts to the fallback machine
(states/fallback.py) as `PlanRequested`, whose table decides what the request means (a start
that failed on the backend being launched: record `<backend>_startup_failed` and move on;
anything else: start afresh), and by carrying out that machine's effects:

    ProbeCandidates   probe every candidate at once, so each check reads the cache
    CheckBackend(b)   probe b (the 30 s cache answers most of the time) and look for its
                      installed bundle, checked against the hardware (driver floor, archs)
    InstallBundle(b)  only when the sole problem is a missing bundle on present hardware
                      (binary_missing_*_detected): install from the manifest, then re-check
    UsePlan(b)        the complete LaunchPlan for b (daemon/fallback/launch_plan.py)
    GiveUp(reason)    no backend left, or the forced one failed: PlanFailed(reason)

Every skipped backend is a transition with its reason and evidence. After the server is
ready, `on_ready` has daemon/fallback/proof.py confirm that a GPU plan really offloaded layers
(the engine's `offloaded N/M layers to GPU`) and, where the platform reports it (NVML
per-process memory), that the server holds VRAM, and reports it as `LaunchSucceeded`;
otherwise the launch is reported as CPU with `<backend>_gpu_layers_zero` or
`gpu_claimed_but_unused`. One
orchestrator per server instance, with its own fallback machine.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Mapping, Protocol

import attrs
import trio

from daemon.backends.base import Backend, Detection, ReasonKind
from daemon.backends.registry import family_reason, try_order
from daemon.bundles.installed import InstalledBundle, list_installed
from daemon.config.model import Config
from daemon.core.errors import StokerError
from daemon.engine.exits import missing_library
from daemon.install.service import InstallService
from daemon.fallback.layers import LayerEstimate, estimate, fit_margin, free_vram, why_actual, why_planned
from daemon.core.machines import EffectDriver, MachineRunner, Publish
from daemon.core.paths import StokerPaths
from daemon.fallback.cpu_plan import cpu_bundle
from daemon.fallback.launch_plan import complete_plan
from daemon.fallback.proof import free_vram_now, judge_acceleration
from daemon.launch.instance import ServerInstance
from daemon.probes.service import ProbeService
from states import fallback as F
from states import launch_records as LR
from states.machine import IllegalTransition
from states.reasons import ReasonCode, message_for

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
    plan: LR.LaunchPlan | None = None


def vram_full(
    reason: ReasonCode | None, free: Mapping[int, int], config: Config
) -> tuple[ReasonCode, dict[str, Any]] | None:
    """(`reason`, evidence) if the engine could put no layer on any GPU, or None. `reason` is
    the backend's vram_full code (`cuda_vram_full`...); a backend that declares none is left
    to the engine.

    With `-ngl auto` the engine keeps the fit margin (-fitt) free on every device and offloads
    nothing where less is free (measured on an H200: 699 MiB free, 0/19 layers after 16 s of
    fitting, the server still holding 542 MiB). Where every device already has less free
    than the margin, before the engine's own runtime takes its share, the outcome is certain:
    skip the launch and say so. Anything less certain is left to the engine and proven after."""
    if config.server.n_gpu_layers != "auto" or reason is None:
        return None  # a fixed -ngl: the engine does not fit, it loads (or fails) as told
    margin = fit_margin(config.server.extra_args)
    if not free or any(mib >= margin for mib in free.values()):
        return None
    listed = ", ".join(f"{index}: {mib} MiB" for index, mib in free.items())
    return reason, {
        "free_vram_mib": {str(index): mib for index, mib in free.items()},
        "margin_mib": margin,
        "hint": f"free VRAM per GPU ({listed}) is below the {margin} MiB the engine keeps free (-fitt); "
        f"free VRAM held by other processes, or lower the margin: "
        f'[server] extra_args = ["-fitt", "256"]',
    }


def exit_detail(evidence: Mapping[str, Any]) -> dict[str, Any]:
    """What decided a GPU server's early exit, for <backend>_startup_failed: the deciding log
    line, a library the loader could not find, the exit status and the log's last lines."""
    tail = [str(line) for line in (evidence.get("log_tail") or [])][-8:]
    detail = {k: evidence[k] for k in ("line", "returncode", "signal") if evidence.get(k) is not None}
    missing = missing_library(tail)
    if missing:
        detail["missing_library"] = missing
    if tail:
        detail["log_tail"] = tail
    return detail


def candidates_for(prefer: str, backends: Mapping[str, Backend]) -> tuple[tuple[str, ...], bool]:
    """(backends to try in order, forced). Anything but "auto" is forced: exactly that one;
    auto tries every loaded backend in the order they declare (`auto_rank`: the CPU last)."""
    if prefer != "auto":
        return (prefer,), True
    return try_order(backends), False


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
    store: Any
    probes: ProbeService
    installs: InstallService
    backends: Mapping[str, Backend]
    publish: Publish | None = None
    instance: ServerInstance = ServerInstance()
    runner: MachineRunner = attrs.field(init=False)
    _detections: dict[str, Detection] = attrs.field(factory=dict, init=False)
    _bundles: dict[str, InstalledBundle] = attrs.field(factory=dict, init=False)
    estimate: LayerEstimate | None = attrs.field(default=None, init=False)
    planned_why: str | None = attrs.field(default=None, init=False)
    lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _effects: EffectDriver[Awaitable[object | None]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.runner = MachineRunner(F.FALLBACK, self.instance.machine_id(F.FALLBACK.name), self.store, self.publish)
        self._effects = EffectDriver(
            F.FALLBACK,
            {
                F.ProbeCandidates: self._probe_candidates,
                F.CheckBackend: self._check,
                F.InstallBundle: self._install,
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
        from daemon.models.resolve import resolve_model

        # A missing model is nobody's backend problem: fail the plan with it at once.
        model = await trio.to_thread.run_sync(resolve_model, config.server.model, self.paths)
        request = PlanRequest(config, effect, str(model))
        effects = list(self.runner.fire(self._requested(config, effect)).effects)
        while effects:  # until the machine asks for nothing more (UsePlan) or gives up
            event = await self._effects.run(effects.pop(0), request)
            if event is not None:
                effects.extend(self.runner.fire(event).effects)
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
        if previous is None or failure is None:
            return F.PlanRequested(candidates, forced, previous_backend=previous.backend if previous else None)
        return F.PlanRequested(
            candidates,
            forced,
            previous_backend=previous.backend,
            failure=failure.reason,
            phase=failure.phase,
            startup_failed=family_reason(
                self.backends, previous.backend, ReasonKind.STARTUP_FAILED, ReasonCode.SERVER_CRASHED
            ),
            evidence={"variant": previous.variant, **exit_detail(failure.evidence)},
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
            try:
                bundle = await trio.to_thread.run_sync(cpu_bundle, self.paths, config, request.effect)
            except StokerError as err:
                return F.CheckFailed(
                    backend,
                    err.reason,
                    {"message": err.message, **err.evidence},
                    bundle_missing=err.reason == ReasonCode.BUNDLE_MISSING,
                )
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
            reason = (
                (plugin.reason(ReasonKind.BINARY_MISSING) or ReasonCode.BUNDLE_MISSING)
                if detection.present
                else ReasonCode.BUNDLE_MISSING
            )
            return F.CheckFailed(
                backend, reason, {**evidence, "bundles_dir": str(self.paths.bundles_dir)}, bundle_missing=True
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
        probed = {d.index: d.memory_free_mib for d in detection.devices if isinstance(d.memory_free_mib, int)}
        full_reason = plugin.reason(ReasonKind.VRAM_FULL)
        if vram_full(full_reason, probed, config) is not None:
            # The probe's figures can be 30 s old: only a reading now may skip the launch.
            now = await free_vram_now(self.backends, backend, tuple(probed))
            full = vram_full(full_reason, now, config) if set(now) == set(probed) else None
            if full is not None:
                return F.CheckFailed(backend, *full)
            log.info("%s: probe said %s MiB free, now %s: launching", backend, probed, now or "?")
        self._bundles[backend] = bundle
        return F.CheckPassed(
            backend, {"variant": variant, "bundle": str(bundle.root), "devices": [d.name for d in detection.devices]}
        )

    async def _install(self, eff: F.InstallBundle, request: PlanRequest) -> object:
        backend = eff.backend
        detection = self._detections.get(backend)
        if detection is None and backend in self.probes.backends:
            detection = (await self.probes.probe(backend)).detection  # the CPU: its variant by features
        try:
            await self.installs.install(backend, detection=detection)
        except StokerError as err:
            reason = family_reason(
                self.backends, backend, ReasonKind.BUNDLE_INSTALL_FAILED, ReasonCode.BUNDLE_VERIFY_FAILED
            )
            return F.BundleInstallFailed(backend, reason, {"message": err.message, **err.evidence})
        return F.BundleInstalled(backend)

    async def _use_plan(self, eff: F.UsePlan, request: PlanRequest) -> None:
        """The complete plan for the backend that passed its check."""
        backend, config, model = eff.backend, request.config, request.model
        bundle = self._bundles[backend]
        self.estimate = None
        layers: LR.GpuLayers = 0
        if backend == LR.CPU_BACKEND:
            self.planned_why = why_planned(backend, None, str(self.data.reason) if self.data.reason else None)
        else:
            detection = self._detections.get(backend)
            free, device, n_devices = free_vram([d.to_dict() for d in detection.devices] if detection else [])
            try:
                self.estimate = await trio.to_thread.run_sync(
                    estimate,
                    model,
                    config.server.ctx_size,
                    free,
                    device,
                    self.backends[backend].runtime_reserve_mib,
                    fit_margin(config.server.extra_args),
                    max(1, n_devices),
                )
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.info("no layer estimate for %s: %s", model, err)
            self.planned_why = why_planned(backend, self.estimate)
            layers = config.server.n_gpu_layers
        request.plan = await trio.to_thread.run_sync(
            complete_plan, self.paths, config, bundle, model, layers, self.backends[backend]
        )

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
        reason, proof = (
            (None, {})
            if plan.on_cpu
            else await judge_acceleration(self.backends, plan.backend, evidence, plan, self.estimate)
        )
        if reason is not None:
            log.warning("the %s server is not really accelerated: %s", plan.backend, reason)
        effective = LR.CPU_BACKEND if reason is not None else plan.backend
        self._report(F.LaunchSucceeded(plan.backend, effective if reason else None, reason, proof))
        return {"effective_backend": effective, **({"demoted": str(reason)} if reason else {})}

    def _report(self, event: F.LaunchSucceeded) -> None:
        try:
            self.runner.fire(event)
        except IllegalTransition as err:  # a ready server from before the current request
            log.info("fallback: %s", err)

    # --- for status ---------------------------------------------------------------------

    def status(self, server: ServedPlan, prefer: str | None = None) -> dict[str, Any]:
        """The fallback part of `status`: effective backend, fallbacks with reasons, layers."""
        data = self.data
        plan = server.plan
        ready = server.ready_evidence or {}
        fallbacks = [
            {
                "backend": s.backend,
                "reason": str(s.reason),
                "message": s.evidence.get("message") or message_for(s.reason),
                "evidence": dict(s.evidence),
            }
            for s in data.skipped
        ]
        effective = plan.backend if plan else None
        if self.runner.state is F.FallbackState.SETTLED and data.chosen:
            effective = data.chosen
            if plan is not None and data.chosen != plan.backend and data.reason:
                fallbacks.append(
                    {
                        "backend": plan.backend,
                        "reason": str(data.reason),
                        "message": message_for(data.reason),
                        "evidence": dict(data.evidence),
                    }
                )
        late = data.respawn_demotion
        if (
            late is not None
            and plan is not None
            and late.backend == plan.backend
            and self.runner.state is F.FallbackState.SETTLED
        ):
            effective = LR.CPU_BACKEND
            fallbacks.append(
                {
                    "backend": late.backend,
                    "reason": str(late.reason),
                    "message": message_for(late.reason),
                    "evidence": {**late.evidence, "after": "respawn"},
                }
            )
        why = self.planned_why or ""
        if plan is not None and ready:
            why = why_actual(plan.backend, why, ready)
        return {
            "backend": effective,
            "planned_backend": plan.backend if plan else None,
            "preference": {"prefer": prefer, "forced": data.forced, "candidates": list(data.candidates)},
            "fallback_state": self.runner.state.value,
            "fallback_reason": str(data.reason) if data.reason else None,
            "fallbacks": fallbacks,
            "layers": {
                "planned": plan.n_gpu_layers if plan is not None else None,
                "offloaded": ready.get("offloaded_layers"),
                "total": ready.get("total_layers"),
                "why": why or None,
                "estimate": self.estimate.to_dict() if self.estimate else None,
            },
        }
