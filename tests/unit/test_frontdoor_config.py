"""`[frontdoor]`: a fixed documented default address, a LAN bind only with keys, and its limits."""

from __future__ import annotations

import pytest

from stoker.daemon.config.frontdoor import FRONTDOOR_PORT
from stoker.daemon.config.model import ConfigError, parse_config


def test_default_address_is_fixed_on_loopback():
    frontdoor = parse_config("").frontdoor
    assert (frontdoor.enabled, frontdoor.host, frontdoor.port) == (True, "127.0.0.1", 11436)
    assert FRONTDOOR_PORT == 11436  # documented in docs/frontdoor.md: changing it breaks configured clients
    assert not frontdoor.require_keys


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "fd00::1"])
def test_a_lan_bind_without_keys_is_refused_naming_the_fix(host):
    with pytest.raises(ConfigError) as err:
        parse_config(f'[frontdoor]\nhost = "{host}"\n')
    (problem,) = err.value.problems
    assert problem.startswith(f"frontdoor.host: {host} is reachable from other machines"), problem
    assert "require_keys = true" in problem and 'host = "127.0.0.1"' in problem  # both ways out
    with pytest.raises(ConfigError):
        parse_config(f'[frontdoor]\nhost = "{host}"\nrequire_keys = false\n')


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::"])
def test_a_lan_bind_with_keys_required_is_accepted(host):
    frontdoor = parse_config(f'[frontdoor]\nhost = "{host}"\nrequire_keys = true\n').frontdoor
    assert (frontdoor.host, frontdoor.require_keys, frontdoor.loopback_only) == (host, True, False)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1"])
def test_any_loopback_address_needs_no_keys(host):
    assert parse_config(f'[frontdoor]\nhost = "{host}"\n').frontdoor.loopback_only


@pytest.mark.parametrize("host", ["localhost", "", "example.com", 1])
def test_a_host_that_is_not_an_ip_address_is_refused(host):
    value = f'"{host}"' if isinstance(host, str) else host
    with pytest.raises(ConfigError) as err:
        parse_config(f"[frontdoor]\nhost = {value}\n")
    (problem,) = err.value.problems
    assert problem.startswith("frontdoor.host: must be an IP address"), problem


def test_limits_are_validated():
    with pytest.raises(ConfigError) as err:
        parse_config("[frontdoor]\nhold_timeout_s = 0\nmax_queue = -1\nport = 0\n")
    assert len(err.value.problems) == 3
    ok = parse_config("[frontdoor]\nhold_timeout_s = 5\nmax_queue = 0\nport = 8099\n").frontdoor
    assert (ok.hold_timeout_s, ok.max_queue, ok.port) == (5.0, 0, 8099)


def test_client_limits_have_defaults_that_fit_a_multimodal_chat():
    frontdoor = parse_config("").frontdoor
    assert frontdoor.max_body_bytes == 32 * 2**20  # base64 images in a chat fit
    assert frontdoor.max_header_bytes == 16 * 2**10
    assert (frontdoor.idle_timeout_s, frontdoor.slow_client_timeout_s) == (30.0, 60.0)


def test_client_limits_take_sizes_and_are_bounded():
    text = '[frontdoor]\nmax_body_bytes = "1 MiB"\nmax_header_bytes = 8192\nidle_timeout_s = 2\nslow_client_timeout_s = 0.5\n'
    frontdoor = parse_config(text).frontdoor
    assert (frontdoor.max_body_bytes, frontdoor.max_header_bytes) == (2**20, 8192)
    assert (frontdoor.idle_timeout_s, frontdoor.slow_client_timeout_s) == (2.0, 0.5)
    bad = (
        '[frontdoor]\nmax_body_bytes = 0\nmax_header_bytes = "2 MiB"\nidle_timeout_s = 0\nslow_client_timeout_s = -1\n'
    )
    with pytest.raises(ConfigError) as err:
        parse_config(bad)
    assert sorted(p.split(":")[0] for p in err.value.problems) == [
        "frontdoor.idle_timeout_s",
        "frontdoor.max_body_bytes",
        "frontdoor.max_header_bytes",
        "frontdoor.slow_client_timeout_s",
    ]


