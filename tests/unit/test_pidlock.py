"""One daemon and one `stoker worker` per data directory: the second is refused with the pid of
the first, and the lock is free again once the holder's descriptor is closed."""

from __future__ import annotations

import os

import pytest

from stoker.daemon.cli.worker import hold_worker_lock
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.pidlock import acquire_lock
from stoker.states.reasons import ReasonCode


@pytest.mark.parametrize(
    "take, who", [(acquire_lock, "Another Stoker daemon"), (hold_worker_lock, "Another `stoker worker`")]
)
def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path, take, who):
    path = tmp_path / "run" / "daemon.lock"
    fd = take(path)
    assert path.read_text() == f"{os.getpid()}\n" and oct(path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(StokerError) as refused:
        take(path)
    assert refused.value.reason is ReasonCode.DAEMON_ALREADY_RUNNING
    assert f"{who} (pid {os.getpid()}) already runs for {path.parent}" in str(refused.value)
    assert refused.value.evidence == {"pid": str(os.getpid()), "lock": str(path)}
    os.close(fd)
    os.close(take(path))  # released with its descriptor: the next one takes it
