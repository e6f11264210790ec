"""Server instances: each has its own launch and fallback machines, keyed in the store by name.

One instance runs today; these tests build a second beside it, on the same store and paths,
and check that neither touches the other and that history answers per instance.
"""

from __future__ import annotations

import pytest

from stoker.daemon.config.model import Config
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.fallback.orchestrator import FallbackOrchestrator
from stoker.daemon.launch.instance import ServerInstance
from stoker.daemon.launch.supervisor import Supervisor
from stoker.states.fallback import table as F
from stoker.states.launch import records as LR
from stoker.states.reasons import ReasonCode
from stoker.store import open_store


async def never(config, effect):  # the planner; nothing here plans
    raise AssertionError("no plan is asked for")


@pytest.fixture
def store():
    s = open_store(":memory:")
    yield s
    s.close()


def test_the_default_instance_keeps_the_ids_history_has_always_used(stoker_home):
    paths = StokerPaths.from_env()
    default = ServerInstance()
    assert (default.machine_id("launch"), default.machine_id("fallback")) == ("launch", "fallback")
    assert default.identity_file(paths).name == "server.json"
    assert default.log_path(paths).name == "llama-server.log"
    other = ServerInstance("coder")
    assert (other.machine_id("launch"), other.machine_id("fallback")) == ("launch:coder", "fallback:coder")
    assert other.identity_file(paths) != default.identity_file(paths)
    assert other.log_path(paths) != default.log_path(paths)
    with pytest.raises(ValueError):
        ServerInstance("../etc")


def test_a_second_instance_is_built_beside_the_first_without_touching_it(stoker_home, store):
    paths = StokerPaths.from_env()
    first = Supervisor(paths, store, Config(), never)
    second = Supervisor(paths, store, Config(), never, instance=ServerInstance("coder"))
    first.runner.fire(LR.UpRequested())
    first.runner.fire(LR.PlanFailed(ReasonCode.MODEL_MISSING))
    assert (first.state, second.state) == (LR.LaunchState.FAILED, LR.LaunchState.STOPPED)
    second.runner.fire(LR.UpRequested())
    assert [r.event for r in store.history(machine="launch")] == ["PlanFailed", "UpRequested"]
    assert [r.event for r in store.history(machine="launch:coder")] == ["UpRequested"]
    assert {r.machine_id for r in store.history(kind="launch")} == {"launch", "launch:coder"}
    # ... and each comes back as it was, from the store alone
    again = Supervisor(paths, store, Config(), never, instance=ServerInstance("coder"))
    assert again.runner.resumed and again.state is LR.LaunchState.PLANNING
    assert Supervisor(paths, store, Config(), never).state is LR.LaunchState.FAILED


def test_each_instance_has_its_own_fallback_machine(stoker_home, store):
    paths = StokerPaths.from_env()
    one = FallbackOrchestrator(paths, store, probes=None, installs=None, backends={})
    two = FallbackOrchestrator(paths, store, probes=None, installs=None, backends={}, instance=ServerInstance("coder"))
    one.runner.fire(F.PlanRequested(("cpu",)))
    assert (one.runner.state, two.runner.state) == (F.FallbackState.CHECKING, F.FallbackState.IDLE)
    assert (one.runner.machine_id, two.runner.machine_id) == ("fallback", "fallback:coder")
