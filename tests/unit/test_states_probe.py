"""The probe machine: generation tokens under many concurrent probes finishing in any order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from stoker.states.machine import IllegalTransition, step
from stoker.states.probe.table import (
    PROBE,
    ArmExpiry,
    Expired,
    ProbeData,
    ProbeFailed,
    ProbeRequested,
    ProbeState as S,
    ProbeSucceeded,
    RunProbe,
)
from stoker.states.reasons import ReasonCode


def drive(*events, state=S.IDLE, data=None):
    data = ProbeData() if data is None else data
    result = None
    for event in events:
        result = step(PROBE, state, data, event)
        state, data = result.state, result.data
    return result


def test_one_probe():
    s = drive(ProbeRequested("cuda"))
    assert s.state is S.PROBING and s.effects == (RunProbe("cuda", 1, 10.0),)
    s = drive(ProbeRequested("cuda"), ProbeSucceeded(1, {"devices": 1}))
    assert s.state is S.AVAILABLE and s.effects == (ArmExpiry(1, 30.0),)
    s = drive(ProbeRequested("cuda"), ProbeFailed(1, ReasonCode.GPU_MISSING))
    assert s.state is S.UNAVAILABLE and s.reason is ReasonCode.GPU_MISSING
    assert PROBE.machine_id("cuda") == "probe:cuda"


def test_older_result_is_dropped_and_visible():
    s = drive(ProbeRequested("cuda"), ProbeRequested(), ProbeSucceeded(2), ProbeFailed(1, ReasonCode.CUDA_UNAVAILABLE))
    assert s.state is S.AVAILABLE and s.data.result_generation == 2 and s.data.reason is None
    assert s.reason is ReasonCode.PROBE_RESULT_STALE
    assert s.evidence == {"dropped_generation": 1, "newest_generation": 2, "result_generation": 2}
    assert s.data.dropped == 1


def test_expiry_only_for_the_current_verdict():
    s = drive(ProbeRequested("cuda"), ProbeSucceeded(1), Expired(1))
    assert s.state is S.IDLE
    s = drive(ProbeRequested("cuda"), ProbeSucceeded(1), ProbeRequested(), ProbeSucceeded(2))
    with pytest.raises(IllegalTransition):
        step(PROBE, s.state, s.data, Expired(1))


def test_never_started_generation_and_nameless_first_request_are_illegal():
    with pytest.raises(IllegalTransition):
        drive(ProbeRequested("cuda"), ProbeSucceeded(2))
    with pytest.raises(IllegalTransition):
        drive(ProbeSucceeded(1))
    with pytest.raises(IllegalTransition):
        drive(ProbeRequested())


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=1, max_value=40).flatmap(
        lambda n: st.tuples(
            st.just(n), st.permutations(range(1, n + 1)), st.lists(st.booleans(), min_size=n, max_size=n)
        )
    )
)
def test_many_concurrent_probes_newest_wins(case):
    """n probes all in flight, finishing in a random order: only generation n counts."""
    n, order, oks = case
    state, data = S.IDLE, ProbeData(backend="cuda")
    for _ in range(n):
        s = step(PROBE, state, data, ProbeRequested())
        state, data = s.state, s.data
    seen_newest = False
    for gen in order:
        event = (
            ProbeSucceeded(gen, {"g": gen}) if oks[gen - 1] else ProbeFailed(gen, ReasonCode.GPU_MISSING, {"g": gen})
        )
        s = step(PROBE, state, data, event)
        if gen == n:
            seen_newest = True
            assert s.reason in (None, ReasonCode.GPU_MISSING)
        else:
            assert s.reason is ReasonCode.PROBE_RESULT_STALE and s.state is state and s.effects == ()
        state, data = s.state, s.data
        if seen_newest:
            assert state is (S.AVAILABLE if oks[n - 1] else S.UNAVAILABLE)
            assert data.result_generation == n and data.evidence == {"g": n}
        else:
            assert state is S.PROBING and data.result_generation == 0
    assert data.dropped == n - 1
