"""`[worker]` and `[[workers]]` (daemon/config/workers.py): the bind rule and the worker list."""

from __future__ import annotations

import pytest

from stoker.daemon.config.model import Config, ConfigError, config_diff, needs_relaunch, parse_config


def test_defaults_bind_loopback_and_list_no_workers():
    config = Config()
    assert config.worker.address == "127.0.0.1:50052" and config.workers == ()


def test_a_lan_bind_needs_the_setting_that_names_the_risk():
    with pytest.raises(ConfigError) as err:
        parse_config('[worker]\nhost = "0.0.0.0"\n')
    assert "allow_unauthenticated_rpc = true" in err.value.problems[0]
    assert "no authentication" in err.value.problems[0]
    config = parse_config('[worker]\nhost = "10.0.0.2"\nallow_unauthenticated_rpc = true\n')
    assert config.worker.address == "10.0.0.2:50052"


def test_workers_are_checked_and_every_problem_listed():
    with pytest.raises(ConfigError) as err:
        parse_config(
            '[[workers]]\naddress = "a:1"\n[[workers]]\naddress = "a:1"\n'
            '[[workers]]\naddress = "nope"\n[[workers]]\naddress = "b:2"\nkey = "x"\n'
        )
    problems = err.value.problems
    assert any("listed twice" in p for p in problems)
    assert any(p.startswith("workers[2].address") for p in problems)
    assert any(p.startswith("workers[3].key: unknown key") for p in problems)


def test_a_change_of_workers_replans_the_servers_and_a_worker_change_does_not():
    old = parse_config('[[workers]]\naddress = "10.0.0.2:50052"\n')
    new = parse_config('[[workers]]\naddress = "10.0.0.2:50052"\n[[workers]]\naddress = "10.0.0.3:50052"\n')
    assert old.workers[0].address == "10.0.0.2:50052"
    assert config_diff(old, new) == {"workers.10.0.0.3:50052"} and needs_relaunch(old, new)
    assert not needs_relaunch(old, parse_config('[[workers]]\naddress = "10.0.0.2:50052"\n[worker]\nport = 1\n'))
