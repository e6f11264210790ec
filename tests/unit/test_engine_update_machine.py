"""The engine update machine's table (states/engine_update/table.py): the gates, the way back, resumes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.states.engine_update import table as U
from stoker.states.engine_update import records as R
from stoker.states.machine import IllegalTransition, step
from stoker.states.reasons import ReasonCode

S = R.UpdateState
OLD = R.BundleFacts("b11434", "a" * 64)
NEW = R.BundleFacts("b11434.1", "b" * 64)
CANDIDATE = R.Candidate("b11434.1", "c" * 64, "https://mirror.example/cpu.zip", "c" * 64, 1000)
TOKENS = (1, 2, 3, 4)


def run(state, data, *events):
    result = None
    for event in events:
        result = step(U.ENGINE_UPDATE, state, data, event)
        state, data = result.state, result.data
    return result


def to_switching(servers=(R.ServerBaseline("default", None, None),), backend="cpu"):
    return run(
        S.IDLE,
        R.UpdateData(),
        R.UpdateRequested(backend, "avx2"),
        R.Resolved(OLD, CANDIDATE),
        R.Staged(NEW, "/data/bundles/.update-cpu-avx2/bundle", TOKENS),
        R.TokensCompared(TOKENS),
        R.Switched(servers),
    )


def test_a_good_update_switches_restarts_and_sticks():
    restarting = to_switching()
    assert restarting.state is S.RESTARTING
    assert R.RestartServers(("default",)) in restarting.effects
    done = step(
        U.ENGINE_UPDATE,
        restarting.state,
        restarting.data,
        R.ServersRestarted((R.ServerVerdict("default", "ready", "cpu"),)),
    )
    assert done.state is S.UPDATED and done.reason is None and done.effects == ()


def test_gates_before_the_switch_reject_and_leave_the_slot_alone():
    resolving = run(S.IDLE, R.UpdateData(), R.UpdateRequested("cpu", "avx2"))
    assert resolving.effects == (R.Resolve("cpu", "avx2", None, None),)
    staging = step(U.ENGINE_UPDATE, resolving.state, resolving.data, R.Resolved(OLD, CANDIDATE))
    assert staging.state is S.STAGING and isinstance(staging.effects[-1], R.Stage)
    smoke = step(U.ENGINE_UPDATE, staging.state, staging.data, R.GateFailed("smoke", {"cause": "bundle_verify_failed"}))
    assert smoke.state is S.REJECTED and smoke.reason is ReasonCode.ENGINE_UPDATE_REJECTED
    assert smoke.evidence["gate"] == "smoke" and smoke.effects == (R.CleanStaging(),)
    assert not any(isinstance(e, (R.Switch, R.RollBack)) for e in smoke.effects)


def test_tokens_that_differ_are_refused_and_not_offered_again_automatically():
    comparing = run(
        S.IDLE,
        R.UpdateData(),
        R.UpdateRequested("cpu", "avx2"),
        R.Resolved(OLD, CANDIDATE),
        R.Staged(NEW, "/staging", TOKENS),
    )
    rejected = step(U.ENGINE_UPDATE, comparing.state, comparing.data, R.TokensCompared((1, 2, 9, 9)))
    assert rejected.state is S.REJECTED
    assert rejected.evidence["gate"] == "tokens" and rejected.evidence["first_difference"] == 2
    assert U.rejection_of(rejected.data, CANDIDATE.sha256).gate == "tokens"
    assert U.rejection_of(rejected.data, NEW.digest).version == "b11434.1"  # known by its digest too
    again = run(
        rejected.state, rejected.data, R.UpdateRequested("cpu", "avx2", automatic=True), R.Resolved(OLD, CANDIDATE)
    )
    assert again.state is S.CURRENT and "rejected here before" in again.evidence["message"]
    by_user = run(rejected.state, rejected.data, R.UpdateRequested("cpu", "avx2"), R.Resolved(OLD, CANDIDATE))
    assert by_user.state is S.STAGING  # a user asking again gets it staged and gated again


def test_nothing_newer_is_current_and_a_named_zip_needs_only_to_differ():
    older = R.Candidate("b11400", "d" * 64, "https://m/x.zip", "d" * 64, 10)
    current = run(S.IDLE, R.UpdateData(), R.UpdateRequested("cpu", "avx2"), R.Resolved(OLD, older))
    assert current.state is S.CURRENT and current.effects == ()
    named = R.Candidate("b11400", "e" * 64, "file:///tmp/x.zip")
    staged = run(S.IDLE, R.UpdateData(), R.UpdateRequested("cpu", "avx2", bundle="/tmp/x.zip"), R.Resolved(OLD, named))
    assert staged.state is S.STAGING
    same = R.Candidate("b11434", OLD.digest, "file:///tmp/y.zip")
    again = run(S.IDLE, R.UpdateData(), R.UpdateRequested("cpu", "avx2", bundle="/tmp/y.zip"), R.Resolved(OLD, same))
    assert again.state is S.CURRENT


def test_a_server_that_dies_on_the_new_engine_rolls_back_and_discards_it():
    restarting = to_switching()
    verdict = R.ServerVerdict("default", "exited", "cpu", reason="server_crashed", evidence={"returncode": 134})
    back = step(U.ENGINE_UPDATE, restarting.state, restarting.data, R.ServersRestarted((verdict,)))
    assert back.state is S.ROLLING_BACK
    assert back.effects == (R.RollBack("cpu-avx2", OLD.digest, NEW.digest),)
    assert back.evidence["gate"] == "start" and back.evidence["server_reason"] == "server_crashed"
    done = step(U.ENGINE_UPDATE, back.state, back.data, R.RolledBack({"restored": "b11434"}))
    assert done.state is S.ROLLED_BACK and done.reason is ReasonCode.ENGINE_UPDATE_ROLLED_BACK
    assert done.effects == (R.Relaunch(("default",)),)
    assert done.evidence["gate"] == "start"
    rejection = U.rejection_of(done.data, CANDIDATE.ref)
    assert rejection is not None and rejection.reason == "engine_update_rolled_back"
    assert rejection.refs == (CANDIDATE.ref, NEW.digest)


def test_no_layers_where_the_old_engine_offloaded_some_rolls_back():
    restarting = to_switching((R.ServerBaseline("big", 33, 33),), backend="cuda")
    verdict = R.ServerVerdict("big", "ready", "cuda", offloaded_layers=0, total_layers=33)
    back = step(U.ENGINE_UPDATE, restarting.state, restarting.data, R.ServersRestarted((verdict,)))
    assert back.state is S.ROLLING_BACK and back.evidence["gate"] == "layers"
    assert back.evidence["offloaded_before"] == 33 and back.evidence["offloaded_now"] == 0
    fell_back = R.ServerVerdict("big", "ready", "cpu")  # its GPU plan died and the CPU took over
    start = step(U.ENGINE_UPDATE, restarting.state, restarting.data, R.ServersRestarted((fell_back,)))
    assert start.state is S.ROLLING_BACK and start.evidence["gate"] == "start"
    cpu_only = to_switching((R.ServerBaseline("small", None, None),))
    ok = step(U.ENGINE_UPDATE, cpu_only.state, cpu_only.data, R.ServersRestarted((R.ServerVerdict("small", "ready"),)))
    assert ok.state is S.UPDATED


def test_no_server_on_the_slot_updates_without_the_start_gates():
    done = to_switching(servers=())
    assert done.state is S.UPDATED and done.evidence["gates_not_run"] == ["start", "layers"]


def test_rollback_by_hand_swaps_and_refuses_with_nothing_kept():
    refused = step(U.ENGINE_UPDATE, S.IDLE, R.UpdateData(), R.RollbackRequested("cpu", "avx2", OLD, None))
    assert refused.state is S.IDLE and refused.reason is ReasonCode.ENGINE_ROLLBACK_UNAVAILABLE
    back = step(U.ENGINE_UPDATE, S.UPDATED, R.UpdateData(), R.RollbackRequested("cpu", "avx2", NEW, OLD, ("m",)))
    assert back.effects == (R.RollBack("cpu-avx2", OLD.digest, None),)  # the replaced engine is kept
    done = step(U.ENGINE_UPDATE, back.state, back.data, R.RolledBack({}))
    assert done.state is S.ROLLED_BACK and done.reason is None and done.effects == (R.Relaunch(("m",)),)


@pytest.mark.parametrize(
    "state, expected",
    [
        (S.RESOLVING, R.Resolve),
        (S.STAGING, R.Stage),
        (S.COMPARING, R.Stage),
        (S.SWITCHING, R.Switch),
        (S.RESTARTING, R.RestartServers),
        (S.ROLLING_BACK, R.RollBack),
    ],
)
def test_every_working_state_resumes_with_its_step(state, expected):
    data = R.UpdateData(
        backend="cpu",
        variant="avx2",
        installed=OLD,
        candidate=CANDIDATE,
        staged=NEW,
        staging="/staging",
        servers=(R.ServerBaseline("default"),),
    )
    resumed = step(U.ENGINE_UPDATE, state, data, R.Resumed())
    assert isinstance(resumed.effects[-1], expected)
    assert resumed.data.resumes == 1
    if state is not S.SWITCHING and state is not S.ROLLING_BACK:  # those still need their staged tree
        assert resumed.effects[0] == R.CleanStaging()  # never a staging dir left behind


def test_events_out_of_turn_change_nothing():
    with pytest.raises(IllegalTransition):
        step(U.ENGINE_UPDATE, S.IDLE, R.UpdateData(), R.Switched(()))
    with pytest.raises(IllegalTransition):
        step(U.ENGINE_UPDATE, S.RESTARTING, R.UpdateData(), R.UpdateRequested("cpu", "avx2"))


def test_version_order_is_natural():
    assert U.version_key("b11434") < U.version_key("b11500") < U.version_key("b100000")
    assert U.version_key("b11434") < U.version_key("b11434.1") < U.version_key("b11434.2")


def test_engine_config_names_each_channels_manifest_and_refuses_bad_ones():
    from stoker.daemon.config.model import Config, ConfigError

    config = Config.from_mapping({"engine": {"channels": {"beta": "https://mirror.example/beta.json"}}})
    assert not config.engine.auto_update and config.engine.check_interval_s == 86400
    assert config.engine.manifest_for(None, "/srv/stable.json") == "/srv/stable.json"
    assert config.engine.manifest_for("beta", "/srv/stable.json") == "https://mirror.example/beta.json"
    assert config.engine.manifest_for("nightly", "/srv/stable.json") is None
    with pytest.raises(ConfigError) as bad:
        Config.from_mapping({"engine": {"channels": {"beta": "http://mirror.example/x.json"}, "channel": "Beta!"}})
    problems = " ".join(bad.value.evidence["problems"])
    assert "engine.channels" in problems and "engine.channel" in problems


def test_a_rollback_by_hand_rejects_the_engine_it_leaves_and_lifts_the_one_it_returns_to():
    restarting = to_switching()
    updated = run(restarting.state, restarting.data, R.ServersRestarted((R.ServerVerdict("default", "ready", "cpu"),)))
    back = run(updated.state, updated.data, R.RollbackRequested("cpu", "avx2", NEW, OLD, ()), R.RolledBack())
    assert back.state is S.ROLLED_BACK and back.reason is None
    left = U.rejection_of(back.data, CANDIDATE.sha256)
    assert left is not None and left.version == NEW.version and NEW.digest in left.refs
    # The automatic check does not bring it back; the install does not either (states/install/slot.py).
    assert "rolled back here before (by hand)" in U.automatic_check(back.data, OLD, CANDIDATE)
    forth = run(back.state, back.data, R.RollbackRequested("cpu", "avx2", OLD, NEW, ()), R.RolledBack())
    assert U.rejection_of(forth.data, CANDIDATE.sha256, NEW.digest) is None  # the user chose it again
    assert U.rejection_of(forth.data, OLD.digest) is not None


def test_the_automatic_check_starts_an_update_only_for_something_newer():
    data = R.UpdateData(backend="cpu", variant="avx2")
    assert U.automatic_check(data, OLD, CANDIDATE) is None
    assert "nothing newer" in U.automatic_check(data, OLD, R.Candidate("b11434", "f" * 64, "https://m/o.zip"))
    assert U.automatic_check(data, None, CANDIDATE) is not None


def test_an_update_never_starts_a_stopped_server():
    assert U.restart_wanted("ready") and U.restart_wanted("crashed") and U.restart_wanted("planning")
    assert not U.restart_wanted("stopped")


def test_a_step_that_raised_is_heard_as_its_gate_failing():
    cause = {"cause": "bundle_digest_mismatch", "message": "the sha256 differs"}
    assert U.step_failed(R.Stage(CANDIDATE, "cpu", "x86-64"), cause) == R.GateFailed(R.Gate.VERIFY, cause)
    assert U.step_failed(R.Resolve("cpu", "x86-64", None, None), cause) == R.GateFailed(R.Gate.FETCH, cause)
    assert U.step_failed(R.RollBack("cpu-x86-64", "a" * 64), cause) == R.RollbackFailed(cause)
    restarted = U.step_failed(R.RestartServers(("default", "beta")), cause)
    assert [(v.name, v.outcome, v.evidence) for v in restarted.verdicts] == [
        ("default", R.Outcome.TIMEOUT, cause),
        ("beta", R.Outcome.TIMEOUT, cause),
    ]
    assert U.step_failed(R.CleanStaging(), cause) is None  # nothing the machine needs to hear


def rolled_back_once():
    restarting = to_switching()
    verdict = R.ServerVerdict("default", "exited", "cpu", reason="server_crashed")
    return run(restarting.state, restarting.data, R.ServersRestarted((verdict,)), R.RolledBack())


def test_a_release_rolled_back_here_is_not_staged_again_and_the_user_is_told_why():
    done = rolled_back_once()
    assert done.state is S.ROLLED_BACK
    again = run(done.state, done.data, R.UpdateRequested("cpu", "avx2"), R.Resolved(OLD, CANDIDATE))
    assert again.state is S.CURRENT and again.effects == ()  # nothing staged, no server restarted
    assert again.reason is ReasonCode.ENGINE_UPDATE_ROLLED_BACK
    message = again.evidence["message"]
    assert "b11434.1 was rolled back here before" in message and "start gate: server default exited" in message
    assert "server_crashed" in message and "--bundle" in message
    assert again.evidence["rolled_back"]["gate"] == "start"
    # The zip named by the user is tried again; the automatic check does not start one.
    named = R.Candidate(CANDIDATE.version, NEW.digest, "file:///tmp/new.zip")
    tried = run(done.state, done.data, R.UpdateRequested("cpu", "avx2", bundle="/tmp/new.zip"), R.Resolved(OLD, named))
    assert tried.state is S.STAGING
    assert "rolled back here before" in U.automatic_check(done.data, OLD, CANDIDATE)
    # A release rolled back by hand is held back the same way, and says so.
    restarting = to_switching()
    updated = run(restarting.state, restarting.data, R.ServersRestarted((R.ServerVerdict("default", "ready", "cpu"),)))
    by_hand = run(updated.state, updated.data, R.RollbackRequested("cpu", "avx2", NEW, OLD, ()), R.RolledBack())
    held = run(by_hand.state, by_hand.data, R.UpdateRequested("cpu", "avx2"), R.Resolved(OLD, CANDIDATE))
    assert held.state is S.CURRENT and "(by hand)" in held.evidence["message"]
    # A newer release than the one rolled back is staged as usual.
    newer = R.Candidate("b11500", "9" * 64, "https://mirror.example/b11500.zip", "9" * 64, 1000)
    assert run(done.state, done.data, R.UpdateRequested("cpu", "avx2"), R.Resolved(OLD, newer)).state is S.STAGING


def test_a_zip_rolled_back_by_name_is_held_back_once_staged_and_known_by_its_zip_after():
    """Rolled back as a zip the user named (known by its digest only), then offered by the channel
    under its zip's sha256: staged (the digest is known only then), held back before the token
    comparison and any restart, and caught when resolved from then on."""
    named = R.Candidate(NEW.version, NEW.digest, "file:///tmp/new.zip")
    restarting = run(
        S.IDLE,
        R.UpdateData(),
        R.UpdateRequested("cpu", "avx2", bundle="/tmp/new.zip"),
        R.Resolved(OLD, named),
        R.Staged(NEW, "/staging", TOKENS),
        R.TokensCompared(TOKENS),
        R.Switched((R.ServerBaseline("default"),)),
    )
    verdict = R.ServerVerdict("default", "exited", "cpu", reason="server_crashed")
    done = run(restarting.state, restarting.data, R.ServersRestarted((verdict,)), R.RolledBack())
    assert U.rejection_of(done.data, CANDIDATE.sha256) is None  # its zip's sha256 is not known yet
    staging = run(done.state, done.data, R.UpdateRequested("cpu", "avx2"), R.Resolved(OLD, CANDIDATE))
    assert staging.state is S.STAGING
    held = step(U.ENGINE_UPDATE, staging.state, staging.data, R.Staged(NEW, "/staging", TOKENS))
    assert held.state is S.CURRENT and held.reason is ReasonCode.ENGINE_UPDATE_ROLLED_BACK
    assert held.effects == (R.CleanStaging(),)  # no comparison, no switch, no restart
    assert "rolled back here before (start gate: server default exited (server_crashed))" in held.evidence["message"]
    again = run(held.state, held.data, R.UpdateRequested("cpu", "avx2"), R.Resolved(OLD, CANDIDATE))
    assert again.state is S.CURRENT and again.effects == ()  # known by its zip now: not even staged


@given(
    st.lists(st.tuples(st.booleans(), st.sampled_from(["resolved", "fetch_failed", "rollback_by_hand"])), max_size=12)
)
def test_no_sequence_of_requests_stages_a_release_rolled_back_here(requests):
    """Whatever users and the automatic check ask, in any order, the rolled-back release is never
    staged, switched to, nor are servers restarted for it (only a rollback by hand moves the slot)."""
    result = rolled_back_once()
    state, data = result.state, result.data
    for automatic, outcome in requests:
        if outcome == "rollback_by_hand":
            result = step(U.ENGINE_UPDATE, state, data, R.RollbackRequested("cpu", "avx2", OLD, None, ()))
            state, data = result.state, result.data
            continue
        result = run(state, data, R.UpdateRequested("cpu", "avx2", automatic=automatic))
        follow = R.Resolved(OLD, CANDIDATE) if outcome == "resolved" else R.GateFailed("fetch", {"cause": "x"})
        result = step(U.ENGINE_UPDATE, result.state, result.data, follow)
        assert result.state in (S.CURRENT, S.REJECTED)
        assert not any(isinstance(e, (R.Stage, R.Switch, R.RestartServers, R.Relaunch)) for e in result.effects)
        state, data = result.state, result.data
        assert U.rejection_of(data, CANDIDATE.sha256) is not None  # never forgotten
