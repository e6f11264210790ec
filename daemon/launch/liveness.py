"""The liveness watchdog of a ready server: samples facts, reports silence (WatchLiveness).

Every `every` seconds it looks at the server: `/health` (answered in time?), `/slots` (did
a slot move?), and the process's CPU time and kernel state (psutil). Whether a sample is a sign of life is judged in states/launch/liveness.py
(`sign_of_life`), and whether a silence is a hang by the launch table: this module only
measures and times. It reports `EngineSilent(silent_for)` after each sample without a sign
of life, and `EngineAnswered` once when one shows again; a healthy server costs two small
requests per sample and writes nothing.

Requests are bounded by cancel scopes here (a stopped process accepts the connection and
never answers); the supervisor runs the watch in a task that belongs to `ready`, cancelled
when the machine leaves it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import httpx
import psutil
import trio

from stoker.daemon.engine.api import EngineClient
from stoker.states.launch import records as LR
from stoker.states.launch.liveness import HEALTH_OK, LivenessSample, sign_of_life

log = logging.getLogger(__name__)

# A slot's counters that move while it works: any change between two samples is progress.
_SLOT_COUNTERS = ("id_task", "n_prompt_tokens", "n_prompt_tokens_processed", "n_decoded")


def slot_progress(slots: Any) -> tuple[tuple[int, ...], ...]:
    """Each slot's progress counters from a `/slots` reply (missing counters read as -1)."""
    out = []
    for slot in slots if isinstance(slots, list) else []:
        if not isinstance(slot, dict):
            continue
        decoded = sum(
            int(t.get("n_decoded", 0)) for t in slot.get("next_token") or [] if isinstance(t, dict)
        ) or slot.get("n_decoded", -1)
        counters = {**slot, "n_decoded": decoded}
        row = [int(slot.get("id", -1)), int(bool(slot.get("is_processing")))]
        for name in _SLOT_COUNTERS:
            value = counters.get(name, -1)
            row.append(value if isinstance(value, int) and not isinstance(value, bool) else -1)
        out.append(tuple(row))
    return tuple(out)


def process_facts(pid: int) -> tuple[float | None, str | None]:
    """(user + system CPU seconds, the kernel's state) of `pid`; None where unreadable."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            times = proc.cpu_times()
            return round(times.user + times.system, 3), proc.status()
    except (psutil.Error, OSError):
        return None, None


async def sample_liveness(engine: EngineClient, pid: int, answer_within: float) -> LivenessSample:
    """One look at the server: /health and /slots at once (each given `answer_within`), then
    the process; a sample takes at most `answer_within`."""
    answers: dict[str, Any] = {"health": "timeout", "slots": None}

    async def health() -> None:
        with trio.move_on_after(answer_within):
            try:
                code = (await engine.health()).status_code
                answers["health"] = HEALTH_OK if code == 200 else "loading" if code == 503 else "error"
            except httpx.ConnectError:
                answers["health"] = "refused"
            except httpx.HTTPError:
                answers["health"] = "error"

    async def slots() -> None:
        with trio.move_on_after(answer_within):
            try:
                resp = await engine.slots()
                if resp.status_code == 200:
                    answers["slots"] = slot_progress(resp.json())
            except (httpx.HTTPError, ValueError):
                pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(health)
        nursery.start_soon(slots)
    cpu_seconds, process = process_facts(pid)
    return LivenessSample(answers["health"], answers["slots"], cpu_seconds, process)


async def watch_liveness(
    base_url: str, api_key: str | None, pid: int, every: float, answer_within: float, report: Callable[[object], Any]
) -> None:
    """Sample the server until cancelled; report EngineSilent / EngineAnswered to the machine."""
    last_life = trio.current_time()
    before: LivenessSample | None = None
    silent = False
    async with EngineClient.open(base_url, api_key, timeout=None) as engine:
        while True:
            await trio.sleep(every)
            sample = await sample_liveness(engine, pid, answer_within)
            now = trio.current_time()
            if sign_of_life(before, sample):
                last_life = now
                if silent:
                    silent = False
                    report(LR.EngineAnswered(sample.to_evidence()))
            else:
                silent = True
                log.warning("server pid %d shows no sign of life for %.1f s: %s", pid, now - last_life, sample)
                report(LR.EngineSilent(round(now - last_life, 3), sample.to_evidence()))
            before = sample