def test_the_drain_bound_is_configured_and_checked():
    """How long a planned stop lets the front door's requests in flight finish: 30 s unless
    [frontdoor] drain_timeout_s says otherwise (0: stop at once); the launch machine gets it."""
    from stoker.daemon.launch.supervisor import launch_settings

    assert parse_config("").frontdoor.drain_timeout_s == 30.0
    config = parse_config("[frontdoor]\ndrain_timeout_s = 300\n")
    assert config.frontdoor.drain_timeout_s == 300.0 and launch_settings(config).drain_timeout == 300.0
    assert parse_config("[frontdoor]\ndrain_timeout_s = 0\n").frontdoor.drain_timeout_s == 0.0
    for bad in ("-1", "3601", '"long"'):
        with pytest.raises(ConfigError) as err:
            parse_config(f"[frontdoor]\ndrain_timeout_s = {bad}\n")
        (problem,) = err.value.problems
        assert problem.startswith("frontdoor.drain_timeout_s: must be"), problem


@pytest.mark.parametrize(
    ("environ", "host", "port"),
    [
        ({"STOKER_HOST": "127.0.0.2"}, "127.0.0.2", 9000),
        ({"STOKER_HOST": "127.0.0.1:8181"}, "127.0.0.1", 8181),
        ({"STOKER_HOST": "http://[::1]:8182"}, "::1", 8182),
        ({"STOKER_HOST": "127.0.0.1:8181", "STOKER_PORT": "8183"}, "127.0.0.1", 8183),
        ({"STOKER_PORT": "8184"}, "127.0.0.3", 8184),
        ({}, "127.0.0.3", 9000),
    ],
)
def test_the_environment_sets_the_front_door_address_over_the_file(environ, host, port):
    config = parse_config("[frontdoor]\nhost = '127.0.0.3'\nport = 9000\n", environ=environ)
    assert (config.frontdoor.host, config.frontdoor.port) == (host, port)


@pytest.mark.parametrize(
    ("environ", "problem"),
    [
        ({"STOKER_PORT": "http"}, "STOKER_PORT: must be a port number"),
        ({"STOKER_HOST": "127.0.0.1:99999"}, "STOKER_HOST: must be host"),
        ({"STOKER_HOST": "http://127.0.0.1:80/v1"}, "STOKER_HOST: must be host"),
        ({"STOKER_HOST": "0.0.0.0"}, "frontdoor.host: 0.0.0.0 is reachable from other machines"),
        ({"STOKER_PORT": "0"}, "frontdoor.port"),
    ],
)
def test_a_bad_address_in_the_environment_is_a_config_problem(environ, problem):
    with pytest.raises(ConfigError) as caught:
        parse_config("", environ=environ)
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_cors_origins_default_to_none_and_take_origins_or_any():
    """[frontdoor] cors_origins: empty unless set (only the front door's own pages); origins are
    scheme://host[:port], kept as a browser writes them, or "*"."""
    assert parse_config("").frontdoor.cors_origins == ()
    config = parse_config('[frontdoor]\ncors_origins = ["https://App.Example", "http://localhost:3000", "*"]\n')
    assert config.frontdoor.cors_origins == ("https://app.example", "http://localhost:3000", "*")


@pytest.mark.parametrize(
    "value, says",
    [
        ('"https://app.example"', "must be a list of origins"),
        ('["app.example"]', "is not an origin"),
        ('["ftp://app.example"]', "is not an origin"),
        ('["https://app.example/"]', "has more than an origin"),
        ('["https://app.example/chat"]', "has more than an origin"),
        ('["http://localhost:99999"]', "has a port that is not a number"),
        ("[1]", "must be a list of origins"),
    ],
)
def test_cors_origins_that_are_not_origins_are_refused(value, says):
    with pytest.raises(ConfigError) as err:
        parse_config(f"[frontdoor]\ncors_origins = {value}\n")
    (problem,) = err.value.problems
    assert problem.startswith("frontdoor.cors_origins: ") and says in problem, problem
