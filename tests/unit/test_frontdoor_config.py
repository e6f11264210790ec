"""`[frontdoor]`: a fixed documented default address, and loopback only until keys are wired."""

from __future__ import annotations

import pytest

from daemon.config.frontdoor import FRONTDOOR_PORT
from daemon.config.model import ConfigError, parse_config


def test_default_address_is_fixed_on_loopback():
    frontdoor = parse_config("").frontdoor
    assert (frontdoor.enabled, frontdoor.host, frontdoor.port) == (True, "127.0.0.1", 11436)
    assert FRONTDOOR_PORT == 11436  # documented in docs/frontdoor.md: changing it breaks configured clients


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::"])
def test_a_lan_bind_is_refused_with_its_reason(host):
    with pytest.raises(ConfigError) as err:
        parse_config(f'[frontdoor]\nhost = "{host}"\n')
    (problem,) = err.value.problems
    assert problem.startswith("frontdoor.host:") and "user API keys" in problem


def test_limits_are_validated():
    with pytest.raises(ConfigError) as err:
        parse_config("[frontdoor]\nhold_timeout_s = 0\nmax_queue = -1\nport = 0\n")
    assert len(err.value.problems) == 3
    ok = parse_config("[frontdoor]\nhold_timeout_s = 5\nmax_queue = 0\nport = 8099\n").frontdoor
    assert (ok.hold_timeout_s, ok.max_queue, ok.port) == (5.0, 0, 8099)
