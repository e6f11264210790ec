"""The restart delay: capped, exponential, jittered, never zero."""

import random

from hypothesis import given, strategies as st

from daemon.launch.supervisor import backoff_delay


@given(attempt=st.integers(1, 60), initial=st.floats(0.01, 5), cap=st.floats(0.01, 120), seed=st.integers())
def test_delay_is_jittered_within_half_and_full_step_and_capped(attempt, initial, cap, seed):
    delay = backoff_delay(attempt, initial, cap, random.Random(seed))
    step = min(cap, initial * 2 ** (attempt - 1))
    assert step * 0.5 - 1e-3 <= delay <= step + 1e-3
    assert delay > 0


def test_delay_grows_then_stops_at_the_cap():
    rng = random.Random(1)
    means = [sum(backoff_delay(a, 0.5, 30, rng) for _ in range(200)) / 200 for a in range(1, 10)]
    assert means[0] < means[1] < means[2] < means[3] < means[5]
    assert 0.75 * 30 * 0.9 < means[-1] < 30  # capped: the mean of U(15, 30) is 22.5
