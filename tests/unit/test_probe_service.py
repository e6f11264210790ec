"""The probe service: many concurrent probes finishing in random order, under a mock clock."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

from stoker.daemon.backends.base import Detection
from stoker.daemon.probes.verdicts import ProbeService
from stoker.states.probe import table as P
from stoker.states.reasons import ReasonCode
from stoker.store import open_store


class FakeProbes:
    """A stand-in for run_probe: each call sleeps its scripted delay and returns a tokened verdict."""

    def __init__(self, delays, usable=None):
        self.delays = list(delays)
        self.usable = list(usable or [True] * len(self.delays))
        self.calls = 0
        self.tokens = itertools.count(1)

    async def __call__(self, backend, *, timeout):
        index = self.calls
        self.calls += 1
        await trio.sleep(self.delays[index % len(self.delays)])
        token = next(self.tokens)
        if self.usable[index % len(self.usable)]:
            return Detection.available(backend, [], f"token {token}", token=token)
        return Detection.unavailable(backend, ReasonCode.GPU_MISSING, present=False, token=token)


def _token_of_generation(store, machine, generation):
    for row in store.history(machine=machine, limit=None):
        if row.event in ("ProbeSucceeded", "ProbeFailed") and row.event_data["generation"] == generation:
            return row.event_data["evidence"]["detection"]["evidence"]["token"]
    raise AssertionError(f"no result for generation {generation}")


async def _scenario(requests, delays, usable, ttl=30.0):
    """Run every request (start time, fresh) against one backend; check every invariant."""
    store = open_store(":memory:")
    fake = FakeProbes(delays, usable)
    service = ProbeService(store, ("cuda",), run_probe=fake, ttl=ttl)
    answers = []
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)

        async def caller(start, fresh):
            await trio.sleep(start)
            asked_at = service.runner("cuda").data.generation
            result = await service.probe("cuda", fresh=fresh)
            answers.append((asked_at, fresh, result))

        async with trio.open_nursery() as callers:
            for start, fresh in requests:
                callers.start_soon(caller, start, fresh)
        # Let every probe still running (superseded ones) finish and be dropped.
        await trio.sleep(max(delays) + 1)
        nursery.cancel_scope.cancel()

    runner = service.runner("cuda")
    data = runner.data
    rows = list(reversed(store.history(machine="probe:cuda", limit=None)))
    results = [r for r in rows if r.event in ("ProbeSucceeded", "ProbeFailed")]
    # Every probe started reported exactly once.
    starts = [r for r in rows if r.event == "ProbeRequested"]
    assert len(starts) == data.generation == fake.calls
    assert len(results) == fake.calls
    # Accepted verdicts only ever move forward; every other result is a recorded drop.
    accepted = [r.event_data["generation"] for r in results if r.reason != "probe_result_stale"]
    stale = [r for r in results if r.reason == "probe_result_stale"]
    assert accepted == sorted(set(accepted))
    assert len(stale) == data.dropped == len(results) - len(accepted)
    for r in stale:
        assert r.from_state == r.to_state
        assert r.evidence["dropped_generation"] < r.evidence["newest_generation"] or (
            r.evidence["dropped_generation"] <= r.evidence["result_generation"]
        )
    # The newest probe's verdict is the one held, and the cache holds exactly its detection.
    assert data.result_generation == data.generation
    assert accepted[-1] == data.generation
    held = service._results["cuda"]
    assert held.generation == data.generation
    assert held.detection.evidence["token"] == _token_of_generation(store, "probe:cuda", data.generation)
    # Nobody got an answer older than the generation that existed when it asked.
    for asked_at, fresh, result in answers:
        assert result.generation >= asked_at
        if fresh:
            assert result.generation > asked_at
    store.close()
    return service, answers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(st.tuples(st.floats(0, 50, allow_nan=False), st.booleans()), min_size=2, max_size=40),
    delays=st.lists(st.floats(0.001, 12, allow_nan=False), min_size=1, max_size=40),
    usable=st.lists(st.booleans(), min_size=1, max_size=8),
)
def test_many_concurrent_probes_in_random_order(requests, delays, usable):
    trio.run(_scenario, requests, delays, usable, clock=trio.testing.MockClock(autojump_threshold=0))


def test_slow_old_probe_never_overwrites_a_fresh_verdict():
    async def main():
        store = open_store(":memory:")
        # Generation 1 takes 10 s and says "missing"; generation 2 takes 1 s and says "available".
        fake = FakeProbes([10.0, 1.0], [False, True])
        service = ProbeService(store, ("cuda",), run_probe=fake)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            slow = []
            nursery.start_soon(lambda: _collect(service.probe("cuda"), slow))
            await trio.sleep(0.5)
            fresh = await service.probe("cuda", fresh=True)
            assert fresh.generation == 2 and fresh.detection.usable
            await trio.sleep(20)
            # The first caller waited for the newest verdict, not its own stale one.
            assert slow[0].generation == 2 and slow[0].detection.usable
            assert service.runner("cuda").data.dropped == 1
            drop = [r for r in store.history(machine="probe:cuda") if r.reason == "probe_result_stale"]
            assert drop and drop[0].evidence["dropped_generation"] == 1
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def _collect(coro, into):
    into.append(await coro)


def test_cache_answers_within_ttl_and_expires():
    async def main():
        store = open_store(":memory:")
        fake = FakeProbes([2.0])
        service = ProbeService(store, ("cuda", "rocm"), run_probe=fake, ttl=30.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            first = await service.probe("cuda")
            assert not first.cached and fake.calls == 1
            await trio.sleep(10)
            again = await service.probe("cuda")
            assert again.cached and again.generation == first.generation and fake.calls == 1
            assert 9.9 < again.age_s < 10.1
            forced = await service.probe("cuda", fresh=True)
            assert not forced.cached and forced.generation == 2 and fake.calls == 2
            await trio.sleep(31)
            assert service.runner("cuda").state is P.ProbeState.IDLE  # Expired fired
            later = await service.probe("cuda")
            assert not later.cached and later.generation == 3
            both = await service.probe_all()
            assert list(both) == ["cuda", "rocm"] and both["cuda"].cached and not both["rocm"].cached
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_concurrent_callers_share_one_probe():
    async def main():
        store = open_store(":memory:")
        fake = FakeProbes([3.0])
        service = ProbeService(store, ("cuda",), run_probe=fake)
        got = []
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            async with trio.open_nursery() as callers:
                for _ in range(20):
                    callers.start_soon(_collect, service.probe("cuda"), got)
            nursery.cancel_scope.cancel()
        assert fake.calls == 1 and {r.generation for r in got} == {1}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_probes_started_ahead_are_joined_by_the_plan_and_run_once():
    """A daemon asks for its candidates' verdicts while its code loads (daemon/start.py): the
    plan's probes join those in flight, a fresh verdict starts nothing, an unknown name is skipped."""

    async def main():
        store = open_store(":memory:")
        fake = FakeProbes([3.0])
        service = ProbeService(store, ("cuda", "vulkan"), run_probe=fake)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            service.start_probes(["cuda", "vulkan", "nothing-such"])
            await trio.sleep(1.0)
            service.start_probes(["cuda"])  # in flight already: not started again
            with trio.fail_after(5):
                results = await service.probe_all(["cuda", "vulkan"])
            assert trio.current_time() == pytest.approx(3.0)  # joined, not waited for anew
            service.start_probes(["cuda", "vulkan"])  # verdicts within the TTL: nothing started
            await trio.sleep(0)
            nursery.cancel_scope.cancel()
        assert fake.calls == 2
        assert {name: r.generation for name, r in results.items()} == {"cuda": 1, "vulkan": 1}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_machine_left_probing_by_a_dead_daemon_is_probed_again():
    async def main():
        store = open_store(":memory:")
        from stoker.daemon.core.machines import MachineRunner

        MachineRunner(P.PROBE, "probe:cuda", store).fire(P.ProbeRequested("cuda"))  # then "killed"
        fake = FakeProbes([1.0])
        service = ProbeService(store, ("cuda",), run_probe=fake)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            with trio.fail_after(5):
                result = await service.probe("cuda")
            assert result.generation == 2
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_unknown_backend_is_refused():
    async def main():
        service = ProbeService(open_store(":memory:"), ("cpu",), run_probe=FakeProbes([1.0]))
        with pytest.raises(KeyError):
            await service.probe("tpu")

    trio.run(main)


