"""`stoker snapshot restore`: what it says of its own cost, the daemon's and a re-prefill's."""

from __future__ import annotations

import subprocess
import sys

from stoker.daemon.cli.snapshot import format_restored, process_age_s
from stoker.daemon.control.snapshot_replies import SnapshotRestored

DECISION = {"choice": "restore", "why": "...", "restore_s_est": 0.0125, "prefill_s_est": 26.0}


def _restored(**kw):
    base = dict(
        id=3,
        slot=0,
        n_tokens=4096,
        restore_ms=6.1,
        checked="stat+sample",
        resident=1.0,
        saved_on="cpu",
        restored_on="cpu",
        cross_backend=False,
        daemon_ms=12.5,
        decision=DECISION,
    )
    return SnapshotRestored(**{**base, **kw})


def test_a_restore_says_the_daemons_time_both_estimates_and_its_own():
    text = format_restored(_restored(), {"start_s": 0.24, "wall_s": 0.31})
    assert text.splitlines() == [
        "restored snapshot 3 into slot 0: 4096 tokens in 12.5 ms on the daemon's side (the engine's restore 6.1 ms)",
        "estimates: restore ~12 ms, re-prefill ~26000 ms",
        "this command: 310 ms in all, 240 ms of it starting Python before it asked the daemon",
    ]


def test_where_re_prefill_is_faster_it_says_so_or_leaves_the_slot_to_it():
    slower = {"choice": "reprefill", "why": "re-prefilling beats restoring", "restore_s_est": 0.5, "prefill_s_est": 0.1}
    text = format_restored(_restored(decision=slower))
    assert "re-prefilling would have been faster here" in text and "--if-faster" in text
    left = format_restored(_restored(decision=slower, restored=False, restore_ms=None, daemon_ms=None))
    assert left.startswith("left snapshot 3 (slot 0, 4096 tokens) to a re-prefill: re-prefilling beats restoring")


def test_process_age_counts_this_process_start():
    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600


def test_the_restore_command_imports_neither_every_reply_nor_the_backends():
    code = (
        "import sys, stoker.daemon.cli, stoker.daemon.cli.snapshot, stoker.daemon.control.client, "
        "stoker.daemon.control.snapshot_replies, stoker.states.convert; "
        "print(sorted(m for m in sys.modules if m in ('stoker.daemon.control.replies', 'stoker.daemon.backends', "
        "'stoker.store', 'trio')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
