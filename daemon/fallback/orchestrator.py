"""The fallback orchestrator: per launch request, the preferred backend first, CPU last.

It drives the fallback machine (states/fallback.py) and answers the launch machine's
`MakePlan`:

    CheckBackend(b)   probe b (the 30 s cache answers most of the time) and look for its
                      installed bundle, checked against the hardware (driver floor, archs)
    InstallBundle(b)  only when the sole problem is a missing bundle on present hardware
                      (binary_missing_*_detected): install from the manifest, then re-check
    UsePlan(b)        the LaunchPlan for b (GPU: -ngl auto, the engine fits the layers)
    GiveUp(reason)    no backend left, or the forced one failed: PlanFailed(reason)

Every skipped backend is a transition with its reason and evidence. After the server is
ready, `on_ready` confirms that a GPU plan really offloaded layers (the engine's
`offloaded N/M layers to GPU`) and, where the platform reports it (NVML per-process memory),
that the server holds VRAM; otherwise the launch is reported as CPU with
`<backend>_gpu_layers_zero` or `gpu_claimed_but_unused`. A GPU server that dies before it is
ready comes back here as `LaunchFailed(<backend>_startup_failed)` and the next backend is
tried (`OrchestratedSupervisor` asks for a new plan instead of respawning the same one).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import attrs
import trio

from daemon.backends.base import Backend, Detection, ReasonKind, TelemetryRequest
from daemon.backends.registry import family_reason, try_order
from daemon.bundles.installed import InstalledBundle, list_installed
from daemon.config.model import Config
from daemon.core.errors import StokerError
from daemon.engine.exits import missing_library
from daemon.install.service import InstallService
from daemon.fallback.layers import (CONTEXT_RESERVE_MIB, FIT_MARGIN_MIB, LayerEstimate, estimate, fit_margin, free_vram,
                               why_actual, why_planned)
from daemon.core.machines import MachineRunner, Publish
from daemon.core.paths import StokerPaths
from daemon.fallback.cpu_plan import plan_cpu
from daemon.probes.service import ProbeService
from daemon.launch.supervisor import Supervisor
from states import fallback as F
from states import launch as L
from states.reasons import ReasonCode, message_for

log = logging.getLogger(__name__)

MACHINE_ID = "fallback"
AUTO_LAYERS = -1  # LaunchPlan.n_gpu_layers for "-ngl auto" (the engine fits)


def vram_full(reason: ReasonCode | None, free: Mapping[int, int], config: Config) -> tuple[ReasonCode, dict[str, Any]] | None:
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
    return reason, {"free_vram_mib": {str(index): mib for index, mib in free.items()}, "margin_mib": margin,
            "hint": f"free VRAM per GPU ({listed}) is below the {margin} MiB the engine keeps free (-fitt); "
                    f"free VRAM held by other processes, or lower the margin: "
                    f"[server] extra_args = [\"-fitt\", \"256\"]"}


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
    runner: MachineRunner = attrs.field(init=False)
    _detections: dict[str, Detection] = attrs.field(factory=dict, init=False)
    _bundles: dict[str, InstalledBundle] = attrs.field(factory=dict, init=False)
    estimate: LayerEstimate | None = attrs.field(default=None, init=False)
    # A respawn of a settled GPU plan (a crash after ready) found it not really in use:
    # (plan backend, reason, proof). The table settles once per request, so this is kept here.
    respawn_demotion: tuple[str, ReasonCode, dict[str, Any]] | None = attrs.field(default=None, init=False)
    planned_why: str | None = attrs.field(default=None, init=False)
    lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        self.runner = MachineRunner(F.FALLBACK, MACHINE_ID, self.store, self.publish)

    @property
    def data(self) -> F.FallbackData:
        return self.runner.data

    # --- the supervisor's planner ---------------------------------------------------------

    async def plan(self, config: Config, effect: L.MakePlan) -> L.LaunchPlan:
        """Answer MakePlan: a LaunchPlan, or StokerError (the launch machine's PlanFailed)."""
        async with self.lock:
            try:
                return await self._plan(config, effect)
            except StokerError:
                raise
            except Exception as err:  # a bug here must become a reason, never kill the daemon
                log.exception("fallback orchestrator failed")
                raise StokerError(ReasonCode.INTERNAL_ERROR, f"Planning failed: {type(err).__name__}: {err}") from err

    async def _plan(self, config: Config, effect: L.MakePlan) -> L.LaunchPlan:
        from daemon.models.resolve import resolve_model

        # A missing model is nobody's backend problem: fail the plan with it at once.
        model = await trio.to_thread.run_sync(resolve_model, config.server.model, self.paths)
        state, data = self.runner.state, self.data
        previous = effect.previous
        if (
            state is F.FallbackState.LAUNCHING
            and effect.failure is not None
            and previous is not None
            and previous.backend == data.current
            and previous.backend != "cpu"
        ):
            # The GPU server died before it was ready: that backend is out, try the next.
            event: object = F.LaunchFailed(
                previous.backend,
                family_reason(self.backends, previous.backend, ReasonKind.STARTUP_FAILED, ReasonCode.SERVER_CRASHED),
                {"exit_reason": str(effect.failure), "variant": previous.variant,
                 **exit_detail(effect.failure_evidence)},
            )
        else:
            if state in (F.FallbackState.CHECKING, F.FallbackState.INSTALLING, F.FallbackState.LAUNCHING):
                self.runner.fire(F.FallbackCancelled())  # an earlier request never finished
            candidates, forced = candidates_for(config.backend.prefer, self.backends)
            if not forced:
                # Probe every candidate at once: each check then reads the cache.
                await self.probes.probe_all([b for b in candidates if b in self.probes.backends and b != "cpu"])
            event = F.FallbackStarted(candidates, forced)
        effects = list(self.runner.fire(event).effects)
        while effects:
            eff = effects.pop(0)
            if isinstance(eff, F.CheckBackend):
                event = await self._check(config, eff.backend, effect)
            elif isinstance(eff, F.InstallBundle):
                event = await self._install(eff.backend)
            elif isinstance(eff, F.UsePlan):
                return await self._launch_plan(config, eff.backend, effect, str(model))
            elif isinstance(eff, F.GiveUp):
                raise self._give_up(eff)
            else:  # pragma: no cover - the table declares no other effect
                raise StokerError(ReasonCode.INTERNAL_ERROR, f"unknown fallback effect {eff!r}")
            effects.extend(self.runner.fire(event).effects)
        raise StokerError(ReasonCode.INTERNAL_ERROR, "The fallback machine stopped without a plan.",
                          {"state": self.runner.state.value})

    def _give_up(self, eff: F.GiveUp) -> StokerError:
        data = self.data
        tried = ", ".join(f"{s.backend}: {s.reason}" for s in data.skipped)
        if data.forced:
            backend = data.candidates[0]
            # The check's own sentence: the generic one for gpu_missing says "serving on the
            # CPU", which is exactly what a forced backend does not do (seen on an H200 run).
            why = str(eff.evidence.get("message") or message_for(eff.reason)).rstrip(".")
            message = (f"The backend {backend!r} is forced (`stoker use {backend}` or [backend] prefer) and cannot "
                       f"run: {why}. Stoker does not fall back from a forced backend, so nothing is served; "
                       f"`stoker use auto` lets it.")
        else:
            message = f"No backend can run here ({tried}). {message_for(eff.reason)}"
        evidence = dict(eff.evidence)
        if "message" in evidence:  # the last check's own sentence; ours says what it means
            evidence["detail"] = evidence.pop("message")
        return StokerError(eff.reason, message, evidence)

    async def _check(self, config: Config, backend: str, effect: L.MakePlan) -> object:
        if backend == "cpu":
            try:
                plan = await trio.to_thread.run_sync(plan_cpu, self.paths, config, effect)
            except StokerError as err:
                return F.CheckFailed("cpu", err.reason, {"message": err.message, **err.evidence})
            return F.CheckPassed("cpu", {"variant": plan.variant, "bundle": plan.bundle_root})
        plugin = self.backends.get(backend)
        if plugin is None or backend not in self.probes.backends:
            return F.CheckFailed(backend, ReasonCode.PROBE_FAILED,
                                 {"message": f"No backend plugin named {backend!r} is loaded.",
                                  "loaded": sorted(self.backends)})
        result = await self.probes.probe(backend)
        detection = result.detection
        self._detections[backend] = detection
        evidence = {**detection_evidence(detection), "probe_generation": result.generation,
                    "probe_cached": result.cached}
        if not detection.usable:
            return F.CheckFailed(backend, detection.reason or plugin.unavailable_reason, evidence)
        installed = [b for b in await trio.to_thread.run_sync(list_installed, self.paths) if b.meta.backend == backend]
        if not installed:
            reason = (plugin.reason(ReasonKind.BINARY_MISSING) or ReasonCode.BUNDLE_MISSING) if detection.present \
                else ReasonCode.BUNDLE_MISSING
            return F.CheckFailed(backend, reason, {**evidence, "bundles_dir": str(self.paths.bundles_dir)})
        variant = plugin.choose_variant(detection, [b.meta.variant for b in installed]) or installed[0].meta.variant
        bundle = next(b for b in installed if b.meta.variant == variant)
        check = plugin.explain_bundle(detection, bundle.meta.to_dict())
        if not check.ok:
            return F.CheckFailed(backend, check.reason or plugin.unavailable_reason,
                                 {"message": check.message, "bundle": str(bundle.root), **dict(check.evidence)})
        probed = {d.index: d.memory_free_mib for d in detection.devices if isinstance(d.memory_free_mib, int)}
        full_reason = plugin.reason(ReasonKind.VRAM_FULL)
        if vram_full(full_reason, probed, config) is not None:
            # The probe's figures can be 30 s old: only a reading now may skip the launch.
            now = await self._free_vram_now(backend, tuple(probed))
            full = vram_full(full_reason, now, config) if set(now) == set(probed) else None
            if full is not None:
                return F.CheckFailed(backend, *full)
            log.info("%s: probe said %s MiB free, now %s: launching", backend, probed, now or "?")
        self._bundles[backend] = bundle
        return F.CheckPassed(backend, {"variant": variant, "bundle": str(bundle.root),
                                       "devices": [d.name for d in detection.devices]})

    async def _install(self, backend: str) -> object:
        detection = self._detections.get(backend)
        if detection is None and backend in self.probes.backends:
            detection = (await self.probes.probe(backend)).detection  # the CPU: its variant by features
        try:
            await self.installs.install(backend, detection=detection)
        except StokerError as err:
            reason = family_reason(self.backends, backend, ReasonKind.BUNDLE_INSTALL_FAILED,
                                   ReasonCode.BUNDLE_VERIFY_FAILED)
            return F.BundleInstallFailed(backend, reason, {"message": err.message, **err.evidence})
        return F.BundleInstalled(backend)

    async def _launch_plan(self, config: Config, backend: str, effect: L.MakePlan, model: str) -> L.LaunchPlan:
        self.estimate = None
        if backend == "cpu":
            plan = await trio.to_thread.run_sync(plan_cpu, self.paths, config, effect)
            self.planned_why = why_planned("cpu", None, str(self.data.reason) if self.data.reason else None)
            return plan
        bundle = self._bundles[backend]
        detection = self._detections.get(backend)
        free, device, n_devices = free_vram([d.to_dict() for d in detection.devices] if detection else [])
        try:
            self.estimate = await trio.to_thread.run_sync(estimate, model, config.server.ctx_size, free, device,
                                                          CONTEXT_RESERVE_MIB.get(backend, 0),
                                                          fit_margin(config.server.extra_args), max(1, n_devices))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.info("no layer estimate for %s: %s", model, err)
        self.planned_why = why_planned(backend, self.estimate)
        layers = config.server.n_gpu_layers
        return L.LaunchPlan(
            backend=backend,
            variant=bundle.meta.variant,
            bundle_root=str(bundle.root),
            server_path=str(bundle.server),
            model_path=model,
            host=config.server.host,
            port=config.server.port,
            ctx_size=config.server.ctx_size,
            parallel=config.server.parallel,
            n_gpu_layers=AUTO_LAYERS if layers == "auto" else int(layers),
            extra_args=config.server.extra_args,
        )

    # --- after the launch ---------------------------------------------------------------

    async def on_ready(self, supervisor: Supervisor, evidence: Mapping[str, Any]) -> dict[str, Any]:
        """Confirm the planned backend is really in use; settle the fallback machine."""
        plan = supervisor.data.plan
        if plan is None:
            return {}
        if self.runner.state is F.FallbackState.SETTLED and plan.backend != "cpu" and not evidence.get("adopted"):
            # The same GPU plan respawned after a crash: prove it again, every time.
            reason, proof = await self._judge(plan.backend, evidence, plan)
            self.respawn_demotion = None if reason is None else (plan.backend, reason, proof)
            if reason is not None:
                log.warning("respawned %s server is not really accelerated: %s", plan.backend, reason)
            return {"effective_backend": "cpu" if reason else plan.backend}
        if self.runner.state is not F.FallbackState.LAUNCHING or plan.backend != self.data.current:
            return {}
        self.respawn_demotion = None
        backend = plan.backend
        if evidence.get("adopted"):
            # A server kept across a daemon restart: its load lines were read by the daemon
            # before; nothing new to prove here, and nothing to demote on missing lines.
            self.runner.fire(F.LaunchSucceeded(backend, None, None, {"adopted": True}))
            return {}
        if backend == "cpu":
            self.runner.fire(F.LaunchSucceeded("cpu"))
            return {"effective_backend": "cpu"}
        reason, proof = await self._judge(backend, evidence, plan)
        effective = "cpu" if reason is not None else backend
        self.runner.fire(F.LaunchSucceeded(backend, effective if reason else None, reason, proof))
        return {"effective_backend": effective, **({"demoted": str(reason)} if reason else {})}

    async def _judge(self, backend: str, evidence: Mapping[str, Any],
                     plan: L.LaunchPlan | None = None) -> tuple[ReasonCode | None, dict[str, Any]]:
        """None if the GPU is really in use, else why not; and the proof either way."""
        offloaded = evidence.get("offloaded_layers")
        proof: dict[str, Any] = {"offloaded_layers": offloaded, "total_layers": evidence.get("total_layers"),
                                 "offload_line": (evidence.get("evidence_lines") or {}).get("offloaded")}
        if not offloaded:
            proof["hint"] = self._zero_layers_hint(plan)
            return family_reason(self.backends, backend, ReasonKind.GPU_LAYERS_ZERO,
                                 ReasonCode.GPU_CLAIMED_BUT_UNUSED), proof
        vram = await self._process_vram(backend, evidence.get("pid"))
        proof["process_vram_mib"] = vram
        if vram == 0:
            return ReasonCode.GPU_CLAIMED_BUT_UNUSED, proof
        return None, proof

    def _zero_layers_hint(self, plan: L.LaunchPlan | None) -> str:
        """Why a GPU plan offloaded nothing, and the one setting that changes it."""
        if plan is not None and plan.n_gpu_layers == 0:
            return "n_gpu_layers = 0 in the config: nothing is offloaded by request"
        if plan is not None and any(a in ("-fitt", "--fit-target") for a in plan.extra_args):
            return "the engine's fit found no room for a layer within the -fitt margin in extra_args"
        est = self.estimate
        runtime = (f", about {est.context_mib * est.n_devices} MiB of it taken by the runtime,"
                   if est and est.context_mib else "")
        room = "" if est is None or est.free_vram_mib is None else (
            f"{est.free_vram_mib} MiB free VRAM{runtime} vs model {est.model_mib:.0f} MiB + KV {est.kv_mib or 0:.0f} MiB; ")
        return (f"{room}the engine keeps {FIT_MARGIN_MIB} MiB free (-fitt) and offloads nothing when less is left; "
                f"free VRAM, or lower the margin: [server] extra_args = [\"-fitt\", \"256\"]")

    async def _free_vram_now(self, backend: str, indices: tuple[int, ...]) -> dict[int, int]:
        """Free VRAM per device read now (NVML in-process, as telemetry does); {} if unreadable."""
        try:
            now = await trio.to_thread.run_sync(self.backends[backend].read_telemetry,
                                                TelemetryRequest(devices=indices))
        except Exception:
            return {}
        return {d.index: d.memory_total_mib - d.memory_used_mib for d in (now.devices if now else ())
                if d.memory_total_mib is not None and d.memory_used_mib is not None}

    async def _process_vram(self, backend: str, pid: Any) -> int | None:
        """The server's own VRAM (MiB) where the platform reports it; None where it cannot."""
        plugin = self.backends.get(backend)
        if plugin is None or not isinstance(pid, int):
            return None
        try:
            telemetry = await trio.to_thread.run_sync(plugin.read_telemetry, TelemetryRequest(pid=pid))
        except Exception:
            return None
        return None if telemetry is None else telemetry.process_memory_mib

    # --- for status ---------------------------------------------------------------------

    def status(self, supervisor: Supervisor, prefer: str | None = None) -> dict[str, Any]:
        """The fallback part of `status`: effective backend, fallbacks with reasons, layers."""
        data = self.data
        plan = supervisor.data.plan
        ready = supervisor.ready_evidence or {}
        fallbacks = [
            {"backend": s.backend, "reason": str(s.reason), "message": s.evidence.get("message") or message_for(s.reason),
             "evidence": dict(s.evidence)}
            for s in data.skipped
        ]
        effective = plan.backend if plan else None
        if self.runner.state is F.FallbackState.SETTLED and data.chosen:
            effective = data.chosen
            if plan is not None and data.chosen != plan.backend and data.reason:
                fallbacks.append({"backend": plan.backend, "reason": str(data.reason),
                                  "message": message_for(data.reason), "evidence": dict(data.evidence)})
        late = self.respawn_demotion
        if late is not None and plan is not None and late[0] == plan.backend and self.runner.state is F.FallbackState.SETTLED:
            effective = "cpu"
            fallbacks.append({"backend": late[0], "reason": str(late[1]), "message": message_for(late[1]),
                              "evidence": {**late[2], "after": "respawn"}})
        planned: Any = None
        if plan is not None and plan.backend != "cpu":
            planned = "auto" if plan.n_gpu_layers == AUTO_LAYERS else plan.n_gpu_layers
        elif plan is not None:
            planned = 0
        why = self.planned_why or ""
        if plan is not None and ready:
            why = why_actual(plan.backend, why, ready)
        return {
            "backend": effective,
            "planned_backend": plan.backend if plan else None,
            "preference": {"prefer": prefer, "forced": data.forced,
                           "candidates": list(data.candidates)},
            "fallback_state": self.runner.state.value,
            "fallback_reason": str(data.reason) if data.reason else None,
            "fallbacks": fallbacks,
            "layers": {
                "planned": planned,
                "offloaded": ready.get("offloaded_layers"),
                "total": ready.get("total_layers"),
                "why": why or None,
                "estimate": self.estimate.to_dict() if self.estimate else None,
            },
        }


class OrchestratedSupervisor(Supervisor):
    """The supervisor with GPU launches that fail before ready sent back to the orchestrator."""

    def server_spec(self, plan: L.LaunchPlan):
        spec = super().server_spec(plan)
        if plan.backend != "cpu" and plan.n_gpu_layers == AUTO_LAYERS:
            spec = attrs.evolve(spec, n_gpu_layers="auto")  # -ngl auto: the engine fits
        return spec

    def _exit_event(self, returncode, reason, evidence):
        event = super()._exit_event(returncode, reason, evidence)
        plan = self.data.plan
        never_ready = self.state in (L.LaunchState.STARTING, L.LaunchState.LOADING)
        if plan is not None and plan.backend != "cpu" and never_ready and not event.fatal:
            # Respawning the same GPU plan would fail the same way: ask for a new plan, and
            # the orchestrator records <backend>_startup_failed and tries the next backend.
            event = attrs.evolve(event, replan=True)
        return event