def test_a_quick_answer_spares_the_subprocess_and_a_broken_one_does_not_count():
    """quick_detect answers in-process when it can (metal off a Mac, no ROCm/Vulkan tools);
    None or a plugin bug sends the backend to the subprocess probe as before."""

    def broken():
        raise RuntimeError("plugin bug")

    async def main():
        store = open_store(":memory:")
        fake = FakeProbes([1.0])
        quick = {
            "metal": lambda: Detection.unavailable("metal", ReasonCode.GPU_MISSING, present=False, message="not a Mac"),
            "cuda": lambda: None,
            "rocm": broken,
        }
        service = ProbeService(store, ("cuda", "rocm", "metal"), run_probe=fake, quick=quick)
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            got = await service.probe_all()
            nursery.cancel_scope.cancel()
        assert fake.calls == 2 and service.probes_run == 2  # cuda and rocm went out of process
        metal = got["metal"].detection
        assert metal.reason == ReasonCode.GPU_MISSING and metal.evidence["probed"] == "in-process (quick_detect)"
        assert service.runner("metal").state is P.ProbeState.UNAVAILABLE  # the same machine, the same history
        assert "probed" not in got["cuda"].detection.evidence

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_builtin_quick_detect_matches_detect(tmp_path, monkeypatch):
    """With no tools on PATH and not on a Mac, the built-ins answer exactly as detect() does."""
    from stoker.daemon.backends.cuda import CudaBackend
    from stoker.daemon.backends.metal import MetalBackend
    from stoker.daemon.backends.rocm import RocmBackend
    from stoker.daemon.backends.vulkan import VulkanBackend

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no amd-smi, rocm-smi, vulkaninfo
    for backend in (VulkanBackend(), RocmBackend(sysfs_root=tmp_path), MetalBackend()):
        quick = backend.quick_detect()
        assert quick is not None and quick.to_dict() == backend.detect().to_dict(), backend.name
        assert not quick.usable
    assert CudaBackend().quick_detect() is None  # NVML is a driver: always out of process
