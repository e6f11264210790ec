"""The liveness judgement (states/launch/liveness.py): progress, never wall time."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from stoker.daemon.launch.liveness import slot_progress
from stoker.states.launch.liveness import (
    FROZEN_PROCESS_STATES,
    HEALTH_ANSWERS,
    LivenessSample,
    is_hung,
    liveness_cadence,
    sign_of_life,
)

slots = st.none() | st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10_000)), max_size=3).map(tuple)
samples = st.builds(
    LivenessSample,
    health=st.sampled_from(sorted(HEALTH_ANSWERS)),
    slots=slots,
    cpu_seconds=st.none() | st.floats(0, 1e6),
    process=st.none() | st.sampled_from(["running", "sleeping", "disk-sleep", *sorted(FROZEN_PROCESS_STATES)]),
)


@given(before=st.none() | samples, now=samples)
def test_a_frozen_process_never_shows_life(before, now):
    if now.process in FROZEN_PROCESS_STATES:
        assert not sign_of_life(before, now)


@given(before=st.none() | samples, now=samples)
def test_a_health_answer_from_a_live_process_is_always_life(before, now):
    if now.process not in FROZEN_PROCESS_STATES and now.health == "ok":
        assert sign_of_life(before, now)


@given(before=samples, health=st.sampled_from(["timeout", "refused", "error", "loading"]), used=st.floats(0.01, 100))
def test_a_long_generation_is_alive_even_when_health_is_slow(before, health, used):
    """Busy: /health late, but the process burned CPU or a slot moved since the last look."""
    base = before.cpu_seconds or 0.0
    burning = LivenessSample(health, before.slots, base + used, "running")
    assert sign_of_life(LivenessSample(before.health, before.slots, base, before.process), burning)
    moved = LivenessSample(health, ((0, 1, 7, 100),), None, "running")
    assert sign_of_life(LivenessSample("ok", ((0, 1, 7, 99),), None, "running"), moved)


def test_silence_is_nothing_answering_nothing_moving_nothing_burning():
    before = LivenessSample("ok", ((0, 1, 7, 100),), 12.5, "sleeping")
    assert not sign_of_life(before, LivenessSample("timeout", None, 12.5, "stopped"))
    assert not sign_of_life(before, LivenessSample("timeout", None, 12.5, "sleeping"))  # a deadlock
    assert not sign_of_life(before, LivenessSample("timeout", ((0, 1, 7, 100),), 12.5, "sleeping"))
    assert not sign_of_life(None, LivenessSample("timeout", None, None, None))  # nothing to compare with


def test_hung_only_past_hung_after_and_never_when_off():
    assert not is_hung(59.9, 60.0) and is_hung(60.0, 60.0) and is_hung(600.0, 60.0)
    assert not is_hung(1e9, 0.0)


@given(hung_after=st.floats(0.01, 1e5))
def test_a_few_samples_per_hung_after_at_most_five_seconds_apart(hung_after):
    every, answer_within = liveness_cadence(hung_after)
    assert 0.25 <= every <= 5.0 and answer_within == every
    if hung_after >= 1.0:
        assert every <= hung_after / 4 + 1e-9


def test_a_sample_refuses_an_unknown_health_answer():
    with pytest.raises(ValueError):
        LivenessSample("fine")


def test_slot_counters_from_the_engine_reply():
    reply = [
        {"id": 0, "n_ctx": 4096, "is_processing": False},
        {
            "id": 1,
            "is_processing": True,
            "id_task": 7,
            "n_prompt_tokens": 325,
            "n_prompt_tokens_processed": 7,
            "next_token": [{"n_decoded": 318, "n_remain": 2682}],
        },
    ]
    assert slot_progress(reply) == ((0, 0, -1, -1, -1, -1), (1, 1, 7, 325, 7, 318))
    assert slot_progress({"error": "x"}) == ()
