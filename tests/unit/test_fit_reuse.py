"""The engine fitter runs once per what decides its answer (states/fallback/fit_reuse.py,
daemon/engine/fit.py): a plan made again (an unload, a restart, a new daemon) reuses the kept
answer; a changed model file, another bundle, other arguments or another band of free memory
run it again; a `-ngl auto` plan that fits whole runs it once, never a fit and a projection.

The fitter here is a script that logs each run and answers as llama-fit-params does (the real
one needs a GPU for a fit: tests/gpu/ runs it there)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stoker.daemon.engine import fit
from stoker.states.fallback.fit_reuse import FREE_BAND_MIB, FitRoom, fits_whole, free_bands

# 13.5 GiB on the GPU with every layer: a 13.5 GiB model on an H200 (139 GiB free).
FAKE = """#!/bin/sh
echo "$@" >> "{log}"
case "$*" in
  *-ngl\\ 20*--fit-print*) echo "CUDA0 8000 500 300"; echo "Host 5800 0 20" ;;
  *--fit-print*) echo "CUDA0 13800 1000 300"; echo "Host 0 0 20" ;;
  *) echo "-c 8192 -ngl 20" ;;
esac
"""

H200 = FitRoom({0: 143_000}, margin_mib=1024, reserve_mib=524)
SMALL = FitRoom({0: 10_000}, margin_mib=1024, reserve_mib=524)


@pytest.fixture
def fitter(tmp_path: Path):
    log = tmp_path / "runs.log"
    tool = tmp_path / "llama-fit-params"
    tool.write_text(FAKE.format(log=log))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    cache = fit.keep_answers_in(tmp_path / fit.CACHE_FILE)
    yield tool, model, log, cache
    fit.keep_answers_in(None)


def runs(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


ARGS = ["-c", "8192", "-ngl", "auto"]


def test_a_plan_that_fits_whole_runs_the_fitter_once_and_a_repeat_not_at_all(fitter):
    tool, model, log, _ = fitter
    first = fit.project(tool, model, ARGS, {}, fit_first=True, room=H200)
    assert first.fitted_args == () and first.devices == {"CUDA0": 15100.0}
    assert len(runs(log)) == 1 and "--fit-print" in runs(log)[0]  # the projection, no fit
    again = fit.project(tool, model, ARGS, {}, fit_first=True, room=FitRoom({0: 143_000 - 100}, 1024, 524))
    assert again.parts == first.parts and len(runs(log)) == 1  # the same band: nothing ran


def test_a_daemon_started_again_reuses_the_answers_kept_in_its_data_dir(fitter, tmp_path):
    tool, model, log, cache = fitter
    fit.project(tool, model, ARGS, {}, fit_first=True, room=SMALL)
    assert len(runs(log)) == 3  # the whole projection, the fit, the fitted projection
    assert oct(os.stat(cache.path).st_mode & 0o777) == "0o600"
    fit.keep_answers_in(cache.path)  # a new daemon: a new cache on the same file
    found = fit.project(tool, model, ARGS, {}, fit_first=True, room=SMALL)
    assert found.fitted_args == ("-c", "8192", "-ngl", "20")
    assert found.whole is not None and found.devices == {"CUDA0": 8800.0}
    assert len(runs(log)) == 3 and fit.answers().runs == 0


def test_a_changed_model_file_runs_it_again_once(fitter):
    tool, model, log, _ = fitter
    fit.project(tool, model, ARGS, {}, fit_first=True, room=H200)
    model.write_bytes(b"GGUF" + b"\0" * 80)  # rewritten: another size and mtime (no content id given)
    fit.project(tool, model, ARGS, {}, fit_first=True, room=H200)
    assert len(runs(log)) == 2  # one run for each file, never a projection after a fit


def test_another_band_of_free_memory_fits_again_and_other_args_project_again(fitter):
    tool, model, log, _ = fitter
    fit.project(tool, model, ARGS, {}, fit_first=True, room=SMALL)
    assert len(runs(log)) == 3
    fit.project(tool, model, ARGS, {}, fit_first=True, room=FitRoom({0: 10_000 - FREE_BAND_MIB}, 1024, 524))
    assert len(runs(log)) == 4  # the fit again; both projections were kept
    fit.project(tool, model, ["-c", "4096", "-ngl", "auto"], {}, fit_first=True, room=H200)
    assert len(runs(log)) == 5


def test_no_reading_of_free_memory_fits_every_time():
    assert not fits_whole({"CUDA0": 100.0}, None)
    assert not fits_whole({"CUDA0": 100.0, "CUDA1": 100.0}, FitRoom({0: 100_000}))  # a device not read


def test_fits_whole_keeps_the_engines_margin_and_the_runtimes_share():
    room = FitRoom({0: 10_000, 1: 9_000}, margin_mib=1024, reserve_mib=524)
    assert fits_whole({"CUDA0": 7452.0, "CUDA1": 100.0}, room)
    assert not fits_whole({"CUDA0": 7453.0, "CUDA1": 100.0}, room)


def test_free_memory_is_compared_in_bands():
    assert free_bands({1: 1023, 0: 143_000}) == ((0, 142_848), (1, 512))


def test_a_model_touched_without_a_change_keeps_its_answers_by_its_content_id(fitter, tmp_path):
    from stoker.daemon.bundles.tinymodel import write_tiny_model
    from stoker.daemon.fallback.memory import _content_id
    from stoker.states.launch.records import LaunchPlan

    tool, _, log, _ = fitter
    model = write_tiny_model(tmp_path / "tiny.gguf")
    plan = LaunchPlan("cuda", "x", "/b", "/b/llama-server", str(model))
    first = _content_id(plan)
    fit.project(tool, model, ARGS, {}, fit_first=True, room=H200, model_id=first)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes
    assert _content_id(plan) == first
    fit.project(tool, model, ARGS, {}, fit_first=True, room=H200, model_id=_content_id(plan))
    assert len(runs(log)) == 1
