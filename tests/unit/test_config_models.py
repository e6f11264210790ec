"""[models.NAME] and [placement]: the sections, their checks, and each model's launch config
(daemon/config/placement.py, daemon/config/instances.py)."""

from __future__ import annotations

import pytest

from stoker.daemon.config.model import Config, ConfigError, config_diff, needs_relaunch, parse_config
from stoker.daemon.config.placement import max_loaded_for
from stoker.daemon.config.instances import instance_config, served_models
from stoker.daemon.launch.instance import ServerInstance

TWO = """
[server]
model = "/m/a.gguf"
ctx_size = 1024
parallel = 2
threads = 3
[backend]
prefer = "auto"
[models.chat]
model = "smollm2-135m-instruct"
ctx_size = 8192
prefer = "cpu"
pinned = true
[models.code]
model = "code.gguf"
default = true
idle_ttl_s = 600
"""


def test_without_models_one_default_instance_serves_server_model():
    config = parse_config('[server]\nmodel = "/m/a.gguf"\n')
    (only,) = served_models(config)
    assert only.name == "default" and only.default and not only.pinned and only.autostart
    assert only.config == config  # launched exactly as before: [server] and [backend] untouched
    assert only.public_id == "a.gguf"
    assert ServerInstance(only.name).machine_id("launch") == "launch"  # the same history ids


def test_each_model_is_server_overlaid_with_its_section(tmp_path):
    config = parse_config(TWO, base_dir=tmp_path)
    chat, code = served_models(config)
    assert [chat.name, code.name] == ["chat", "code"]
    assert chat.pinned and not chat.default and chat.autostart
    assert code.default and not code.pinned and code.idle_ttl_s == 600 and code.autostart
    assert chat.config.server.model == "smollm2-135m-instruct"
    assert chat.config.server.ctx_size == 8192 and chat.config.server.parallel == 2  # parallel from [server]
    assert chat.config.backend.prefer == "cpu" and chat.config.backend.forced
    assert code.config.server.model == str(tmp_path / "code.gguf")  # relative to the config file
    assert code.config.server.ctx_size == 1024 and code.config.backend.prefer == "auto"
    assert code.config.server.threads == 3  # every key a section does not have comes from [server]
    assert chat.public_id == "chat" and ServerInstance(chat.name).machine_id("launch") == "launch:chat"


def test_the_first_model_is_the_default_when_none_says_so():
    config = parse_config('[models.b]\nmodel = "x"\n[models.a]\nmodel = "y"\n')
    assert [(m.name, m.default, m.autostart) for m in served_models(config)] == [("b", True, True), ("a", False, False)]


def test_a_section_that_changes_relaunches_only_its_own_server(tmp_path):
    old = parse_config(TWO, base_dir=tmp_path)
    new = parse_config(TWO.replace("ctx_size = 8192", "ctx_size = 4096"), base_dir=tmp_path)
    assert config_diff(old, new) == {"models.chat"}
    (old_chat, old_code), (new_chat, new_code) = served_models(old), served_models(new)
    assert needs_relaunch(old_chat.config, new_chat.config)
    assert not needs_relaunch(old_code.config, new_code.config)


@pytest.mark.parametrize(
    "text, problem",
    [
        ('[models.Big]\nmodel = "x"\n', "models.Big: a model name is 1-32 of a-z"),
        ("[models.a]\nctx_size = 5\n", "models.a.model: missing"),
        ('[models.a]\nmodel = "x"\ncolour = 1\n', "models.a.colour: unknown key"),
        ('[models.a]\nmodel = "x"\nprefer = "tpu"\n', "models.a.prefer: must be one of"),
        ('[models.a]\nmodel = "x"\nidle_ttl_s = -1\n', "models.a.idle_ttl_s:"),
        ('[models.a]\nmodel = "x"\npinned = "yes"\n', "models.a.pinned: must be true or false"),
        (
            '[models.a]\nmodel = "x"\ndefault = true\n[models.b]\nmodel = "y"\ndefault = true\n',
            "models: default = true on a, b",
        ),
        (
            '[placement]\nmax_loaded = 1\n[models.a]\nmodel = "x"\npinned = true\n[models.b]\nmodel = "y"\npinned = true\n',
            "placement.max_loaded: 1 is fewer than the pinned models (a, b)",
        ),
        (
            '[server]\nport = 8080\n[models.a]\nmodel = "x"\n[models.b]\nmodel = "y"\n',
            "server.port: 8080 cannot be shared",
        ),
        ("[placement]\nmax_loaded = 0\n", "placement.max_loaded: must be"),
        ('models = "x"\n', "models: must be a table"),
    ],
)
def test_every_problem_is_named(text, problem):
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def test_max_loaded_auto_is_one_on_a_small_machine():
    assert Config().placement.max_loaded == "auto"
    assert max_loaded_for("auto", 4 * 2**30) == 1
    assert max_loaded_for("auto", 16 * 2**30) == 2
    assert max_loaded_for("auto", None) == 2
    assert max_loaded_for(3, 1) == 3


def test_instance_config_keeps_what_the_section_leaves_out():
    config = parse_config(TWO)
    section = config.models[1]
    assert instance_config(config, section).supervisor == config.supervisor
    assert instance_config(config, section).snapshots == config.snapshots


def test_the_engine_reports_a_name_the_client_may_send_never_the_files_path():
    (single,) = served_models(parse_config('[server]\nmodel = "/m/a.gguf"\n'))
    assert single.engine_alias == "a.gguf"  # without [models]: the model's own name, not /m/a.gguf
    (named,) = served_models(parse_config('[server]\nmodel = "smollm2"\n'))
    assert named.engine_alias == "smollm2"
    chat, code = served_models(parse_config(TWO))
    assert (chat.engine_alias, code.engine_alias) == ("chat", "code")  # --alias: answers carry the routed name


def test_a_section_added_or_removed_is_a_change():
    old = parse_config('[models.a]\nmodel = "x"\n')
    new = parse_config('[models.a]\nmodel = "x"\n[models.b]\nmodel = "y"\n')
    assert config_diff(old, new) == {"models.b"} and config_diff(new, old) == {"models.b"}
