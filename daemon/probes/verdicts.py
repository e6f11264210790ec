"""The probe service: one probe machine per backend, generation tokens, a 30 s verdict cache.

Each `ProbeRequested` starts generation N+1 (states/probe/table.py); the service runs the backend's
`detect()` out of process (`run_probe`) and answers with a result that carries the generation
it was started with. The table keeps only the newest generation's verdict: an older result
that finishes later is accepted as an event, recorded in history as `probe_result_stale`, and
changes nothing, so a slow probe can never overwrite a fresher verdict.

Callers ask `probe(backend)`: a verdict younger than the TTL is answered from the cache
(`cached: true`); otherwise a probe already in flight is joined, or a new one is started.
`fresh=True` always starts a new generation. Every caller gets the newest verdict available
when its own probe (or a newer one) finished.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Iterable, Mapping

import attrs
import trio

from stoker.daemon.backends.base import Detection
from stoker.daemon.core.machines import EffectDriver, MachineRunner, Publish
from stoker.daemon.probes.runner import run_probe as run_probe_out_of_process
from stoker.states.probe import table as P
from stoker.states.machine import IllegalTransition, Step
from stoker.states.reasons import ReasonCode
from stoker.store.database import Store

log = logging.getLogger(__name__)

CACHE_TTL_S = 30.0
PROBE_TIMEOUT_S = 20.0

ProbeFn = Callable[..., Awaitable[Detection]]


@attrs.frozen
class ProbeResult:
    """A backend's verdict as the cache holds it."""

    detection: Detection
    generation: int
    at: float  # trio clock when the verdict was accepted
    cached: bool = False
    age_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.detection.to_dict(),
            "generation": self.generation,
            "cached": self.cached,
            "age_s": round(self.age_s, 3),
        }


def _detection_evidence(detection: Detection) -> dict[str, Any]:
    """What a result event carries into history: enough to rebuild the Detection."""
    return {"present": detection.present, "message": detection.message, "detection": detection.to_dict()}


def _reason_of(detection: Detection) -> ReasonCode:
    if detection.reason is not None:
        return detection.reason
    return ReasonCode.PROBE_FAILED


def _names(value: Iterable[str]) -> tuple[str, ...]:
    """A named converter: mypy cannot type an attrs field through the bare `tuple` builtin."""
    return tuple(value)


