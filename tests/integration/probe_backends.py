"""Test-only backends that misbehave inside the probe child (loaded with --target)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from stoker.daemon.backends import Backend, Detection
from stoker.states.reasons import ReasonCode as R


class _TestBackend(Backend):
    device_signature = re.compile(r"^$")
    unavailable_reason = R.PROBE_FAILED
    reason_codes = frozenset({R.PROBE_FAILED})

    def choose_variant(self, detection, available_variants):
        return None


class SegfaultBackend(_TestBackend):
    """A driver that segfaults during detection."""

    name = "segv"

    def detect(self) -> Detection:
        print("about to touch the driver", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
        raise AssertionError("unreachable")


class SegfaultingCuda(SegfaultBackend):
    """The same crash under the cuda name: the verdict must be cuda_unavailable."""

    name = "cuda"


class HangingBackend(_TestBackend):
    """A driver call that never returns and ignores SIGTERM, with a grandchild of its own.

    Writes "child_pid grandchild_pid" to $STOKER_TEST_PIDFILE so the test can check that
    the whole process group was killed.
    """

    name = "hang"

    def detect(self) -> Detection:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        helper = subprocess.Popen(["sleep", "3600"])
        with open(os.environ["STOKER_TEST_PIDFILE"], "w") as f:
            f.write(f"{os.getpid()} {helper.pid}")
        print("waiting for the driver", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)


class RaisingBackend(_TestBackend):
    name = "raising"

    def detect(self) -> Detection:
        raise RuntimeError("libfoo.so.1: cannot open shared object file")


class GarbageBackend(_TestBackend):
    """Exits without a detection after printing noise."""

    name = "garbage"

    def detect(self) -> Detection:
        sys.__stdout__.write("not json at all\n")
        sys.__stdout__.flush()
        os._exit(3)


class DaemonizingBackend(_TestBackend):
    """Answers at once but leaves a daemon (own session) holding its stdout open."""

    name = "daemonizing"

    def detect(self) -> Detection:
        helper = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        with open(os.environ["STOKER_TEST_PIDFILE"], "w") as f:
            f.write(str(helper.pid))
        return Detection.available(self.name, [], "answered; a helper daemon lives on")
