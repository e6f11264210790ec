"""What history records is what ran: the plan in `PlanReady` against the real server's argv
and environment.

The plan is complete when planning ends (daemon/fallback/launch_plan.py) and the supervisor
builds the command line from it alone, so the command line rebuilt from the recorded plan
must be exactly the one the kernel reports for the live llama-server (psutil), with the
per-launch API key file as the only thing the plan does not name.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from stoker.daemon.engine.process import server_argv, server_env
from stoker.daemon.launch.supervisor import server_spec
from stoker.states.launch.table import LAUNCH
from stoker.states.machine import event_from_json
from tests.integration.daemon_harness import tiny_config, write_config

pytestmark = [pytest.mark.engine]


def recorded_plans(daemon):
    rows = [r for r in reversed(daemon.history(machine="launch", limit=500)) if r["event"] == "PlanReady"]
    return [event_from_json(LAUNCH, r["event"], r["event_data"]).plan for r in rows]


def argv_of(pid: int) -> list[str]:
    return psutil.Process(pid).cmdline()


def test_history_records_exactly_the_command_line_that_ran(daemon, model):
    write_config(daemon.paths, tiny_config(model, threads=2, flash_attn="off", extra_args=["--jinja"], snapshots=True))
    daemon.start()
    st = daemon.wait_state("ready", timeout=120)
    (plan,) = recorded_plans(daemon)
    ran = argv_of(st["pid"])
    key_file = Path(ran[ran.index("--api-key-file") + 1])
    assert ran == server_argv(server_spec(plan), api_key_file=key_file)
    # ... and the plan holds everything the config, the snapshots and telemetry asked for
    assert (plan.backend, plan.n_gpu_layers, plan.threads, plan.flash_attn) == ("cpu", 0, 2, "off")
    assert plan.backend_args == ("-ngl", "0")  # the CPU plugin's launch arguments
    assert plan.slot_save_path == str(daemon.paths.snapshots_dir)
    # The engine's alias (the name answers carry), the user's extra_args, then Stoker's own.
    assert plan.extra_args[:4] == ("--alias", model.name, "--jinja", "--metrics")
    assert ran[ran.index("-ngl") + 1] == "0" and ran[ran.index("-t") + 1] == "2"
    # ... and its environment: the engine's minimal one plus what the backend plugin set for
    # the plan (the devices a GPU server may use; nothing for the CPU), as recorded.
    assert plan.backend_env == ()
    ran_env = psutil.Process(st["pid"]).environ()
    expected = server_env(server_spec(plan))
    assert {name: ran_env.get(name) for name in expected} == expected


def test_a_respawn_runs_the_recorded_plan_again(daemon, model):
    import os
    import signal

    daemon.start()
    first = daemon.wait_state("ready", timeout=120)
    os.kill(first["pid"], signal.SIGKILL)
    second = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != first["pid"], 60, "a respawn")
    (plan,) = recorded_plans(daemon)  # respawned with the same plan: no new PlanReady
    ran = argv_of(second["pid"])
    assert ran == server_argv(server_spec(plan), api_key_file=Path(ran[ran.index("--api-key-file") + 1]))