@attrs.define(eq=False)
class ProbeService:
    """Probe machines for every backend, with a cache and concurrent out-of-process probes."""

    store: Store
    backends: tuple[str, ...] = attrs.field(converter=_names)
    publish: Publish | None = None
    run_probe: ProbeFn = run_probe_out_of_process
    # backend -> its quick_detect: an answer that needs no driver is had in-process
    quick: Mapping[str, Callable[[], Detection | None]] = attrs.field(factory=dict)
    ttl: float = CACHE_TTL_S
    timeout: float = PROBE_TIMEOUT_S
    _runners: dict[str, MachineRunner] = attrs.field(factory=dict, init=False)
    _results: dict[str, ProbeResult] = attrs.field(factory=dict, init=False)
    _changed: dict[str, trio.Event] = attrs.field(factory=dict, init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _running: dict[str, int] = attrs.field(factory=dict, init=False)  # probes in flight here
    probes_run: int = attrs.field(default=0, init=False)  # subprocesses started (statistics)
    _effects: EffectDriver[None] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._effects = EffectDriver(P.PROBE, {P.RunProbe: self._do_run_probe, P.ArmExpiry: self._do_arm_expiry})

    def runner(self, backend: str) -> MachineRunner:
        """The probe machine of one backend (loaded from the store on first use)."""
        runner = self._runners.get(backend)
        if runner is None:
            runner = MachineRunner(
                P.PROBE,
                P.PROBE.machine_id(backend),
                self.store,
                self.publish,
                initial_data=P.ProbeData(backend=backend, timeout=self.timeout, cache_ttl=self.ttl),
            )
            self._runners[backend] = runner
            self._changed[backend] = trio.Event()
        return runner

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run probes and cache timers until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    # --- asking --------------------------------------------------------------------------

    def cached(self, backend: str) -> ProbeResult | None:
        """The verdict still within its TTL, or None."""
        result = self._results.get(backend)
        if result is None:
            return None
        runner = self.runner(backend)
        if runner.state not in (P.ProbeState.AVAILABLE, P.ProbeState.UNAVAILABLE):
            return None
        if runner.data.result_generation != result.generation:
            return None
        age = trio.current_time() - result.at
        if age >= self.ttl:
            return None
        return attrs.evolve(result, cached=True, age_s=age)

    async def probe(self, backend: str, *, fresh: bool = False) -> ProbeResult:
        """This backend's verdict: from the cache, a probe in flight, or a new probe."""
        if backend not in self.backends:
            raise KeyError(backend)
        if not fresh:
            hit = self.cached(backend)
            if hit is not None:
                await trio.lowlevel.checkpoint()
                return hit
        runner = self.runner(backend)
        # A machine left `probing` by an earlier daemon has nothing in flight here: start anew.
        if fresh or runner.state is not P.ProbeState.PROBING or not self._running.get(backend):
            self._start(backend)
        wanted = runner.data.generation
        while runner.data.result_generation < wanted or backend not in self._results:
            await self._changed[backend].wait()
        result = self._results[backend]
        return attrs.evolve(result, age_s=trio.current_time() - result.at)

    async def probe_all(self, backends: Iterable[str] | None = None, *, fresh: bool = False) -> dict[str, ProbeResult]:
        """Several backends concurrently (each in its own subprocess), in the order asked."""
        names = list(self.backends if backends is None else backends)
        results: dict[str, ProbeResult] = {}

        async def one(name: str) -> None:
            results[name] = await self.probe(name, fresh=fresh)

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(one, name)
        return {name: results[name] for name in names}

    def start_probes(self, backends: Iterable[str]) -> None:
        """Start a probe of each backend that has no verdict within the TTL and none in flight,
        without waiting for it: a later `probe` joins it, or reads its verdict from the cache."""
        for backend in backends:
            if backend in self.backends and self.cached(backend) is None and not self._running.get(backend):
                self._start(backend)

    def verdicts(self) -> dict[str, dict[str, Any]]:
        """Every backend's last verdict (cached or not) for status displays."""
        out = {}
        for name in self.backends:
            result = self._results.get(name)
            if result is not None:
                out[name] = result.to_dict()
        return out

    # --- the machine's effects -----------------------------------------------------------

    def _start(self, backend: str) -> None:
        step = self._fire(backend, P.ProbeRequested(backend))
        self._execute(backend, step.effects)

    def _fire(self, backend: str, event: object) -> Step:
        runner = self.runner(backend)
        step = runner.fire(event)
        changed = self._changed[backend]
        self._changed[backend] = trio.Event()
        changed.set()
        return step

    def _execute(self, backend: str, effects: Iterable[object]) -> None:
        if self._nursery is None:
            raise RuntimeError("the probe service is not running")
        self._effects.run_all(effects, backend)

    def _do_run_probe(self, effect: P.RunProbe, backend: str) -> None:
        assert self._nursery is not None
        self._running[backend] = self._running.get(backend, 0) + 1  # counted from now
        self._nursery.start_soon(self._run, effect)

    def _do_arm_expiry(self, effect: P.ArmExpiry, backend: str) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._expire_later, backend, effect)

    def _quick(self, backend: str) -> Detection | None:
        quick = self.quick.get(backend)
        if quick is None:
            return None
        try:
            detection = quick()
        except Exception:  # a plugin's bug: the subprocess probe still gets its say
            log.exception("quick_detect of %s failed; probing out of process", backend)
            return None
        if detection is not None:
            detection = attrs.evolve(detection, evidence={**detection.evidence, "probed": "in-process (quick_detect)"})
        return detection

    async def _run(self, effect: P.RunProbe) -> None:
        try:
            detection = self._quick(effect.backend)
            if detection is None:
                self.probes_run += 1
                detection = await self.run_probe(effect.backend, timeout=effect.timeout)
            else:
                await trio.lowlevel.checkpoint()
        except Exception as err:  # run_probe reports failures as Detections; this is a bug
            log.exception("probe %s failed", effect.backend)
            detection = Detection.unavailable(
                effect.backend,
                ReasonCode.PROBE_FAILED,
                present=False,
                message=f"The {effect.backend} probe failed: {type(err).__name__}: {err}",
            )
        finally:
            self._running[effect.backend] -= 1
        at = trio.current_time()
        evidence = _detection_evidence(detection)
        if detection.usable:
            event: object = P.ProbeSucceeded(effect.generation, evidence)
        else:
            event = P.ProbeFailed(effect.generation, _reason_of(detection), evidence)
        runner = self.runner(effect.backend)
        before = runner.data.result_generation
        step = self._fire(effect.backend, event)
        if runner.data.result_generation != before:  # accepted, not dropped as stale
            self._results[effect.backend] = ProbeResult(detection, effect.generation, at)
        else:
            log.info(
                "probe %s generation %d dropped (newest %d)", effect.backend, effect.generation, runner.data.generation
            )
        self._execute(effect.backend, step.effects)

    async def _expire_later(self, backend: str, effect: P.ArmExpiry) -> None:
        await trio.sleep(effect.after)
        try:
            self._fire(backend, P.Expired(effect.generation))
        except IllegalTransition:
            pass  # a newer verdict (or probe) replaced the one this timer was for
