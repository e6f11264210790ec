"""The restart delay (states/backoff.py): capped, exponential, jittered, never zero."""

import random

from hypothesis import given, strategies as st

from stoker.states.backoff import Backoff


@given(attempt=st.integers(1, 60), initial=st.floats(0.01, 5), cap=st.floats(0.01, 120), jitter=st.floats(0, 1))
def test_delay_is_jittered_within_half_and_full_step_and_capped(attempt, initial, cap, jitter):
    delay = Backoff(initial, cap).delay(attempt, jitter)
    step = min(cap, initial * 2 ** (attempt - 1))
    assert step * 0.5 - 1e-3 <= delay <= step + 1e-3
    assert delay > 0


def test_delay_grows_then_stops_at_the_cap():
    rng, policy = random.Random(1), Backoff(0.5, 30)
    means = [sum(policy.delay(a, rng.random()) for _ in range(200)) / 200 for a in range(1, 10)]
    assert means[0] < means[1] < means[2] < means[3] < means[5]
    assert 0.75 * 30 * 0.9 < means[-1] < 30  # capped: the mean of U(15, 30) is 22.5


def test_the_default_policy_is_the_configs_default():
    assert [Backoff().step(a) for a in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert Backoff().delay(1, 0.0) == 0.25 and Backoff().delay(1, 0.999999) == 0.5
