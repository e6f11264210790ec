"""The one retry table of every download: which failures are tried again, how often, how long apart."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st

from stoker.states.download_retry import RETRY_TABLE, DownloadFailure, RetryRule, retry_after


def test_a_cut_is_tried_again_five_times_with_growing_waits_then_given_up() -> None:
    waits = [retry_after(DownloadFailure.CUT, n) for n in range(1, 7)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, None]


def test_a_busy_server_is_given_longer_waits() -> None:
    assert [retry_after(DownloadFailure.BUSY, n) for n in (1, 5, 6)] == [1.0, 16.0, None]


def test_a_refusal_is_never_tried_again() -> None:
    assert retry_after(DownloadFailure.REFUSED, 1) is None


def test_a_changed_file_starts_over_at_once_three_times() -> None:
    assert [retry_after(DownloadFailure.CHANGED, n) for n in (1, 3, 4)] == [0.0, 0.0, None]


def test_the_last_wait_repeats() -> None:
    table = {**RETRY_TABLE, DownloadFailure.CUT: RetryRule(3, (0.1,))}
    assert [retry_after(DownloadFailure.CUT, n, table) for n in (1, 2, 3, 4)] == [0.1, 0.1, 0.1, None]


@hypothesis.given(st.sampled_from(list(DownloadFailure)), st.integers(min_value=1, max_value=1000))
def test_every_failure_is_in_the_table_and_the_waits_are_bounded(failure: DownloadFailure, n: int) -> None:
    wait = retry_after(failure, n)
    assert wait is None or 0 <= wait <= max(RETRY_TABLE[failure].waits)
    assert (wait is None) == (n > RETRY_TABLE[failure].tries)
