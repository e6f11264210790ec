"""The engine's memory fitter failing: a launch is never refused or held up for it.

The bundle's llama-fit-params (daemon/engine/fit.py) is replaced by a program that fails the ways
a real one can: exits with an error, prints nothing the daemon reads, or never answers. The
plan then carries Stoker's own estimate (source "stoker", partial), saying why the fitter did not
answer, and the model serves as it would have; a fitter that hangs is abandoned at its time bound
and leaves no process behind.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from stoker.daemon.engine.fit import FitFailed, project
from tests.integration.test_several_models import models_of
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]


def replace_fitter(bundle_root: Path, script: str) -> Path:
    tool = bundle_root / "bin" / "llama-fit-params"
    tool.unlink()
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    return tool


@pytest.mark.parametrize(
    "script, said",
    [
        ('echo "error: invalid argument: --frobnicate" >&2\nexit 1\n', "exited with status 1: error: invalid argument"),
        ('echo "llama_fit_params: printing estimated memory ..."\n', "no projection in its output"),
    ],
)
def test_a_failing_fitter_leaves_stokers_estimate_and_the_model_serves(
    daemon, installed_cpu_bundle, model, script, said
):
    replace_fitter(installed_cpu_bundle.root, script)
    daemon.start()
    daemon.wait_state("ready")
    (row,) = models_of(daemon).values()
    estimate = row["memory"]["estimate"]
    assert estimate["source"] == "stoker" and estimate["partial"]
    assert "llama-fit-params did not answer" in estimate["detail"] and said in estimate["detail"]
    assert estimate["ram_mib"] >= model.stat().st_size / 2**20  # at least the file
    assert "Stoker estimates" in daemon.log_text()  # the daemon's log says so too


def test_a_fitter_that_never_answers_is_abandoned_at_its_bound(tmp_path, model):
    tool = tmp_path / "llama-fit-params"
    tool.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 60\n")
    tool.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(FitFailed, match="ran past 1 s"):
        project(tool, model, ["-c", "256"], {"PATH": os.defpath}, timeout=1.0)
    assert time.monotonic() - started < 5
    pid = int((tmp_path / "pid").read_text())

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, timeout=5, what=f"the fitter {pid} that ran past its time to be killed")


def test_the_fitter_runs_once_for_a_model_across_plans_and_daemons(daemon, installed_cpu_bundle, model, tmp_path):
    """Its answer is kept under the data dir: a second `up`, a daemon started again and the
    model file touched with the same bytes run no fitter; its projection still decides."""
    runs = tmp_path / "runs"
    replace_fitter(installed_cpu_bundle.root, f'echo run >> "{runs}"\necho "Host 30 2 5"\n')

    def fitter_runs() -> int:
        return len(runs.read_text().splitlines()) if runs.exists() else 0

    daemon.start()
    daemon.wait_state("ready")
    assert fitter_runs() == 1
    (row,) = models_of(daemon).values()
    assert row["memory"]["estimate"]["source"] == "llama-fit-params"
    assert row["memory"]["estimate"]["ram_mib"] == 37.0
    daemon.call("down")
    daemon.call("up")
    daemon.wait_state("ready")
    daemon.stop()
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    daemon.start()
    daemon.wait_state("ready")
    assert fitter_runs() == 1
    (row,) = models_of(daemon).values()
    assert row["memory"]["estimate"]["source"] == "llama-fit-params"
